"""A service's scheduling niceness, made to count against the other services of its host.

Linux groups processes by session for CPU scheduling where ``kernel.sched_autogroup_enabled`` is 1
(the default of most distributions): CFS first shares the CPU equally between autogroups, one per
session, and only then between a group's threads by their nice values. A process alone in its
session (``card-client up`` starts every service so, as supervisors and container runtimes
commonly do) is alone in its group, so ``os.nice`` ranks its threads only against one another:
card-draft's default nice of 10 did nothing against card-target beside it, and on the 2-core box
the draft's prefill of a new prompt took half the CPU from the target's prefill of the same prompt.
Writing the value to ``/proc/self/autogroup`` too gives the whole group that nice value's weight.
Only where the process leads its session: otherwise the group is the shell's that started it, and
the value would lower everything started from that shell with it.
"""

from __future__ import annotations

import os
from pathlib import Path

AUTOGROUP = Path("/proc/self/autogroup")


def lower_priority(nice: int) -> str:
    """Raise this process's niceness by ``nice``, and its session's group's where it leads its
    session; what it lowered: "process and session group", or "process" alone."""
    os.nice(nice)  # every thread of this process, torch's included
    if not AUTOGROUP.exists() or os.getsid(0) != os.getpid():
        return "process"
    try:
        AUTOGROUP.write_text(f"{os.getpriority(os.PRIO_PROCESS, 0)}\n")
    except OSError:  # a kernel without autogroups, or a value this user may not set
        return "process"
    return "process and session group"
