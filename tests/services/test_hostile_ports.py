"""Hostile callers against every port (issue 35): silent callers, watchers, oversized unauthenticated
messages, slow metrics scrapers, and a target's token on the operator's RPCs.

A real trio (card-cache with Redis, a model-free card-draft, card-target on a tiny checkpoint) is
started from the entry points on loopback with every token set, health ports and metrics ports, as
a user starts it. A *silent* caller opens a gRPC stream, sends its headers and never its message
(a request iterator blocked on an event): the server side of a unary method waits for the message.
Each bound has a negative control where one means something: the same callers against a server
built the way these ports were before (a thread pool of grpc's own).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from click.testing import CliRunner
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from card.cache_service.config import CacheConfig
from card.cache_service.server import CacheServer
from card.cache_service.store import open_store
from card.client.cli import cli
from card.client.trio import LocalTrio
from card.common.auth import PresentToken
from card.common.health import Health, HealthPort
from card.common.metrics_port import MetricsServer
from card.common.serving import add_health, bind, make_server, set_serving
from card.v1 import cache_pb2, cache_pb2_grpc, target_pb2, target_pb2_grpc
from tests.services.conftest import free_port, stop_process
from tests.services.e2e_support import wait_until
from tests.tiny_models import save_tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

KEY = "sk-" + uuid.uuid4().hex
DRAFT_TOKEN, TARGET_TOKEN, OPERATOR_TOKEN = ("draft-" + uuid.uuid4().hex, "target-" + uuid.uuid4().hex,
                                             "operator-" + uuid.uuid4().hex)
CHECK = "/grpc.health.v1.Health/Check"
GENERATE = "/card.v1.TargetService/Generate"
MIB = 2**20


# ---- callers ------------------------------------------------------------------------------------
def own_channel(addr: str, token: str | None = None) -> grpc.Channel:
    """A channel on a connection of its own (grpc shares one between equal channels otherwise)."""
    ch = grpc.insecure_channel(addr, options=[("grpc.use_local_subchannel_pool", 1),
                                              ("grpc.max_send_message_length", 64 * MIB)])
    grpc.channel_ready_future(ch).result(timeout=30)
    return grpc.intercept_channel(ch, PresentToken(token)) if token else ch


class Silent:
    """``n`` calls of ``method`` on one connection that send their headers and never a message."""

    def __init__(self, addr: str, method: str, n: int, token: str | None = None) -> None:
        self.release = threading.Event()
        self.channel = own_channel(addr, token)

        def never() -> Iterator[bytes]:
            self.release.wait()
            return
            yield b""

        self.calls = [self.channel.stream_unary(method).future(never(), timeout=120) for _ in range(n)]

    def seen(self) -> None:
        """Returns once the server has taken every call's headers: a Check on the same connection,
        sent after them, is answered (HTTP/2 frames of a connection are read in order)."""
        health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)

    def pending(self) -> int:
        return sum(not c.done() for c in self.calls)

    def codes(self, timeout_s: float) -> list[grpc.StatusCode]:
        out = []
        for c in self.calls:
            try:
                c.result(timeout=timeout_s)
                out.append(grpc.StatusCode.OK)
            except grpc.RpcError as err:
                out.append(err.code())
        return out

    def close(self) -> None:
        self.release.set()
        for c in self.calls:
            c.cancel()
        self.channel.close()


def check_s(addr: str, timeout_s: float = 2.0) -> float:
    """Seconds a normal health check of ``addr`` takes on a fresh connection (it must be SERVING);
    raises grpc.RpcError past ``timeout_s``."""
    ch = own_channel(addr)
    try:
        start = time.monotonic()
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        took = time.monotonic() - start
    finally:
        ch.close()
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    return took


def code(call: Callable[[], Any]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def generate(addr: str, key: str | None = KEY) -> list[target_pb2.GenerateResponse]:
    request = target_pb2.GenerateRequest(prompt="Hello", max_new_tokens=3, mode="vanilla", ignore_eos=True)
    ch = own_channel(addr, key)
    try:
        return list(target_pb2_grpc.TargetServiceStub(ch).Generate(request, timeout=60))
    finally:
        ch.close()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        match = re.search(r"VmRSS:\s+(\d+)", f.read())
    assert match
    return int(match.group(1)) / 1024


class PeakRss:
    """The highest RSS of ``pid`` while the block runs, sampled every 10 ms."""

    def __init__(self, pid: int) -> None:
        self.pid, self.base, self.peak = pid, rss_mib(pid), 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, rss_mib(self.pid))

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mib(self.pid))

    @property
    def growth(self) -> float:
        return self.peak - self.base


# ---- the trio -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def health_ports() -> dict[str, int]:
    """Each service's --health-port."""
    return {name: free_port() for name in ("target", "cache", "draft")}


@pytest.fixture(scope="module")
def trio(redis_server, health_ports: dict[str, int], tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[LocalTrio]:
    tmp = tmp_path_factory.mktemp("hostile-ports")
    model = str(save_tiny_checkpoint(tmp / "target", seed=0))
    extra = {name: ["--health-port", str(port)] for name, port in health_ports.items()}
    extra["cache"] += ["--redis-prefix", f"ports-{uuid.uuid4().hex[:8]}:"]
    extra["target"] += ["--api-key", KEY]
    trio = LocalTrio(target_model=model, draft_model="ngram", draft_name="ngram", target_threads=1,
                     draft_threads=1, dtype="float32", log_dir=tmp / "logs", redis_url=redis_server.url,
                     metrics=True, draft_token=DRAFT_TOKEN, target_token=TARGET_TOKEN,
                     operator_token=OPERATOR_TOKEN, start_timeout_s=180, extra_args=extra)
    with trio:
        yield trio


def pid_of(trio: LocalTrio, name: str) -> int:
    (proc,) = [p for p in trio.processes if p.name.startswith(name)]
    return proc.proc.pid


# ---- health ports: silent callers ----------------------------------------------------------------
def test_sixteen_silent_callers_on_each_health_port_leave_probes_answered(
        trio: LocalTrio, health_ports: dict[str, int]) -> None:
    """16 silent Checks on each health port (every --health-port, and the draft's gRPC port, which
    serves health alone): a normal check answers within 2 s while they are held, and each silent
    call is ended by its first-message deadline (5 s), not held for the connection's life."""
    ports = {name: f"127.0.0.1:{port}" for name, port in health_ports.items()}
    ports["draft grpc"] = trio.draft_addr
    silent = {name: Silent(addr, CHECK, 16) for name, addr in ports.items()}
    try:
        for s in silent.values():
            s.seen()
        took = {name: check_s(addr) for name, addr in ports.items()}
        held = {name: s.pending() for name, s in silent.items()}
        print(f"health check with 16 silent callers: {took} s; silent calls still held: {held}")
        assert all(t < 2.0 for t in took.values()), took
        assert all(n == 16 for n in held.values()), held  # they were there while the checks answered
        for name, s in silent.items():
            assert set(s.codes(timeout_s=15)) == {grpc.StatusCode.DEADLINE_EXCEEDED}, name
    finally:
        for s in silent.values():
            s.close()


def test_negative_control_four_silent_callers_freeze_a_thread_pool_health_server() -> None:
    """What the health ports were: grpc_health's servicer on a 4-thread sync server. Four silent
    Checks take every thread; a normal check waits past its deadline."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    silent = Silent(addr, CHECK, 4)
    try:
        wait_until(lambda: code(lambda: check_s(addr, 1.0)) is grpc.StatusCode.DEADLINE_EXCEEDED,
                   timeout_s=10, what="the four silent calls to hold every thread")
        assert silent.pending() == 4
    finally:
        silent.close()
        server.stop(0).wait()


# ---- main ports: watchers -------------------------------------------------------------------------
def test_sixteen_watch_streams_on_each_main_port_hold_no_thread(trio: LocalTrio) -> None:
    ports = {"target": trio.target_addr, "cache": trio.cache_addr}
    channels, watches = [], []
    try:
        for addr in ports.values():
            ch = own_channel(addr)
            channels.append(ch)
            stub = health_pb2_grpc.HealthStub(ch)
            streams = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=120) for _ in range(16)]
            # each stream is open on the server: its first status has come
            assert {next(s).status for s in streams} == {health_pb2.HealthCheckResponse.SERVING}
            watches += streams
        took = {name: check_s(addr) for name, addr in ports.items()}
        print(f"health check with 16 Watch streams on the main port: {took} s")
        assert all(t < 2.0 for t in took.values()), took
    finally:
        for w in watches:
            w.cancel()
        for ch in channels:
            ch.close()


class _Rewrap(grpc.ServerInterceptor):
    """The former RejectMalformed's effect on Watch: a generator wrapper without grpc_health's
    ``experimental_non_blocking``."""

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = continuation(details)
        if handler is None or not handler.unary_stream:
            return handler
        fn = handler.unary_stream

        def wrapped(request: Any, context: Any) -> Any:
            yield from fn(request, context)

        return grpc.unary_stream_rpc_method_handler(
            wrapped, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


def test_negative_control_rewrapped_watch_streams_take_every_thread() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[_Rewrap()])
    servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    ch = own_channel(addr)
    streams = [health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=60)
               for _ in range(4)]
    try:
        assert all(next(s).status == health_pb2.HealthCheckResponse.SERVING for s in streams)
        assert code(lambda: check_s(addr, 1.0)) is grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        for s in streams:
            s.cancel()
        ch.close()
        server.stop(0).wait()


# ---- the target: refused before reading ------------------------------------------------------------
def test_sixty_four_silent_unauthenticated_generates_are_refused_at_once(trio: LocalTrio) -> None:
    silent = Silent(trio.target_addr, GENERATE, 64)
    try:
        # every one refused while its message has still not been sent: nothing waited for it
        assert silent.codes(timeout_s=10) == [grpc.StatusCode.UNAUTHENTICATED] * 64
        assert not silent.release.is_set()
        start = time.monotonic()
        replies = generate(trio.target_addr)
        print(f"keyed Generate beside 64 silent unauthenticated ones: {time.monotonic() - start:.2f} s")
        assert replies[-1].final.finish_reason == "length"
    finally:
        silent.close()


class _OldRefusal(grpc.ServerInterceptor):
    """The former TokenAuth refusal: a unary handler with the real deserializer (grpc reads and
    parses the message first, on a pool thread)."""

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = continuation(details)
        if handler is None or details.method != GENERATE:
            return handler
        if ("authorization", f"Bearer {KEY}") in tuple(details.invocation_metadata or ()):
            return handler

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "no key")
            yield  # a generator, as a streaming handler must be

        return grpc.unary_stream_rpc_method_handler(deny, request_deserializer=handler.request_deserializer)


class _Echo(target_pb2_grpc.TargetServiceServicer):
    def Generate(self, request: Any, context: Any) -> Iterator[target_pb2.GenerateResponse]:
        yield target_pb2.GenerateResponse(final=target_pb2.Final(finish_reason="length"))


def test_negative_control_silent_unauthenticated_calls_hold_a_refusal_that_reads_first() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), interceptors=[_OldRefusal()])
    target_pb2_grpc.add_TargetServiceServicer_to_server(_Echo(), server)
    addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    silent = Silent(addr, GENERATE, 8)
    try:
        wait_until(lambda: silent.pending() == 8, timeout_s=5, what="the silent calls")
        ch = own_channel(addr, KEY)
        request = target_pb2.GenerateRequest(prompt="Hello")
        stub = target_pb2_grpc.TargetServiceStub(ch)
        assert code(lambda: list(stub.Generate(request, timeout=1.0))) is grpc.StatusCode.DEADLINE_EXCEEDED
        assert silent.pending() == 8  # none refused: each waits for the message it would parse
        ch.close()
    finally:
        silent.close()
        server.stop(0).wait()


def flood(addr: str, n: int, mib: int) -> list[grpc.StatusCode]:
    """``n`` unauthenticated Generate calls at once, each a ``mib`` MiB message."""
    payload = target_pb2.GenerateRequest(prompt="x" * (mib * MIB)).SerializeToString()
    ch = own_channel(addr)
    try:
        calls = [ch.unary_stream(GENERATE)(payload, timeout=60) for _ in range(n)]
        out = []
        for call in calls:
            out.append(code(lambda c=call: list(c)))  # type: ignore[misc]
        return out
    finally:
        ch.close()


def test_twenty_four_unauthenticated_20_mb_messages_cost_the_target_no_memory(trio: LocalTrio) -> None:
    pid = pid_of(trio, "card-target")
    with PeakRss(pid) as rss:
        codes = flood(trio.target_addr, 24, 20)
    print(f"target RSS {rss.base:.0f} MiB, peak {rss.peak:.0f} MiB during 24 unauthenticated 20 MiB "
          f"messages (+{rss.growth:.1f} MiB)")
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 24
    assert rss.growth < 40  # HTTP/2's 64 KiB windows: ~2 MiB for the 24 (card.common.serving)
    assert generate(trio.target_addr)[-1].final.finish_reason == "length"  # and it still serves
    # a key holder's message past the target's bound (--max-body-mb, 4 MiB) is refused too
    payload = target_pb2.GenerateRequest(prompt="x" * (5 * MIB))
    ch = own_channel(trio.target_addr, KEY)
    try:
        stub = target_pb2_grpc.TargetServiceStub(ch)
        assert code(lambda: list(stub.Generate(payload, timeout=30))) is grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        ch.close()


# The former refusal of an unauthenticated Generate, alone in a process: a unary handler with the
# real deserializer, on grpc's thread pool, 64 MiB messages (the former bound).
_OLD_SERVER = """
import time, grpc
from concurrent import futures
from card.v1 import target_pb2

def deny(request, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "no key")
    yield

server = grpc.server(futures.ThreadPoolExecutor(max_workers=16),
                     options=[("grpc.max_receive_message_length", 64 * 2**20)])
server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("card.v1.TargetService", {
    "Generate": grpc.unary_stream_rpc_method_handler(
        deny, request_deserializer=target_pb2.GenerateRequest.FromString)}),))
print(server.add_insecure_port("127.0.0.1:0"), flush=True)
server.start()
time.sleep(600)
"""


def test_negative_control_a_refusal_that_reads_first_takes_the_messages_memory() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _OLD_SERVER], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        addr = f"127.0.0.1:{int(proc.stdout.readline())}"
        with PeakRss(proc.pid) as rss:
            codes = flood(addr, 24, 20)
        print(f"former refusal: RSS +{rss.growth:.0f} MiB for the same flood")
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 24
        assert rss.growth > 100
    finally:
        stop_process(proc, 5)


# ---- main ports: budgets and the first-message deadline (in-process) ---------------------------------
def _held_server(threads: int, first_message_s: float, bounded: bool = True) -> tuple[grpc.Server, str]:
    def echo(request: bytes, context: Any) -> bytes:
        return request

    server = (make_server(threads, maximum_concurrent_rpcs=threads, first_message_s=first_message_s)
              if bounded else grpc.server(futures.ThreadPoolExecutor(max_workers=threads)))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.T", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),))
    set_serving(add_health(server), True)
    return server, f"127.0.0.1:{bind(server, '127.0.0.1:0')}"


def test_past_its_budget_a_call_is_refused_at_once_and_a_silent_call_dies() -> None:
    server, addr = _held_server(4, first_message_s=1.0)
    server.start()
    silent = Silent(addr, "/t.T/Echo", 4)
    ch = own_channel(addr)
    try:
        silent.seen()
        start = time.monotonic()
        echo = ch.unary_unary("/t.T/Echo")
        assert code(lambda: echo(b"x", timeout=5)) is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() - start < 1.0 and silent.pending() == 4
        assert set(silent.codes(timeout_s=10)) == {grpc.StatusCode.CANCELLED}  # the deadline ended them
        assert ch.unary_unary("/t.T/Echo")(b"x", timeout=5) == b"x"  # their threads are back
    finally:
        silent.close()
        ch.close()
        server.stop(0).wait()


def test_a_finished_call_frees_its_stream_at_once() -> None:
    """A gated call that has ended holds nothing (its message's deadline keeps no reference to
    it): 300 calls one after another beside 100 open streams, on one connection that takes 256
    at once, all pass. Held until their deadline, the ended calls would stay counted against the
    connection's 256 streams, and grpc would refuse the later ones (REFUSED_STREAM)."""
    release = threading.Event()

    def stream(request: bytes, context: Any) -> Iterator[bytes]:
        yield b"open"
        release.wait(60)

    server, addr = _held_server(400, first_message_s=20.0)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.S", {"Open": grpc.unary_stream_rpc_method_handler(stream)}),))
    server.start()
    ch = own_channel(addr)
    try:
        streams = [ch.unary_stream("/t.S/Open")(b"x", timeout=60) for _ in range(100)]
        assert {next(s) for s in streams} == {b"open"}
        echo = ch.unary_unary("/t.T/Echo")
        assert [code(lambda: echo(b"x", timeout=10)) for _ in range(300)] == [grpc.StatusCode.OK] * 300
    finally:
        release.set()
        ch.close()
        server.stop(0).wait()


def test_negative_control_without_the_gate_a_call_queues_behind_silent_ones() -> None:
    server, addr = _held_server(4, first_message_s=1.0, bounded=False)
    server.start()
    silent = Silent(addr, "/t.T/Echo", 4)
    ch = own_channel(addr)
    try:
        wait_until(lambda: silent.pending() == 4, timeout_s=5, what="the silent calls")
        assert code(lambda: ch.unary_unary("/t.T/Echo")(b"x", timeout=2)) is grpc.StatusCode.DEADLINE_EXCEEDED
        assert silent.pending() == 4
    finally:
        silent.close()
        ch.close()
        server.stop(0).wait()


def test_graceful_shutdown_reaches_the_health_port_and_stays() -> None:
    server = make_server(4)
    owner = add_health(server)
    addr = f"127.0.0.1:{bind(server, '127.0.0.1:0')}"
    server.start()
    port = HealthPort(owner, "127.0.0.1", 0)
    ch = own_channel(f"127.0.0.1:{port.port}")
    try:
        set_serving(owner, True, ["card.v1.X"])
        stub = health_pb2_grpc.HealthStub(ch)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service="card.v1.X"), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        owner.enter_graceful_shutdown()
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        set_serving(owner, True, ["card.v1.X"])  # ignored from now on, on every port
        for target in (ch, own_channel(addr)):
            for service in ("", "card.v1.X"):
                reply = health_pb2_grpc.HealthStub(target).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert code(lambda: stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)) \
            is grpc.StatusCode.NOT_FOUND
        watch.cancel()
    finally:
        ch.close()
        port.stop()
        server.stop(0).wait()
        assert isinstance(owner, Health)


# ---- roles --------------------------------------------------------------------------------------------
def test_the_targets_token_cannot_drain_and_the_operators_can(trio: LocalTrio) -> None:
    calls = {
        "Drain": lambda s: s.Drain(cache_pb2.DrainRequest(pool="ngram", resume=True), timeout=10),
        "SetPoolWeights": lambda s: s.SetPoolWeights(cache_pb2.PoolWeightsRequest(), timeout=10),
        "Status": lambda s: s.Status(cache_pb2.StatusRequest(), timeout=10),
    }
    want = {TARGET_TOKEN: {"Drain": grpc.StatusCode.UNAUTHENTICATED,
                           "SetPoolWeights": grpc.StatusCode.UNAUTHENTICATED, "Status": grpc.StatusCode.OK},
            OPERATOR_TOKEN: dict.fromkeys(calls, grpc.StatusCode.OK),
            DRAFT_TOKEN: dict.fromkeys(calls, grpc.StatusCode.UNAUTHENTICATED)}
    for token, codes in want.items():
        ch = own_channel(trio.cache_addr, token)
        stub = cache_pb2_grpc.CacheServiceStub(ch)
        assert {name: code(lambda c=c, s=stub: c(s)) for name, c in calls.items()} == codes, token[:5]  # type: ignore[misc]
        ch.close()
    # the operator's CLI, with each token in its variable (card-client's own command, in this
    # process: no start-up cost)
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("CARD_")}
    args = ["drafts", "weights", "", "--cache", trio.cache_addr]
    refused = CliRunner().invoke(cli, args, env={**env, "CARD_CLIENT_TARGET_TOKEN": TARGET_TOKEN})
    assert refused.exit_code == 2 and "UNAUTHENTICATED" in refused.stderr and "operator" in refused.stderr
    done = CliRunner().invoke(cli, args, env={**env, "CARD_CLIENT_OPERATOR_TOKEN": OPERATOR_TOKEN})
    assert done.exit_code == 0, done.output
    for proc in trio.processes:  # every port of this trio has its token: no warning said otherwise
        assert "serves without" not in proc.log_path.read_text(errors="replace"), proc.name
        assert "without --api-key" not in proc.log_path.read_text(errors="replace"), proc.name


def test_an_open_cache_warns_once_for_each_role_it_serves_without_a_token(caplog: pytest.LogCaptureFixture
                                                                          ) -> None:
    for tokens, warned in (({}, {"--target-token", "--draft-token", "--operator-token"}),
                           ({"target_token": "t"}, {"--draft-token"}),
                           ({"target_token": "t", "draft_token": "d", "operator_token": "o"}, set())):
        config = CacheConfig(port=0, redis_url="memory://", metrics_port=0, **tokens)
        server = CacheServer(config, open_store("memory://", "x:", False))
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            server.warn_if_open(1234)
        lines = [r.getMessage() for r in caplog.records if "serves without" in r.getMessage()]
        assert {re.search(r"without (\S+):", line).group(1) for line in lines} == warned  # type: ignore[union-attr]
        server.store.close()


# ---- metrics ports ------------------------------------------------------------------------------------
def test_silent_and_slow_connections_leave_a_scrape_answered(trio: LocalTrio) -> None:
    """16 silent connections and 4 that trickle a byte at a time on the cache's metrics port: a
    scrape answers within 2 s (the server ends each after 10 s: the test below, in-process)."""
    port = trio.metrics_ports["card-cache"]
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(20)]
    stop = threading.Event()

    def trickle(sock: socket.socket) -> None:
        for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\n":
            if stop.wait(0.5):
                return
            try:
                sock.send(bytes([byte]))
            except OSError:
                return

    trickling = [threading.Thread(target=trickle, args=(s,), daemon=True) for s in held[16:]]
    for t in trickling:
        t.start()
    try:
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=2) as scrape:
            scrape.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            body = b"".join(iter(lambda: scrape.recv(65536), b""))
        took = time.monotonic() - start
        print(f"scrape beside 20 silent or slow connections: {took:.3f} s")
        assert body.startswith(b"HTTP/1.0 200") and b"card_cache" in body and took < 2.0
    finally:
        stop.set()
        for sock in held:
            sock.close()


def test_metrics_connections_past_the_cap_are_closed_and_held_ones_end() -> None:
    server = MetricsServer(("127.0.0.1", 0), lambda env, start: [], max_connections=4, connection_s=1.0)
    server.start()
    try:
        held = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(4)]
        # accepted in order: the fifth finds the four slots taken
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as extra:
            assert extra.recv(1) == b""  # closed at once, unanswered
        assert server.refused == 1
        for sock in held:
            assert sock.recv(1) == b""  # shut by the per-connection deadline
            sock.close()
        # its pool's threads, never one per connection
        assert sum(t.name.startswith("metrics_") for t in threading.enumerate()) <= 4
    finally:
        server.close()


def test_negative_control_prometheus_start_http_server_makes_a_thread_per_silent_connection() -> None:
    from prometheus_client import start_http_server

    port = free_port()
    httpd, _ = start_http_server(port, addr="127.0.0.1")

    def handlers() -> int:  # socketserver's thread per connection
        return sum("process_request_thread" in t.name for t in threading.enumerate())

    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(16)]
    try:
        wait_until(lambda: handlers() == 16, timeout_s=10, what="a thread for each silent connection")
    finally:
        for sock in held:
            sock.close()
        httpd.shutdown()
        httpd.server_close()
