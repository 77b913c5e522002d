"""Which threads run torch in parallel, and how to see them from outside.

On the CPU, torch's intra-op threads are OpenMP's (libgomp in the Linux wheels). libgomp gives every
thread that ever ran a parallel region a pool of worker threads of its own, alive as long as that
thread is, and once the workers of all pools outnumber the cores it throttles their spin-wait
(GOMP_SPINCOUNT's throttled count): every parallel region then wakes its workers through the kernel,
hundreds of times a token, and a forward on 2 threads runs no faster than on 1 (issue 34). A
service's main thread lives as long as the process, so the work it does in parallel (loading a
model, its probes) is done on a passing thread instead, which takes its pool with it when it ends;
the thread that runs the forwards then holds the only pool.

Threads are named at the OS level too (/proc/PID/task/TID/comm, top -H, py-spy): a thread's OpenMP
workers inherit the name of the thread that created them, so a service's engine shows up as its
thread plus its workers under one name.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

_PR_SET_NAME = 15  # linux/prctl.h
_NAME_BYTES = 15  # the kernel keeps 15 bytes and a NUL


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` (its first 15 bytes) at the OS level; Linux only, a no-op
    elsewhere."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:_NAME_BYTES], 0, 0, 0)


def on_passing_thread(fn: Callable[[], T], threads: int, name: str) -> T:
    """``fn()`` on a new thread named ``name`` with ``threads`` torch threads (the count the
    forwards will run on, so that load-time probes check that one), joined before returning its
    result or raising its error: whatever OpenMP pool ``fn`` made ends with the thread."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        name_os_thread(name)
        torch.set_num_threads(threads)
        try:
            result.append(fn())
        except BaseException as exc:  # handed to the caller, on its own thread
            error.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def thread_ladder(most: int) -> tuple[int, ...]:
    """The torch thread counts a forward may run on when ``most`` is the most it may use: 1, the
    powers of two below ``most``, and ``most`` (card.engine.shared.thread_governor climbs and drops
    between them; the invariance probes check each)."""
    counts = {1, max(1, most)}
    rung = 2
    while rung < most:
        counts.add(rung)
        rung *= 2
    return tuple(sorted(counts))


def probe_counts() -> tuple[int, ...]:
    """The thread counts a load-time invariance probe checks: every rung the calling thread's
    forwards may run on (its current count is the most)."""
    return thread_ladder(torch.get_num_threads())
