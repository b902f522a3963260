"""How busy the machine was while a point was measured: other processes' CPU time, time stolen by a hypervisor, and
the load average. A timing taken while other work ran is not the engine's own (on a 2-core laptop one busy process
halves a decode step's speed), so each timing point carries these figures and is re-measured or flagged.

Linux reports them in /proc/stat; elsewhere only the load average is known and the rest is None.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

# the share of the machine's CPU time taken from us (other processes' CPU time and the time a hypervisor stole) above
# which a timing is called disturbed (a quiet machine shows 0-2 %: the shell, the kernel's own threads); below
# DISTURBED_FLOOR_S of taken time in all, /proc/stat's 10 ms ticks are too coarse to tell, so a short point is never
# called disturbed
DISTURBED_SHARE = 0.10
DISTURBED_FLOOR_S = 0.2
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass
class Load:
    wall_s: float = 0.0
    others_cpu_s: float | None = None  # CPU time of every other process while this one was measured
    others_cpu_share: float | None = None  # the same / (wall time x cores)
    steal_s: float | None = None  # time the hypervisor ran other guests on our virtual CPUs, over all of them
    steal_share: float | None = None  # the same / (wall time x cores)
    load_avg_1m: float | None = None

    @property
    def taken_s(self) -> float | None:
        """CPU time the measured process could not have: other processes' and the hypervisor's. On a VM, steal is how
        a noisy neighbour shows (it is not in other processes' time: the guest never sees it run)."""
        if self.others_cpu_s is None and self.steal_s is None:
            return None
        return (self.others_cpu_s or 0.0) + (self.steal_s or 0.0)

    @property
    def taken_share(self) -> float | None:
        if self.others_cpu_share is None and self.steal_share is None:
            return None
        return (self.others_cpu_share or 0.0) + (self.steal_share or 0.0)

    @property
    def disturbed(self) -> bool:
        share, taken = self.taken_share, self.taken_s
        return share is not None and share > DISTURBED_SHARE and taken > DISTURBED_FLOOR_S

    def columns(self) -> dict:
        return {"load_avg_1m": self.load_avg_1m, "others_cpu_s": self.others_cpu_s,
                "others_cpu_share": self.others_cpu_share, "steal_s": self.steal_s, "steal_share": self.steal_share,
                "disturbed": self.disturbed}


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy ticks of all CPUs, stolen ticks) since boot."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq, steal


def _family_cpu_s(root: int) -> dict[int, float]:
    """CPU time (user + system) of `root` and every process below it, by pid; empty where /proc cannot tell."""
    seen, todo = {}, [root]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
            seen[pid] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError, IndexError):
            continue
    return seen


def _own_cpu_s(family: int | None) -> dict[int, float]:
    return _family_cpu_s(family) if family is not None else {0: time.process_time()}


@contextmanager
def measured_load(family: int | None = None):
    """Context manager yielding a Load filled in on exit. family: a process whose whole tree counts as this one (a
    study's workers, which share the cores on purpose: kvlib.study.executor.Processes); else this process alone."""
    load = Load(load_avg_1m=os.getloadavg()[0] if hasattr(os, "getloadavg") else None)
    before, own_before, t0 = _cpu_ticks(), _own_cpu_s(family), time.perf_counter()
    yield load
    after, own_after = _cpu_ticks(), _own_cpu_s(family)
    load.wall_s = time.perf_counter() - t0
    if before is not None and after is not None and load.wall_s > 0:
        busy_s = (after[0] - before[0]) / CLOCK_TICKS
        own_s = sum(s - own_before.get(pid, 0.0) for pid, s in own_after.items())
        load.others_cpu_s = max(busy_s - own_s, 0.0)
        capacity_s = load.wall_s * (os.cpu_count() or 1)
        load.others_cpu_share = load.others_cpu_s / capacity_s
        load.steal_s = (after[1] - before[1]) / CLOCK_TICKS
        load.steal_share = load.steal_s / capacity_s
