"""Fixtures for the service tests: real redis-server processes on free ports, fresh key prefixes."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest
import redis

from tests.services.cache_helpers import Cache, make_config, start_cache


def free_port() -> int:
    """A port the OS just handed out on 127.0.0.1 (for programs that need a concrete port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    port: int
    process: subprocess.Popen
    password: str = ""  # its requirepass; in ``url`` when set

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True)

    def stop(self) -> None:
        stop_process(self.process, 10)


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, ``grace_s`` to exit, then SIGKILL: how every test ends a process it started."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def start_redis(port: int | None = None, timeout_s: float = 10.0, password: str = "",
                args: Sequence[str] = ()) -> RedisServer:
    """Start ``redis-server`` without persistence on ``port`` (a free one by default), with
    ``requirepass`` when ``password`` is given (on its stdin, as deploy/k8s passes it, not in its
    arguments) and any more ``args``; wait for PING."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server)")
    port = port or free_port()
    proc = subprocess.Popen(
        [binary, "-", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *args],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )
    assert proc.stdin is not None
    proc.stdin.write(f'requirepass "{password}"\n' if password else "\n")
    proc.stdin.close()
    server = RedisServer(port, proc, password)
    client = server.client()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if client.ping():
                client.close()
                return server
        except redis.ConnectionError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            pytest.fail(f"redis-server on port {port} did not start (exit code {proc.poll()})")
        time.sleep(0.05)


@contextlib.contextmanager
def running_redis(port: int | None = None, password: str = "", args: Sequence[str] = ()
                  ) -> Iterator[RedisServer]:
    server = start_redis(port, 10.0, password, args)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the whole test session; tests keep apart by key prefix."""
    with running_redis() as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def redis_prefix() -> str:
    """A key prefix no other test uses."""
    return f"test-{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def cache(redis_url: str, redis_prefix: str) -> Iterator[Cache]:
    """A cache server in this process on its own key prefix, with hand-driven peers (cache_helpers)."""
    c = start_cache(make_config(redis_url, redis_prefix))
    yield c
    c.close()
