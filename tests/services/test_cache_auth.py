"""Tokens on the cache (card.common.auth): each RPC needs its roles' token, health stays open.

A real card-cache server (in-process, on a loopback port) with Redis; clients over real channels;
then a trio started from the entry points with tokens and mutual TLS on every link (certificates
made at test time), served exactly, and the operator CLI.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator

import grpc
import pytest

from card.cache_service.config import CacheConfig
from card.cache_service.server import create_server
from card.client.remote import generate_remote
from card.client.trio import LocalTrio, console_script
from card.common.auth import CACHE_ROLES
from card.common.channels import channel, health_status, wait_serving
from card.common.tls import TlsConfig
from card.engine.shared.config import SamplingParams, StopParams
from card.engine.shared.errors import Unavailable
from card.v1 import cache_pb2, cache_pb2_grpc
from tests.services.cache_helpers import FP_A, TIMEOUT, HandDraft, HandTarget
from tests.services.certs import make_pki

DRAFT_TOKEN = "draft-" + uuid.uuid4().hex
TARGET_TOKEN = "target-" + uuid.uuid4().hex
OPERATOR_TOKEN = "operator-" + uuid.uuid4().hex

TARGET, DRAFT, OPERATOR = ("target",), ("draft",), ("operator",)
# every CacheService RPC with a harmless request; the roles whose token it takes
CALLS = {
    "OpenSession": (TARGET, lambda s: s.OpenSession(cache_pb2.OpenSessionRequest(), timeout=TIMEOUT)),
    "Step": (TARGET, lambda s: s.Step(cache_pb2.StepRequest(), timeout=TIMEOUT)),
    "StepBatch": (TARGET, lambda s: s.StepBatch(cache_pb2.StepBatchRequest(), timeout=TIMEOUT)),
    "CloseSession": (TARGET, lambda s: s.CloseSession(cache_pb2.CloseSessionRequest(), timeout=TIMEOUT)),
    "Status": (TARGET + OPERATOR, lambda s: s.Status(cache_pb2.StatusRequest(), timeout=TIMEOUT)),
    "RegisterDraft": (DRAFT, lambda s: s.RegisterDraft(cache_pb2.RegisterDraftRequest(), timeout=TIMEOUT)),
    "Commands": (DRAFT, lambda s: next(s.Commands(cache_pb2.CommandsRequest(), timeout=TIMEOUT))),
    "PublishLayers": (DRAFT, lambda s: s.PublishLayers(iter([cache_pb2.LayerMessage()]), timeout=TIMEOUT)),
    "Heartbeat": (DRAFT, lambda s: s.Heartbeat(cache_pb2.HeartbeatRequest(), timeout=TIMEOUT)),
    "Drain": (OPERATOR, lambda s: s.Drain(cache_pb2.DrainRequest(), timeout=TIMEOUT)),
    "SetPoolWeights": (OPERATOR, lambda s: s.SetPoolWeights(cache_pb2.PoolWeightsRequest(), timeout=TIMEOUT)),
}


def test_every_cache_rpc_is_guarded_and_tried_here() -> None:
    """A new RPC must get roles (card.common.auth.CACHE_ROLES) and a row in CALLS above."""
    methods = cache_pb2.DESCRIPTOR.services_by_name["CacheService"].methods_by_name
    assert set(methods) == set(CALLS)
    assert {f"/card.v1.CacheService/{m}": roles for m, (roles, _) in CALLS.items()} == CACHE_ROLES


def guarded_cache(redis_url: str, redis_prefix: str, **tokens: str) -> Iterator[str]:
    config = CacheConfig(host="127.0.0.1", port=0, redis_url=redis_url, redis_prefix=redis_prefix,
                         metrics_port=0, heartbeat_interval_s=30.0, health_check_interval_s=0.1, **tokens)
    server, port = create_server(config.addr, config)
    server.start()
    addr = f"127.0.0.1:{port}"
    wait_serving(addr, TIMEOUT)
    yield addr
    server.stop(1.0).wait()


@pytest.fixture
def guarded(redis_url: str, redis_prefix: str) -> Iterator[str]:
    yield from guarded_cache(redis_url, redis_prefix, draft_token=DRAFT_TOKEN, target_token=TARGET_TOKEN,
                             operator_token=OPERATOR_TOKEN)


def code_of(fn, stub) -> grpc.StatusCode:
    try:
        fn(stub)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("token", [None, "wrong", DRAFT_TOKEN, TARGET_TOKEN, OPERATOR_TOKEN])
def test_every_rpc_needs_its_roles_token(guarded: str, token: str | None) -> None:
    role_of = {DRAFT_TOKEN: "draft", TARGET_TOKEN: "target", OPERATOR_TOKEN: "operator"}.get(token or "")
    with channel(guarded, token) as ch:
        stub = cache_pb2_grpc.CacheServiceStub(ch)
        for name, (roles, call) in CALLS.items():
            code = code_of(call, stub)
            if role_of in roles:  # let through: whatever the servicer makes of the empty request
                assert code is not grpc.StatusCode.UNAUTHENTICATED, name
            else:
                assert code is grpc.StatusCode.UNAUTHENTICATED, f"{name} with {token!r}: {code}"
    assert health_status(guarded) == "SERVING"  # probes need no token


def test_without_an_operator_token_no_target_can_drain(redis_url: str, redis_prefix: str) -> None:
    """A cache with a target token and no operator token refuses Drain and SetPoolWeights to
    everyone, the target's token included, and says which flag opens them; Status still takes
    the target's token (a target lists the drafts with it)."""
    for addr in guarded_cache(redis_url, redis_prefix, target_token=TARGET_TOKEN):
        with channel(addr, TARGET_TOKEN) as ch:
            stub = cache_pb2_grpc.CacheServiceStub(ch)
            assert code_of(CALLS["Status"][1], stub) is grpc.StatusCode.OK
            for name in ("Drain", "SetPoolWeights"):
                with pytest.raises(grpc.RpcError) as err:
                    CALLS[name][1](stub)
                assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
                assert "--operator-token" in err.value.details(), err.value.details()


def test_token_holders_serve_a_session(guarded: str) -> None:
    draft = HandDraft(guarded, "w1", token=DRAFT_TOKEN)
    target = HandTarget(guarded, token=TARGET_TOKEN)
    try:
        opened = target.open([1, 2, 3], fingerprint=FP_A)
        assert opened.session_id and opened.draft == "w1"
        with pytest.raises(grpc.RpcError) as err:  # a draft token opens no session
            HandTarget(guarded, token=DRAFT_TOKEN).open([1, 2, 3])
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert "target token" in err.value.details()
    finally:
        draft.close()
        target.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_trio_with_tokens_and_mutual_tls_is_exact_and_refuses_strangers(redis_server, tmp_path):
    from tests.tiny_models import save_tiny_checkpoint

    model = str(save_tiny_checkpoint(tmp_path / "target", seed=0))
    pki = make_pki(tmp_path / "pki")
    tls = pki.tls(client_auth=True)
    # the target's default speculation control (auto): it speculates from the start
    trio = LocalTrio(target_model=model, draft_model=model, draft_name="same", target_threads=1,
                     draft_threads=1, dtype="float64", log_dir=tmp_path / "logs", redis_url=redis_server.url,
                     draft_token=DRAFT_TOKEN, target_token=TARGET_TOKEN, tls=tls, start_timeout_s=240,
                     extra_args={"cache": ["--redis-prefix", f"auth-{uuid.uuid4().hex[:8]}:"]})
    with trio:
        stop = StopParams(32, ignore_eos=True)
        card = generate_remote(trio.target_addr, "Name three colours.", sampling=SamplingParams(), stop=stop,
                               draft="same", tls=tls)
        plain = generate_remote(trio.target_addr, "Name three colours.", sampling=SamplingParams(), stop=stop,
                                mode="vanilla", tls=tls)
        # the draft registered and the target reached the cache over TLS with their tokens
        assert card.draft == "same" and card.token_ids == plain.token_ids
        assert card.stats.step_rtt_ms  # Steps were answered over the TLS link
        with channel(trio.cache_addr, tls=tls) as ch:  # a certificate is not a token
            stub = cache_pb2_grpc.CacheServiceStub(ch)
            for name, (_, call) in CALLS.items():
                assert code_of(call, stub) is grpc.StatusCode.UNAUTHENTICATED, name
        for addr in (trio.cache_addr, trio.target_addr, trio.draft_addr):  # plaintext reaches nothing
            with channel(addr, TARGET_TOKEN) as ch, pytest.raises(grpc.RpcError) as err:
                cache_pb2_grpc.CacheServiceStub(ch).Status(cache_pb2.StatusRequest(), timeout=TIMEOUT)
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE, addr
        server_only = TlsConfig(ca=str(pki.ca))  # trusts the server, shows no client certificate
        with pytest.raises(Unavailable):
            generate_remote(trio.target_addr, "Hi", stop=StopParams(2), tls=server_only, timeout_s=10)
        env = {k: v for k, v in os.environ.items() if not k.startswith("CARD_")}
        tls_env = {"CARD_CLIENT_TLS_CA": str(pki.ca), "CARD_CLIENT_TLS_CERT": str(pki.cert),
                   "CARD_CLIENT_TLS_KEY": str(pki.key)}
        cmd = [console_script("card-client"), "drafts", "--cache", trio.cache_addr]
        refused = subprocess.run(cmd, capture_output=True, text=True, env={**env, **tls_env}, timeout=60)
        assert refused.returncode == 2 and "UNAUTHENTICATED" in refused.stderr
        shown = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                               env={**env, **tls_env, "CARD_CLIENT_TARGET_TOKEN": TARGET_TOKEN})
        assert shown.returncode == 0 and "same" in shown.stdout
