"""The OpenAI port against callers that hold connections: a request that never finishes arriving
(half a request line, headers without their end, a body that trickles) is closed at its arrival
deadline, on the first request of a connection and on a kept-alive one; connections past the cap
are closed as they are accepted; honest requests beside them are answered. The listener is
card-target's own (``HttpServer``, uvicorn with ``BoundedH11``), its deadline shortened; each
negative control runs the same caller against uvicorn's plain h11 protocol, where it holds on."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
from fastapi import FastAPI, Request

from card.target_service import http_limits
from card.target_service.openai_api import HttpServer

ARRIVAL_S = 0.5


def app() -> FastAPI:
    api = FastAPI()

    @api.post("/echo")
    async def echo(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    @api.get("/ok")
    async def ok() -> dict:
        return {"ok": True}

    return api


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[HttpServer]:
    monkeypatch.setattr(http_limits.BoundedH11, "arrival_s", ARRIVAL_S)
    monkeypatch.setattr(http_limits.BoundedH11, "max_connections", 4)
    http = HttpServer(app(), "127.0.0.1", 0, grace_s=1.0)
    http.start()
    yield http
    http.stop(5)


@pytest.fixture
def plain_server() -> Iterator[HttpServer]:
    """The same listener with uvicorn's own h11 protocol: the negative control."""
    http = HttpServer(app(), "127.0.0.1", 0, grace_s=1.0)
    http.server.config.http = "h11"
    http.server.config.loaded = False
    http.server.config.load()
    assert http.server.config.http_protocol_class is not http_limits.BoundedH11
    http.start()
    yield http
    http.stop(5)


def connect(http: HttpServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", http.port), timeout=10)


def closed_within(conn: socket.socket, limit_s: float) -> float:
    """Seconds until the server closes ``conn`` (read returns EOF or a reset); fails past limit_s."""
    start = time.monotonic()
    conn.settimeout(limit_s)
    try:
        while conn.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - start


def still_open(conn: socket.socket) -> bool:
    conn.setblocking(False)
    try:
        return conn.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False
    finally:
        conn.setblocking(True)


def read_reply(conn: socket.socket) -> bytes:
    """One HTTP/1.1 reply with a Content-Length, read whole."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += conn.recv(4096)
    return head + b"\r\n\r\n" + body


def get_ok(http: HttpServer) -> bytes:
    with connect(http) as conn:
        conn.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return b"".join(iter(lambda: conn.recv(4096), b""))


SLOW_CALLERS = {
    "half a request line": b"GET /o",
    "headers without their end": b"GET /ok HTTP/1.1\r\nHost: x\r\n",
    "a body that trickles": b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789",
}


@pytest.mark.parametrize("caller", SLOW_CALLERS)
def test_a_request_that_never_arrives_whole_is_closed_at_its_deadline(server, plain_server, caller):
    slow, held = connect(server), connect(plain_server)
    for conn in (slow, held):
        conn.sendall(SLOW_CALLERS[caller])
    took = closed_within(slow, 10)
    assert ARRIVAL_S * 0.9 <= took < ARRIVAL_S + 5
    assert get_ok(server).startswith(b"HTTP/1.1 200")  # honest callers beside it are served
    # negative control: uvicorn's own protocol still holds the same caller after our deadline
    assert still_open(held)
    slow.close()
    held.close()


def test_a_kept_alive_connection_gets_a_new_deadline_for_each_request(server):
    with connect(server) as conn:
        for _ in range(3):  # requests that arrive whole are answered, the three together past one deadline
            time.sleep(ARRIVAL_S * 0.6)
            conn.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
            reply = read_reply(conn)
            assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b'{"bytes":3}')
        conn.sendall(b"GET /ok HTTP/1.1\r\n")  # then one that stops halfway
        assert closed_within(conn, 10) < ARRIVAL_S + 5


def test_a_request_that_arrives_slowly_but_within_its_deadline_is_served(server):
    with connect(server) as conn:
        for part in (b"POST /echo HTTP/1.1\r\nHost: x\r\n", b"Content-Length: 4\r\n\r\n", b"ab", b"cd"):
            conn.sendall(part)
            time.sleep(ARRIVAL_S / 8)
        reply = read_reply(conn)
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b'{"bytes":4}')


def test_connections_past_the_cap_are_closed_as_they_are_accepted(server, monkeypatch):
    monkeypatch.setattr(http_limits.BoundedH11, "arrival_s", 3.0)  # the held four outlive the fifth
    held = [connect(server) for _ in range(4)]
    for conn in held:
        conn.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n")  # half a request each, under the deadline
    extra = connect(server)
    assert closed_within(extra, 2) < 2  # the fifth: closed at once, while the four still hold
    assert all(still_open(conn) for conn in held)
    # once the held ones are ended by their deadline, the port serves again
    for conn in held:
        closed_within(conn, 10)
        conn.close()
    assert get_ok(server).startswith(b"HTTP/1.1 200")
    extra.close()


def test_card_targets_listener_is_bounded():
    """HttpServer builds uvicorn on BoundedH11 (what the tests above shorten), at 20 s and 1,024."""
    http = HttpServer(app(), "127.0.0.1", 0, grace_s=1.0)
    try:
        assert http.server.config.http_protocol_class is http_limits.BoundedH11
        assert http_limits.BoundedH11.arrival_s == http_limits.REQUEST_ARRIVAL_S == 20.0
        assert http_limits.BoundedH11.max_connections == http_limits.MAX_CONNECTIONS
    finally:
        http.sock.close()
