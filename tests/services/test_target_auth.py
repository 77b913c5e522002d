"""card-target's guarded ports: one key (``--api-key``) on gRPC Generate/Info and on every HTTP path
but /health, checked before a body is read; the HTTP body limit (413); /metrics behind the key or
off; HTTPS on the HTTP front (``--http-tls-cert/--http-tls-key``), renewed in place; Retry-After on
refusals for load; the warning when HTTP listens beyond loopback without a key.

card-target runs as a user starts it (the entry point as a subprocess, a tiny checkpoint with the
SmolLM2 tokenizer, plain decoding); the clients are real: grpc, card-client, the ``openai``
package, curl and a raw socket. The Guard and the TLS reload are also driven in-process, on an
app whose model has not loaded (fast, no subprocess)."""

from __future__ import annotations

import json
import logging
import os
import re
import select
import shutil
import socket
import ssl
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from card.client.trio import HTTP_LISTENING, LISTENING, console_script
from card.common.channels import channel, wait_serving
from card.common.tls import PLAINTEXT, TlsConfig
from card.engine.loading.models import ModelConfig
from card.engine.shared.errors import InvalidArgument
from card.target_service.config import TargetConfig
from card.target_service.frontend import Frontend
from card.target_service.openai_api import TLS_CLOSE_S, HttpServer, create_app
from card.v1 import target_pb2, target_pb2_grpc
from tests.services.certs import Pki, make_pki
from tests.services.conftest import stop_process
from tests.services.e2e_support import wait_until
from tests.tiny_models import save_tiny_checkpoint

KEY = "sk-test-" + uuid.uuid4().hex
MIB = 2**20


# ---- card-target as a subprocess --------------------------------------------------------------
@dataclass
class Target:
    proc: subprocess.Popen
    stdout: Path
    stderr: Path
    grpc_addr: str = ""
    http_addr: str = ""

    def wait_line(self, pattern: re.Pattern, path: Path | None = None, timeout_s: float = 120) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = pattern.search((path or self.stdout).read_text(errors="replace"))
            if match:
                return match
            if self.proc.poll() is not None:
                raise AssertionError(f"card-target exited ({self.proc.returncode}):\n"
                                     f"{self.stderr.read_text(errors='replace')[-3000:]}")
            time.sleep(0.05)
        raise AssertionError(f"no {pattern.pattern!r} within {timeout_s}s")

    def stop(self) -> None:
        stop_process(self.proc, 30)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("auth-model") / "target", seed=0))


def start_target(logs: Path, *args: str, env: dict[str, str] | None = None) -> Target:
    logs.mkdir(parents=True, exist_ok=True)
    out, err = logs / "stdout.log", logs / "stderr.log"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CARD_")}
    environ.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen([console_script("card-target"), "--port", "0", "--metrics-port", "0",
                                 "--threads", "1", *args], stdout=o, stderr=e, stdin=subprocess.DEVNULL,
                                env=environ, start_new_session=True)
    return Target(proc, out, err)


def serving(target: Target) -> Target:
    match = target.wait_line(LISTENING)
    target.grpc_addr = f"127.0.0.1:{match.group(3)}"
    match = target.wait_line(HTTP_LISTENING)
    target.http_addr = f"127.0.0.1:{match.group(2)}"
    wait_serving(target.grpc_addr, timeout_s=120)  # health: open without the key
    return target


@pytest.fixture(scope="module")
def keyed(checkpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """card-target with an API key (from its variable, as the manifests set it), plain HTTP."""
    target = start_target(tmp_path_factory.mktemp("keyed"), "--model", checkpoint, "--http-port", "0",
                          env={"CARD_TARGET_API_KEY": KEY})
    try:
        yield serving(target)
    finally:
        target.stop()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def grpc_code(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def generate(ch: grpc.Channel) -> list[target_pb2.GenerateResponse]:
    request = target_pb2.GenerateRequest(prompt="Hello", max_new_tokens=3, mode="vanilla", ignore_eos=True)
    return list(target_pb2_grpc.TargetServiceStub(ch).Generate(request, timeout=60))


def info(ch: grpc.Channel) -> target_pb2.TargetInfo:
    return target_pb2_grpc.TargetServiceStub(ch).Info(target_pb2.InfoRequest(), timeout=10)


# ---- gRPC ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_grpc_generate_and_info_need_the_key_and_health_stays_open(keyed: Target) -> None:
    for token in (None, "wrong", KEY + "x"):
        with channel(keyed.grpc_addr, token) as ch:
            assert grpc_code(lambda ch=ch: generate(ch)) is grpc.StatusCode.UNAUTHENTICATED
            assert grpc_code(lambda ch=ch: info(ch)) is grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(keyed.grpc_addr) as ch:
        with pytest.raises(grpc.RpcError) as err:
            info(ch)
        assert "--api-key" in err.value.details() and KEY not in err.value.details()
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    with channel(keyed.grpc_addr, KEY) as ch:
        assert info(ch).context_window > 0
        assert generate(ch)[-1].final.stats.new_tokens == 3


@pytest.mark.slow
def test_card_client_presents_the_key_from_its_flag_or_variable(keyed: Target) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARD_")}
    cmd = [console_script("card-client"), "generate", "--target", keyed.grpc_addr, "--mode", "vanilla",
           "--max-new-tokens", "3", "--ignore-eos", "--json", "Hello"]
    for extra, more_env in (([], {"CARD_CLIENT_API_KEY": KEY}), (["--api-key", KEY], {})):
        out = subprocess.run([*cmd, *extra], capture_output=True, text=True, env={**env, **more_env},
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["stats"]["new_tokens"] == 3
    refused = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode == 2
    assert "UNAUTHENTICATED" in refused.stderr and "--api-key" in refused.stderr
    assert "Traceback" not in refused.stderr


# ---- HTTP: the key before the body, the body limit ------------------------------------------------
@pytest.mark.slow
def test_a_300_mb_body_without_the_key_is_refused_before_it_is_read(keyed: Target) -> None:
    """The issue's probe: 300 MB posted without the key. The 401 is readable while the body is still
    being sent, and the target's resident memory stays within 50 MB the whole time (the rest of
    the body is read and dropped). Before the Guard, FastAPI read all 300 MB, then refused."""
    host, port = keyed.http_addr.rsplit(":", 1)
    pid = keyed.proc.pid
    for _ in range(3):  # warm-up: the first requests allocate what every request uses
        assert httpx.post(f"http://{keyed.http_addr}/v1/completions", json={"model": "x", "prompt": "hi"},
                          timeout=30).status_code == 401
    before = peak = rss_mib(pid)
    total, chunk = 300 * MIB, b"a" * MIB
    sent, answered_at = 0, None
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {total}\r\n\r\n".encode())
        while sent < total:
            sock.sendall(chunk)
            sent += len(chunk)
            peak = max(peak, rss_mib(pid))
            if answered_at is None and select.select([sock], [], [], 0)[0]:
                answered_at = sent
        reply = sock.recv(65536).decode(errors="replace")
    peak = max(peak, rss_mib(pid))
    print(f"RSS {before:.0f} MiB -> peak {peak:.0f} MiB (+{peak - before:.1f}); 401 readable after "
          f"{answered_at} of {total} bytes sent")
    assert reply.startswith("HTTP/1.1 401"), reply[:200]
    assert answered_at is not None and answered_at <= 64 * MIB, "the 401 came only after the body"
    assert peak - before < 50, f"resident memory grew from {before:.0f} to {peak:.0f} MiB"
    # the connection drained the body and the target still answers
    assert httpx.get(f"http://{keyed.http_addr}/health", timeout=10).status_code == 200


@pytest.mark.slow
def test_a_body_over_the_limit_with_the_key_is_413(keyed: Target) -> None:
    api = openai.OpenAI(base_url=f"http://{keyed.http_addr}/v1", api_key=KEY, max_retries=0, timeout=60)
    (model,) = api.models.list().data
    with pytest.raises(openai.APIStatusError) as err:  # 5 MB of prompt, Content-Length over 4 MB
        api.completions.create(model=model.id, prompt="a" * (5 * MIB), max_tokens=1)
    assert err.value.status_code == 413 and err.value.body["code"] == "request_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it streams
        yield b'{"model": "' + model.id.encode() + b'", "prompt": "'
        for _ in range(5):
            yield b"a" * MIB
        yield b'"}'

    reply = httpx.post(f"http://{keyed.http_addr}/v1/completions", content=chunked(), timeout=60,
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
    ok = api.completions.create(model=model.id, prompt="a " * 100, max_tokens=2, temperature=0,
                                extra_body={"ignore_eos": True, "mode": "vanilla"})
    assert ok.usage.completion_tokens == 2


@pytest.mark.slow
def test_metrics_on_the_http_port_need_the_key(keyed: Target) -> None:
    url = f"http://{keyed.http_addr}"
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 401
    page = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert page.status_code == 200 and "card_target_" in page.text
    assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
    curl = shutil.which("curl")
    if curl:
        out = subprocess.run([curl, "-s", "-o", "/dev/null", "-w", "%{http_code}", f"{url}/v1/models"],
                             capture_output=True, text=True, timeout=30)
        assert out.stdout == "401"


# ---- HTTPS, and the warning on an open interface ------------------------------------------------
@pytest.mark.slow
def test_https_front_with_openai_and_curl_and_the_open_interface_warning(checkpoint: str,
                                                                          tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    target = start_target(tmp_path / "logs", "--model", checkpoint, "--http-port", "0", "--http-host",
                          "0.0.0.0", "--http-tls-cert", str(pki.cert), "--http-tls-key", str(pki.key))
    try:
        target.wait_line(re.compile(r"WARNING .*the HTTP API listens on 0\.0\.0\.0 without --api-key"),
                         target.stderr)
        serving(target)
        http = httpx.Client(verify=ssl.create_default_context(cafile=str(pki.ca)), timeout=60)
        api = openai.OpenAI(base_url=f"https://{target.http_addr}/v1", api_key="unused", max_retries=0,
                            http_client=http)
        (model,) = api.models.list().data
        reply = api.completions.create(model=model.id, prompt="Hello", max_tokens=2, temperature=0,
                                       extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 2
        with pytest.raises(httpx.HTTPError):  # plaintext to the TLS port: no HTTP answer
            httpx.get(f"http://{target.http_addr}/health", timeout=10)
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA
            httpx.get(f"https://{target.http_addr}/health", timeout=10)
        curl = shutil.which("curl")
        if curl:
            out = subprocess.run([curl, "-sS", "--cacert", str(pki.ca), f"https://{target.http_addr}/v1/models"],
                                 capture_output=True, text=True, timeout=30)
            assert out.returncode == 0 and json.loads(out.stdout)["data"][0]["id"] == model.id, out.stderr
    finally:
        target.stop()


# ---- in-process: the Guard, Retry-After, the TLS reload -----------------------------------------
@pytest.fixture
def loading_front() -> Frontend:
    """A front whose model never loads: every /v1 call is UNAVAILABLE (503)."""
    return Frontend(TargetConfig(model=ModelConfig("default")), None)


def http_server(front: Frontend, tls: TlsConfig = PLAINTEXT, **kw: object) -> HttpServer:
    server = HttpServer(create_app(front, **kw), "127.0.0.1", 0, 1.0, tls=tls)  # type: ignore[arg-type]
    server.start()
    return server


def test_refusals_for_load_carry_retry_after_and_metrics_can_be_off(loading_front: Frontend) -> None:
    server = http_server(loading_front, api_key=KEY, serve_metrics=False)
    try:
        url, auth = f"http://127.0.0.1:{server.port}", {"Authorization": f"Bearer {KEY}"}
        reply = httpx.get(f"{url}/v1/models", headers=auth, timeout=10)
        assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
        assert reply.json()["error"]["code"] == "UNAVAILABLE"
        assert httpx.get(f"{url}/metrics", headers=auth, timeout=10).status_code == 404
        assert httpx.get(f"{url}/metrics", timeout=10).status_code == 401  # no key: nothing to learn
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503  # open, loading
        unauthorized = httpx.post(f"{url}/v1/completions", json={}, headers={"Authorization": "Bearer x"},
                                  timeout=10)
        assert unauthorized.status_code == 401 and "retry-after" not in unauthorized.headers
    finally:
        server.stop(5)


def test_a_renewed_http_certificate_is_served_within_a_second(loading_front: Frontend, tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    old, new = make_pki(tmp_path / "old"), make_pki(tmp_path / "new")
    live = tmp_path / "live"
    live.mkdir()
    for f in ("cert.pem", "key.pem"):
        shutil.copy(old.cert.parent / f, live / f)
    files = Pki(old.ca, live / "cert.pem", live / "key.pem")
    server = http_server(loading_front, TlsConfig(cert=str(files.cert), key=str(files.key)))

    def health(ca: Path) -> int:
        verify = ssl.create_default_context(cafile=str(ca))
        return httpx.get(f"https://127.0.0.1:{server.port}/health", verify=verify, timeout=10).status_code

    def refused_half_pair() -> bool:
        return any("cannot be read yet" in r.getMessage() for r in caplog.records)

    try:
        assert health(old.ca) == 503  # loading, over TLS
        with caplog.at_level(logging.WARNING, logger="card.common.tls"):
            shutil.copy(new.cert, live / "cert.pem")  # mid-rotation: the new certificate, the old key
            wait_until(refused_half_pair, timeout_s=5, what="the reloader to look at the half-renewed pair")
        assert health(old.ca) == 503  # the previous pair stays in use
        shutil.copy(new.key, live / "key.pem")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                if health(new.ca) == 503:
                    break
            except httpx.ConnectError:
                time.sleep(0.2)
        else:
            raise AssertionError("the renewed certificate was not served within 5 s")
        with pytest.raises(httpx.ConnectError):
            health(old.ca)
    finally:
        server.stop(5)


def test_an_idle_tls_connection_does_not_hold_the_shutdown(loading_front: Frontend, tmp_path: Path) -> None:
    """A pooled HTTPS client between requests (any OpenAI client) never sends TLS's close_notify.
    The server closing its connection at shutdown waited for it asyncio's default 30 s, so a
    SIGTERM took the whole grace (30 s) with nothing running; now it waits TLS_CLOSE_S."""
    pki = make_pki(tmp_path / "pki")
    server = HttpServer(create_app(loading_front), "127.0.0.1", 0, 30.0,
                        tls=TlsConfig(cert=str(pki.cert), key=str(pki.key)))
    server.start()
    client = httpx.Client(verify=ssl.create_default_context(cafile=str(pki.ca)), timeout=10)
    try:
        assert client.get(f"https://127.0.0.1:{server.port}/health").status_code == 503
        assert len(client._transport._pool.connections) == 1  # kept alive, idle
        t0 = time.monotonic()
        server.stop(30)
        took = time.monotonic() - t0
        assert not server._thread.is_alive() and took < TLS_CLOSE_S + 5, took  # the grace was 30 s
    finally:
        client.close()


def test_http_tls_flags_are_checked_at_start(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    model = ModelConfig("default")
    with pytest.raises(InvalidArgument, match="--http-tls-cert and --http-tls-key go together"):
        TargetConfig(model=model, http_tls_cert=str(pki.cert))
    with pytest.raises(InvalidArgument, match="cannot read the TLS key"):
        TargetConfig(model=model, http_tls_cert=str(pki.cert), http_tls_key=str(tmp_path / "missing"))
    other = make_pki(tmp_path / "other")
    with pytest.raises(InvalidArgument, match="does not go with"):
        TargetConfig(model=model, http_tls_cert=str(pki.cert), http_tls_key=str(other.key))
    for bad in ({"max_waiting": -1}, {"queue_timeout_s": 0}, {"max_body_mb": 0}):
        with pytest.raises(InvalidArgument):
            TargetConfig(model=model, **bad)  # type: ignore[arg-type]
    config = TargetConfig(model=model, http_tls_cert=str(pki.cert), http_tls_key=str(pki.key))
    assert config.http_tls.serves and config.max_body_bytes == 4 * MIB
