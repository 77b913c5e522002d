"""How trios start their children: they die with the process that started them, and starting them
from a process that has used gRPC never runs gRPC's fork handlers in the child (grpcio >= 1.81
aborts there before exec, grpc/grpc#43055: a service that "exits with -6 while starting")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from card.client.trio import die_with_parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

# A process that has served and called gRPC, then starts children the given way.
SPAWNER = textwrap.dedent("""
    import subprocess, sys
    from concurrent import futures
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from card.client.trio import die_with_parent

    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    failed = 0
    for _ in range(int(sys.argv[2])):
        stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        if sys.argv[1] == "preexec_fn":
            child = subprocess.Popen(["true"], preexec_fn=lambda: None, start_new_session=True)
        else:
            child = subprocess.Popen(die_with_parent(["true"]), start_new_session=True)
        failed += child.wait() != 0
    print("failed", failed, flush=True)
""")


def _spawn_many(how: str, n: int = 20) -> subprocess.CompletedProcess:
    env = {**os.environ, "GRPC_VERBOSITY": "INFO"}
    return subprocess.run([sys.executable, "-c", SPAWNER, how, str(n)], capture_output=True, text=True,
                          env=env, timeout=120)


def test_children_start_without_grpc_fork_handlers():
    """gRPC logs from fork_posix.cc whenever its atfork handlers run. The guarded start never
    forks through them; the negative control (preexec_fn, what trio.py used before) does."""
    guarded = _spawn_many("guarded")
    assert guarded.returncode == 0, guarded.stderr
    assert "failed 0" in guarded.stdout
    assert "fork_posix" not in guarded.stderr, guarded.stderr[-2000:]
    control = _spawn_many("preexec_fn")
    assert control.returncode == 0, control.stderr
    assert "fork_posix" in control.stderr, "negative control: preexec_fn should fork through gRPC"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("guarded", [True, False])
def test_a_child_dies_with_its_parent_even_on_sigkill(guarded):
    """The parent is SIGKILLed: the guarded child gets SIGTERM; an unguarded one (the negative
    control) lives on as an orphan."""
    wrap = "die_with_parent" if guarded else "list"
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time\n"
         "from card.client.trio import die_with_parent\n"
         f"child = subprocess.Popen({wrap}(['sleep', '60']), start_new_session=True)\n"
         "print(child.pid, flush=True)\ntime.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until the guard has exec'ed sleep
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if f.read().startswith(b"sleep"):
                    break
            time.sleep(0.05)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _alive(child) is not guarded
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_the_guard_is_a_no_op_off_linux(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert die_with_parent(["redis-server"]) == ["redis-server"]
