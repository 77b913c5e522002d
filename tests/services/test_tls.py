"""TLS on gRPC links (card.common.tls): a real card-cache server in-process with certificates made
at test time; real channels, plaintext and TLS, with and without client certificates.
The trio with TLS and tokens on every link: tests/services/test_cache_auth.py."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from card.cache_service.config import CacheConfig
from card.cache_service.server import create_server
from card.common.channels import channel, health_status, wait_serving
from card.common.serving import add_health, bind, make_server, set_serving, start_health_port
from card.common.tls import TlsConfig
from card.engine.shared.errors import InvalidArgument
from card.v1 import cache_pb2, cache_pb2_grpc
from tests.services.cache_helpers import TIMEOUT
from tests.services.certs import Pki, make_pki
from tests.services.conftest import free_port


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """Another CA and its certificate: valid, but nobody here trusts it."""
    return make_pki(tmp_path_factory.mktemp("stranger"), name="stranger")


def _serve(redis_url: str, redis_prefix: str, tls: TlsConfig) -> tuple[object, str]:
    config = CacheConfig(host="127.0.0.1", port=0, redis_url=redis_url, redis_prefix=redis_prefix,
                         metrics_port=0, heartbeat_interval_s=30.0, health_check_interval_s=0.1, tls=tls)
    server, port = create_server(config.addr, config)
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def mutual(redis_url: str, redis_prefix: str, pki: Pki) -> Iterator[tuple[object, str]]:
    server, addr = _serve(redis_url, redis_prefix, pki.tls(client_auth=True))
    wait_serving(addr, TIMEOUT, tls=pki.tls())
    yield server, addr
    server.stop(1.0).wait()


def status(addr: str, tls: TlsConfig) -> grpc.StatusCode:
    try:
        with channel(addr, tls=tls) as ch:
            cache_pb2_grpc.CacheServiceStub(ch).Status(cache_pb2.StatusRequest(), timeout=TIMEOUT)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_only_clients_with_a_certificate_from_the_trusted_ca_are_served(mutual, pki: Pki,
                                                                       stranger: Pki) -> None:
    _, addr = mutual
    assert status(addr, pki.tls()) is grpc.StatusCode.OK
    # plaintext: the handshake fails before any byte of the request is read
    assert status(addr, TlsConfig()) is grpc.StatusCode.UNAVAILABLE
    # TLS that trusts the server but shows no certificate (mutual TLS asks for one)
    assert status(addr, TlsConfig(ca=str(pki.ca))) is grpc.StatusCode.UNAVAILABLE
    # a certificate from another CA
    assert status(addr, TlsConfig(cert=str(stranger.cert), key=str(stranger.key), ca=str(pki.ca))) \
        is grpc.StatusCode.UNAVAILABLE
    # a client that does not trust the server's CA refuses the server
    assert status(addr, TlsConfig(cert=str(pki.cert), key=str(pki.key), ca=str(stranger.ca))) \
        is grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError):
        health_status(addr)  # plaintext probes too: the plaintext health port is for them


def test_server_only_tls_serves_clients_without_certificates_and_checks_names(
        redis_url: str, redis_prefix: str, pki: Pki) -> None:
    server, addr = _serve(redis_url, redis_prefix, TlsConfig(cert=str(pki.cert), key=str(pki.key)))
    try:
        assert status(addr, TlsConfig(ca=str(pki.ca))) is grpc.StatusCode.OK
        assert status(addr, TlsConfig()) is grpc.StatusCode.UNAVAILABLE
        # the certificate names 127.0.0.1, ::1 and localhost, nothing else
        wrong_name = TlsConfig(ca=str(pki.ca), server_name="card-cache.example")
        assert status(addr, wrong_name) is grpc.StatusCode.UNAVAILABLE
        assert status(addr, TlsConfig(ca=str(pki.ca), server_name="localhost")) is grpc.StatusCode.OK
    finally:
        server.stop(1.0).wait()


def test_the_plaintext_health_port_answers_probes_and_nothing_else(mutual) -> None:
    server, _ = mutual
    probe, port = start_health_port(server.health, "127.0.0.1", 0)
    assert probe is not None
    try:
        assert health_status(f"127.0.0.1:{port}") == "SERVING"
        assert status(f"127.0.0.1:{port}", TlsConfig()) is grpc.StatusCode.UNIMPLEMENTED
        server.shutdown_sessions()  # draining: probes see it
        assert health_status(f"127.0.0.1:{port}") == "NOT_SERVING"
    finally:
        probe.stop(0)


def test_a_renewed_certificate_is_served_from_the_next_handshake(
        redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    old = make_pki(tmp_path / "old")
    live = tmp_path / "live"
    live.mkdir()
    for f in ("cert.pem", "key.pem", "ca.pem"):
        shutil.copy(old.cert.parent / f, live / f)
    files = Pki(live / "ca.pem", live / "cert.pem", live / "key.pem")
    server, addr = _serve(redis_url, redis_prefix, TlsConfig(cert=str(files.cert), key=str(files.key)))
    try:
        assert status(addr, TlsConfig(ca=str(old.ca))) is grpc.StatusCode.OK
        new = make_pki(tmp_path / "new")  # cert-manager renews the Secret in place
        for f in ("key.pem", "cert.pem"):
            shutil.copy(new.cert.parent / f, live / f)
        assert status(addr, TlsConfig(ca=str(new.ca))) is grpc.StatusCode.OK
        assert status(addr, TlsConfig(ca=str(old.ca))) is grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(1.0).wait()


def test_a_client_presents_its_renewed_files_when_it_reconnects(tmp_path: Path) -> None:
    """The client's certificate, key and CA are renewed in place (here to a new CA: the old one is
    retired), and the server restarts trusting only the new CA. The client's channel, made before
    the renewal, reconnects with the new files; gRPC alone would keep the files it read at start
    and fail every call from then on (UNAVAILABLE: the handshake fails both ways)."""
    old, new = make_pki(tmp_path / "old"), make_pki(tmp_path / "new")
    live = tmp_path / "live"
    live.mkdir()
    for f in ("cert.pem", "key.pem", "ca.pem"):
        shutil.copy(old.cert.parent / f, live / f)
    addr = f"127.0.0.1:{free_port()}"

    def serve(pki: Pki) -> grpc.Server:  # mutual TLS, trusting ``pki``'s CA only
        server = make_server(4)
        set_serving(add_health(server), True)
        bind(server, addr, pki.tls(client_auth=True))
        server.start()
        return server

    def check() -> str:
        reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    server = serve(old)
    with channel(addr, tls=TlsConfig(cert=str(live / "cert.pem"), key=str(live / "key.pem"),
                                     ca=str(live / "ca.pem"))) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            assert check() == "SERVING"
            shutil.copy(new.cert, live / "cert.pem")  # mid-rotation: new certificate, old key
            assert check() == "SERVING"  # the current channel stays in use
            for f in ("key.pem", "ca.pem"):
                shutil.copy(new.cert.parent / f, live / f)
            server.stop(0).wait()
            server = serve(new)
            assert check() == "SERVING"  # the same stub: a new connection with the renewed files
        finally:
            server.stop(0).wait()


def test_bad_tls_files_fail_at_start_with_the_path(tmp_path: Path, pki: Pki) -> None:
    with pytest.raises(InvalidArgument, match="go together"):
        TlsConfig(cert=str(pki.cert))
    with pytest.raises(InvalidArgument, match="cannot read the TLS certificate"):
        TlsConfig(cert=str(tmp_path / "missing.pem"), key=str(pki.key))
    not_pem = tmp_path / "ca.der"
    not_pem.write_bytes(b"\x30\x82")
    with pytest.raises(InvalidArgument, match="not PEM"):
        TlsConfig(ca=str(not_pem))
    with pytest.raises(InvalidArgument, match="--tls-client-auth needs"):
        TlsConfig(cert=str(pki.cert), key=str(pki.key), client_auth=True)
    other = make_pki(tmp_path / "other")
    with pytest.raises(InvalidArgument, match="does not go with the certificate"):
        TlsConfig(cert=str(pki.cert), key=str(other.key))
