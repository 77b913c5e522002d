"""card-target's engine thread runs its forwards on the configured torch threads, and its OpenMP
workers get the cores (issue 34).

torch's intra-op thread count is per thread: a thread that never sets its own takes the
process-wide value of the moment it first runs an op in parallel. The engine's thread sets its own
count (``--threads``, else what the thread that built the loop runs with) and reads it back in
itself, as ``card_target_engine_threads``; the first tests assert on that reading: in process,
where another thread goes single-threaded between building the loop and its first forward, and
through card-target started as a user starts it.

Those threads are OpenMP's (libgomp): a process whose pools hold more workers than there are
cores has its workers sleep in the kernel between parallel regions instead of spinning, and a
2-thread forward then runs no faster than a 1-thread one. card-target loaded its model on its
main thread, whose pool outlived the load beside the engine's; the last test counts how often the
engine's threads (named target-engine at the OS level, as their workers are) go to sleep while
they decode, a count, not a timing: hundreds of times a token when throttled, next to never when
not.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from card.client.trio import LISTENING, console_script
from card.common.channels import wait_serving
from card.engine.shared.config import GenerationRequest, StopParams
from card.engine.shared.kv_pool import KVPool
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine
from card.target_service.engine_loop import EngineLoop
from card.v1 import target_pb2, target_pb2_grpc
from tests.services.conftest import free_port, stop_process
from tests.services.e2e_support import metric, scrape, torch_threads
from tests.tiny_models import default_gguf, save_tiny_checkpoint, tiny_model

THREADS = 2  # more than one, on any machine: torch runs as many as it is told, cores or not
LOGGED = re.compile(r"the engine's thread runs its forwards on (at most )?(\d+) torch thread")


# ---- in process -------------------------------------------------------------------------------
def _generate(loop: EngineLoop) -> None:
    request = GenerationRequest((1, 2, 3), stop=StopParams(4, ignore_eos=True))
    gen = Generation(request, NoDraft(), eos_ids=frozenset(), decode=lambda ids: "", context_window=256,
                     mode="vanilla")
    box: queue.Queue = queue.Queue()
    loop.submit(gen, box.put)
    while not (event := box.get(timeout=60)).done:
        pass
    assert event.error is None, event.error


@pytest.mark.parametrize("configured", [None, THREADS], ids=["default", "configured"])
def test_the_engine_thread_forwards_on_its_count_whatever_other_threads_set(configured: int | None) -> None:
    """Built while this thread runs THREADS (the default's source) and started after it went down
    to one, as any other thread of card-target may: the forwards still run on THREADS."""
    model = tiny_model()
    engine = TargetEngine(model, KVPool(model, slots=1, max_len=256))
    with torch_threads(THREADS):
        loop = EngineLoop(engine, threads=configured)
    with torch_threads(1):  # the process-wide value when the engine's thread runs its first forward
        loop.start()
        try:
            _generate(loop)
        finally:
            loop.stop()
    assert loop.forward_threads == THREADS


# ---- card-target, as a user starts it ---------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("threads-model") / "target", seed=0))


def torch_default_threads() -> int:
    """What torch runs a fresh process's main thread on here (the machine's cores, unless the
    environment says otherwise): card-target's default."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                         capture_output=True, text=True, check=True, env=_environ())
    return int(out.stdout)


def _environ() -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CARD_")}
    environ.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    return environ


@contextlib.contextmanager
def _started(logs: Path, checkpoint: str, *args: str) -> Iterator[tuple[str, int, Path, int]]:
    """card-target on ``checkpoint`` with ``args``: (its gRPC address, its metrics port, its log,
    its pid)."""
    logs.mkdir(parents=True, exist_ok=True)
    out, err = logs / "stdout.log", logs / "stderr.log"
    metrics_port = free_port()
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen([console_script("card-target"), "--model", checkpoint, "--port", "0",
                                 "--no-http", "--metrics-port", str(metrics_port), *args],
                                stdout=o, stderr=e, stdin=subprocess.DEVNULL, env=_environ(),
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while (match := LISTENING.search(out.read_text(errors="replace"))) is None:
            if proc.poll() is not None:
                raise AssertionError(f"card-target exited ({proc.returncode}):\n{err.read_text()[-3000:]}")
            assert time.monotonic() < deadline, "card-target did not listen within 120 s"
            time.sleep(0.05)
        addr = f"127.0.0.1:{match.group(3)}"
        wait_serving(addr, timeout_s=120)
        yield addr, metrics_port, err, proc.pid
    finally:
        stop_process(proc, 30)


def _decode(addr: str, tokens: int) -> None:
    """Plain decoding of ``tokens`` tokens through card-target's gRPC front."""
    request = target_pb2.GenerateRequest(prompt="Explain speculative decoding.", max_new_tokens=tokens,
                                         mode="vanilla", ignore_eos=True)
    with grpc.insecure_channel(addr) as ch:
        replies = list(target_pb2_grpc.TargetServiceStub(ch).Generate(request, timeout=120))
    assert replies[-1].WhichOneof("kind") == "final"
    assert replies[-1].final.stats.new_tokens == tokens


@pytest.mark.slow
@pytest.mark.parametrize("args", [["--threads", str(THREADS)], []], ids=["--threads", "default"])
def test_card_target_reports_the_threads_its_engine_thread_forwards_on(args: list[str], checkpoint: str,
                                                                       tmp_path: Path) -> None:
    """A fixed count (--no-adaptive-threads): the forwards run on exactly it."""
    expected = THREADS if args else torch_default_threads()
    with _started(tmp_path, checkpoint, *args, "--no-adaptive-threads") as (addr, metrics_port, log, _):
        _decode(addr, 3)  # a forward ran on the engine's thread
        assert metric(scrape(metrics_port), "card_target_engine_threads") == expected
        logged = LOGGED.search(log.read_text(errors="replace"))
        assert logged and not logged.group(1) and int(logged.group(2)) == expected


@pytest.mark.slow
def test_with_adaptive_threads_the_count_is_a_rung_of_the_most(checkpoint: str, tmp_path: Path) -> None:
    """Adaptive threads (the default): the log says the most, and the forwards run on a count
    between one and it (the governor's: tests/engine/test_thread_governor.py)."""
    with _started(tmp_path, checkpoint, "--threads", str(THREADS)) as (addr, metrics_port, log, _):
        _decode(addr, 3)
        assert 1 <= metric(scrape(metrics_port), "card_target_engine_threads") <= THREADS
        logged = LOGGED.search(log.read_text(errors="replace"))
        assert logged and logged.group(1) and int(logged.group(2)) == THREADS


def _named(pid: int, name: str) -> list[str]:
    """The ids of ``pid``'s threads whose OS name is ``name``."""
    tasks = Path(f"/proc/{pid}/task")
    return [t.name for t in tasks.iterdir() if (t / "comm").read_text().strip() == name]


def _sleeps(pid: int, tids: list[str]) -> int:
    """Voluntary context switches of those threads so far: each time one waited in the kernel."""
    total = 0
    for tid in tids:
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        total += int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.MULTILINE).group(1))
    return total


# per engine thread and token; measured on 2 cores: 0.15 (0.9 beside a busy core), and ~300 with
# the loading thread's OpenMP pool left behind
SLEEPS_PER_TOKEN = 4


@pytest.mark.slow
def test_the_engine_threads_openmp_workers_spin_between_parallel_regions(tmp_path: Path) -> None:
    """card-target on every core (its default) serving the default model, whose load runs torch
    in parallel: the engine's thread and its OpenMP workers, and no more, decode without going to
    sleep between the forward's parallel regions."""
    threads = torch_default_threads()
    if threads < 2:
        pytest.skip("one core: no OpenMP workers to keep")
    tokens = 64
    # a fixed count: the governor would let workers sleep on purpose while a neighbour holds a core
    with _started(tmp_path, str(default_gguf()), "--no-adaptive-threads") as (addr, _, _, pid):
        _decode(addr, 4)  # the engine thread's OpenMP pool forms
        engine = _named(pid, "target-engine")
        assert len(engine) == threads  # the engine's thread and its threads - 1 workers
        before = _sleeps(pid, engine)
        _decode(addr, tokens)
        slept = _sleeps(pid, engine) - before
    assert slept < SLEEPS_PER_TOKEN * tokens * threads, f"{slept} sleeps in {tokens} tokens"
