"""card.client.bench.overhead's own parts that need no model: CPU time by thread group (the
engine's thread apart from the serving threads), and another source tree's ``card`` package for a
service started beside this one's."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from card.client.bench.overhead import package_of, thread_cpu
from card.engine.shared.torch_threads import name_os_thread

ROOT = Path(__file__).resolve().parents[1]


def _busy_thread(name: str | None, seconds: float, burned: threading.Event, release: threading.Event) -> None:
    if name:
        name_os_thread(name)
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        pass
    burned.set()
    release.wait(30)  # alive while measured: an ended thread leaves /proc/PID/task


def _measure(name: str | None) -> dict[str, float]:
    burned, release = threading.Event(), threading.Event()
    before = thread_cpu(os.getpid())
    thread = threading.Thread(target=_busy_thread, args=(name, 0.3, burned, release))
    thread.start()
    try:
        assert burned.wait(30)
        after = thread_cpu(os.getpid())
    finally:
        release.set()
        thread.join()
    return {k: after[k] - before[k] for k in after}


def test_the_engine_threads_cpu_is_counted_apart():
    engine = _measure("target-engine")
    assert engine["engine"] >= 0.2 and engine["process"] >= 0.2
    other = _measure(None)  # the control: any other thread is serving
    assert other["engine"] < 0.05 and other["serving"] >= 0.2


def test_another_tree_runs_its_own_code(tmp_path):
    probe = ("import card.target_service.engine_loop as m, card.v1.target_pb2 as t; "
             "print(m.__file__, t.__file__)")
    folder = package_of(ROOT, tmp_path / "pkg")
    env = {**os.environ, "PYTHONPATH": str(folder)}
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True,
                         check=True).stdout.split()
    assert all(p.startswith(str(folder)) for p in out)
    plain = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                           check=True).stdout.split()
    assert not any(p.startswith(str(folder)) for p in plain)  # the control: the installed tree's
