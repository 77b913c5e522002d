"""card-draft's --nice counts against the other services (card.common.niceness): a process that
leads its session lowers its autogroup's weight too, one that does not leaves its shell's group
alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="no autogroups here")

CHILD = ("import os, sys; from card.common.niceness import lower_priority; "
         "print(lower_priority(7)); print(open('/proc/self/autogroup').read().strip()); sys.stdout.flush()")


def nice_of_group(line: str) -> int:
    return int(line.rsplit("nice", 1)[1])  # "/autogroup-85 nice 7"


def test_a_session_leader_lowers_its_group() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True,
                         start_new_session=True).stdout.splitlines()
    assert out[0] == "process and session group"
    assert nice_of_group(out[1]) == 7


def test_a_process_in_its_shells_session_leaves_the_group_alone() -> None:
    """The negative control: the same call, not leading its session, lowers only itself. Its group
    is this test's; in the first session of a container (PID 1's) that is the kernel's default
    group, which /proc shows as an empty line, so the lines are compared whole."""
    before = Path("/proc/self/autogroup").read_text().strip()
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    assert out[0] == "process"
    assert out[1] == before == Path("/proc/self/autogroup").read_text().strip()
