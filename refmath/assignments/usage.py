"""What a test's processes used, as the kernel counts it, read from outside the student's process.

Nothing the student's process reports about itself can be believed (it can stop ``tracemalloc``,
patch ``time``, fork the work out of sight), so the grader reads the resources of the test's whole
process tree itself:

- while the test runs, :class:`Watch` reads every :data:`PERIOD` seconds the resident memory of
  every process of the test (``/proc/PID/status``: ``VmRSS`` now, ``VmHWM`` its exact peak since
  it started), keeps the peak of their sum and of each one's own peak, and ends the test when the
  sum passes the test's memory limit: the limit is per test, all its processes together, not per
  process (the rlimits the driver sets stay as a second line). A process that lives less than
  :data:`PERIOD` can be missed; a computation big enough to matter takes far longer;
- the same readings give each process's CPU time (``/proc/PID/stat``), to within :data:`PERIOD`;
- when it ends, :func:`wait` reaps it with ``wait4``, whose resource usage covers the process and
  every descendant reaped before it: the CPU time of all of them where they were reaped (not
  across bubblewrap's PID namespace, whose processes the readings count). Its ``ru_maxrss`` is not
  used: it counts the grader's own memory, which the first process shared until its ``exec``.

The test's processes are those of its own uid where the grader gives it one (a root grader),
else the descendants of the process the grader started.
"""
from __future__ import annotations

import os
import threading
import time

__all__ = ["Watch", "wait"]

PERIOD = 0.05  # seconds between two readings of the tree's memory
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _children(parent_of: dict[int, int], root: int) -> set[int]:
    tree, grew = {root}, True
    while grew:
        grew = False
        for pid, parent in parent_of.items():
            if parent in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return tree


TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _reading(pid) -> tuple[int, int, float]:
    """``(resident bytes now, peak resident bytes since its exec, CPU seconds so far)`` of one
    process."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f if b":" in line)
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[b"VmRSS"].split()[0]) * 1024, int(fields[b"VmHWM"].split()[0]) * 1024,
                (int(stat[11]) + int(stat[12])) / TICK)
    except (OSError, KeyError, ValueError, IndexError):  # gone, or a kernel thread
        return 0, 0, 0.0


def tree_readings(root: int, uid: int | None) -> dict[int, tuple[int, int, float]]:
    """:func:`_reading` of each of the test's processes: those of ``uid``, else ``root``'s
    tree."""
    parent_of, ours = {}, []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if uid is not None:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    ours.append(int(name))
            else:
                with open(f"/proc/{name}/stat", "rb") as f:
                    parent_of[int(name)] = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    if uid is None:
        ours = _children(parent_of, root)
    return {pid: _reading(pid) for pid in ours}


class Watch(threading.Thread):
    """Samples the test's summed resident memory; calls ``stop()`` once above ``limit`` bytes."""

    def __init__(self, root: int, uid: int | None, limit: int, stop):
        super().__init__(daemon=True)
        self.root, self.uid, self.limit, self.stop_test = root, uid, limit, stop
        self.peak, self.over = 0, False
        self.cpu = {}  # pid -> its CPU seconds at the last reading
        self._done = threading.Event()

    def run(self):
        while not self._done.wait(PERIOD):
            readings = tree_readings(self.root, self.uid)
            used = sum(r[0] for r in readings.values())
            self.peak = max(self.peak, used, *(r[1] for r in readings.values()))
            for pid, reading in readings.items():
                self.cpu[pid] = max(self.cpu.get(pid, 0.0), reading[2])
            if used > self.limit and not self.over:
                self.over = True
                self.stop_test()

    def finish(self):
        self._done.set()
        self.join()

    @property
    def cpu_s(self) -> float:
        """CPU seconds of the test's processes as last read (to within :data:`PERIOD` of each)."""
        return sum(self.cpu.values())


def wait(pid: int, deadline: float | None) -> tuple[int | None, object | None]:
    """``(exit code as subprocess gives it, rusage)`` of the child ``pid``, reaped by ``wait4``;
    ``(None, None)`` if it is still running at ``deadline`` (``time.monotonic()``)."""
    while True:
        done, status, rusage = os.wait4(pid, os.WNOHANG if deadline is not None else 0)
        if done:
            return os.waitstatus_to_exitcode(status), rusage
        if time.monotonic() >= deadline:
            return None, None
        time.sleep(0.01)
