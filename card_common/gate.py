"""What every call of a thread-pool gRPC server passes before a thread is its: the bounds of a port.

grpc's sync server gives each call a pool thread from its arrival, and a unary-request call keeps
that thread until its message has arrived, with no timeout: a caller that sends headers and never
its message holds a thread for as long as its connection lives. ``Gate`` (the interceptor
``make_server`` installs on every server) makes each call of a method that takes one message read
it within a deadline (``first_message_s``), after which the call is cancelled and its thread freed;
counts the calls in flight against the server's budget and answers RESOURCE_EXHAUSTED at once past
it (never a queue behind streams that do not end); runs grpc.health.v1 on a few threads of its own,
with a budget of its own, so that probes neither wait for nor take the service's threads; and keeps
the attributes of a non-blocking handler (grpc_health's ``Watch``) so that a watch stream holds no
thread for its life. A request message that does not parse is answered INVALID_ARGUMENT, with one
log line for the first of each method and every 1000th after (grpc alone logs a traceback per
message and answers INTERNAL: a fuzzer could fill the disk).

``refusal`` is how a call is refused before its message is read (TokenAuth's UNAUTHENTICATED, the
budgets' RESOURCE_EXHAUSTED): a request-streaming handler without a deserializer that aborts at
once, on a small pool of its own, without ever pulling the request iterator. The client sees the
status (unary clients too: grpc sends the trailers and resets the stream), no thread waits for the
message, and no byte of it is parsed.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

log = logging.getLogger(__name__)

HEALTH_SERVICE = "grpc.health.v1.Health"
# grpc.health.v1 on a main port (probes use --health-port; card.common.health): HEALTH_THREADS
# threads of its own, HEALTH_CALLS calls at once on them or waiting for one (more are refused),
# each ended HEALTH_FIRST_MESSAGE_S after its arrival unless its message came (a probe sends its
# few bytes with its headers); a Watch stream, once its message came, holds no thread and counts
# against HEALTH_WATCHERS instead.
HEALTH_THREADS = 4
HEALTH_CALLS = 64
HEALTH_WATCHERS = 256
HEALTH_FIRST_MESSAGE_S = 5.0
# Every refusal runs here: a refusal reads nothing and ends at once, so two threads keep up with
# any rate of them, and no refusal waits behind the service's streams for a thread.
_REFUSALS = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grpc-refuse")


class _Timer:
    """One armed deadline: ``fn`` runs once at the deadline unless disarmed first."""

    __slots__ = ("_fn", "_lock", "_state")

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn: Callable[[], None] | None = fn
        self._lock = threading.Lock()
        self._state = 0  # 0 armed, 1 fired, 2 disarmed

    def fire(self) -> None:
        with self._lock:
            if self._state:
                return
            self._state, fn, self._fn = 1, self._fn, None
        try:
            assert fn is not None
            fn()
        except Exception:  # a deadline's action must not end the thread of every deadline
            log.exception("deadline action failed")

    def disarm(self) -> bool:
        """True when the deadline had not fired (it never will now)."""
        with self._lock:
            if self._state == 0:
                # what the action holds (a call, a socket) is freed now, not when the heap gets to
                # this entry: a gRPC call held past its end keeps its HTTP/2 stream counted
                self._state, self._fn = 2, None
            return self._state == 2


class Deadlines:
    """Many deadlines on one thread (a heap), not a thread per deadline. A disarmed deadline stays
    in the heap until its time (a few dozen bytes), so the heap holds at most the deadlines armed
    within the longest delay."""

    def __init__(self, name: str = "deadlines") -> None:
        self._name = name
        self._heap: list[tuple[float, int, _Timer]] = []
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, delay_s: float, fn: Callable[[], None]) -> _Timer:
        timer = _Timer(fn)
        with self._cv:
            heapq.heappush(self._heap, (time.monotonic() + delay_s, next(self._seq), timer))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify()
        return timer

    def _run(self) -> None:
        while True:
            with self._cv:
                while True:
                    now = time.monotonic()
                    if self._heap and self._heap[0][0] <= now:
                        timer = heapq.heappop(self._heap)[2]
                        break
                    self._cv.wait(self._heap[0][0] - now if self._heap else None)
            timer.fire()


DEADLINES = Deadlines()


def refusal(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler that answers ``code`` without reading the request (see the module's docstring);
    it serves a method of any kind."""

    def deny(requests: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    deny.experimental_thread_pool = _REFUSALS  # type: ignore[attr-defined]
    return grpc.stream_unary_rpc_method_handler(deny)


class _Malformed:
    """What a request that does not parse becomes (instead of grpc's INTERNAL and a traceback)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Budget:
    """Calls in flight of one kind, at most ``limit`` (None: uncounted)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.taken = 0
        self.refused = 0
        self._lock = threading.Lock()

    def take(self) -> Callable[[], None] | None:
        """A release function (idempotent), or None when the budget is spent."""
        if self.limit is None:
            return lambda: None
        with self._lock:
            if self.taken >= self.limit:
                self.refused += 1
                return None
            self.taken += 1
        done = threading.Event()

        def release() -> None:
            with self._lock:
                if not done.is_set():
                    done.set()
                    self.taken -= 1

        return release


def _hold_until_done(context: grpc.ServicerContext, release: Callable[[], None]) -> None:
    """Release when the call ends (grpc runs the callback once it has its status)."""
    if not context.add_callback(release):
        release()


class _FirstMessage:
    """The deadline of a call's one request message, armed at the call's arrival (a call that
    waited for a thread has had its time): past it the call is cancelled, or refused when it
    starts (its thread is freed; the client sees CANCELLED or DEADLINE_EXCEEDED)."""

    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self._lock = threading.Lock()
        self._context: grpc.ServicerContext | None = None
        self._expired = False
        self._timer = DEADLINES.arm(deadline_s, self._expire)

    def _expire(self) -> None:
        with self._lock:
            self._expired = True
            context = self._context
        if context is not None:
            context.cancel()  # wakes the thread that waits for the message

    def read(self, requests: Iterator[Any], context: grpc.ServicerContext, method: str) -> Any:
        """The message, or an abort."""
        with self._lock:
            self._context = context
            expired = self._expired
        try:
            if expired:
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"no request message within {self.deadline_s:g}s")
            request = next(requests, None)
        finally:
            self._timer.disarm()
            with self._lock:
                self._context = None
        if request is None:  # half-closed without a message, or cancelled (then nobody listens)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method} takes exactly one request message "
                          f"(none arrived within {self.deadline_s:g}s)")
        return request


class Gate(grpc.ServerInterceptor):
    """The bounds of one server (see the module's docstring). ``max_calls``: service calls in
    flight (None: uncounted; then they queue for a thread as grpc's would); ``first_message_s``:
    how long a service call may take to deliver its one request message."""

    def __init__(self, max_calls: int | None, first_message_s: float) -> None:
        self.first_message_s = first_message_s
        self.calls = _Budget(max_calls)
        self.health = _Budget(HEALTH_CALLS)
        self.watchers = _Budget(HEALTH_WATCHERS)
        self.health_pool = futures.ThreadPoolExecutor(max_workers=HEALTH_THREADS,
                                                      thread_name_prefix="grpc-health")
        self.malformed: dict[str, int] = {}  # per registered method: bounded by the service's methods
        self._lock = threading.Lock()

    # ---- malformed messages -------------------------------------------------------------------
    def _refuse_malformed(self, method: str, bad: _Malformed, context: grpc.ServicerContext) -> None:
        with self._lock:
            n = self.malformed[method] = self.malformed.get(method, 0) + 1
        if n == 1 or n % 1000 == 0:
            log.warning("malformed %s request(s) refused: %d so far (latest from %s: %s)", method, n,
                        context.peer(), bad.error)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {bad.error}")

    def _checked(self, method: str, request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            self._refuse_malformed(method, request, context)
        return request

    # ---- the interceptor -----------------------------------------------------------------------
    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
                          details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = continuation(details)
        if handler is None:
            return handler
        method = details.method
        is_health = method.startswith(f"/{HEALTH_SERVICE}/")
        budget = self.health if is_health else self.calls
        release = budget.take()
        if release is None:
            what = "health checks" if is_health else "calls"
            return refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"this server has {budget.limit} {what} in flight already (its bound); "
                           "retry later")
        return self._wrap(handler, method, is_health, release)

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str, is_health: bool,
              release: Callable[[], None]) -> grpc.RpcMethodHandler:
        parse = handler.request_deserializer

        def safe(data: bytes) -> Any:
            try:
                return parse(data) if parse is not None else data
            except Exception as exc:  # DecodeError, and anything else a parser can raise
                return _Malformed(exc)

        kw = {"request_deserializer": safe, "response_serializer": handler.response_serializer}
        message = None
        if not handler.request_streaming:
            message = _FirstMessage(HEALTH_FIRST_MESSAGE_S if is_health else self.first_message_s)
        original = (handler.unary_unary or handler.unary_stream or handler.stream_unary
                    or handler.stream_stream)
        pool = self.health_pool if is_health else getattr(original, "experimental_thread_pool", None)

        def first(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            assert message is not None
            return self._checked(method, message.read(requests, context, method), context)

        def each(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            for request in requests:
                yield self._checked(method, request, context)

        behaviour: Callable[..., Any]
        if handler.unary_unary:
            fn_uu = handler.unary_unary

            def unary_unary(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                _hold_until_done(context, release)
                return fn_uu(first(requests, context), context)

            behaviour, make = unary_unary, grpc.stream_unary_rpc_method_handler
        elif handler.unary_stream:
            fn_us = handler.unary_stream
            if getattr(fn_us, "experimental_non_blocking", False):  # grpc_health's Watch
                def watch(requests: Iterator[Any], context: grpc.ServicerContext, send: Any) -> None:
                    try:  # a thread while its message comes, then a watcher slot for its life
                        request = first(requests, context)
                    finally:
                        release()
                    watching = self.watchers.take()
                    if watching is None:
                        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      f"{self.watchers.limit} health watchers already; retry later")
                    else:
                        _hold_until_done(context, watching)
                    fn_us(request, context, send)

                watch.experimental_non_blocking = True  # type: ignore[attr-defined]
                behaviour, make = watch, grpc.stream_stream_rpc_method_handler
            else:
                def unary_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                    _hold_until_done(context, release)
                    request = first(requests, context)
                    yield from fn_us(request, context)

                behaviour, make = unary_stream, grpc.stream_stream_rpc_method_handler
        elif handler.stream_unary:
            fn_su = handler.stream_unary

            def stream_unary(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                _hold_until_done(context, release)
                return fn_su(each(requests, context), context)

            behaviour, make = stream_unary, grpc.stream_unary_rpc_method_handler
        else:
            fn_ss = handler.stream_stream

            def stream_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                _hold_until_done(context, release)
                yield from fn_ss(each(requests, context), context)

            behaviour, make = stream_stream, grpc.stream_stream_rpc_method_handler
        if pool is not None:
            setattr(behaviour, "experimental_thread_pool", pool)  # noqa: B010 (mypy: a function attribute)
        return make(behaviour, **kw)
