"""The test process tree's resident memory, sampled while something runs: `PeakRss` as a
context manager gives the RSS before and the highest seen during (psutil when installed,
else Linux's /proc; `peak` is None where neither answers, and a test then checks what it
can without it). A sampler misses a peak shorter than its period, so a test compares
against a generous margin, never an exact figure."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def tree_rss() -> int | None:
    """RSS of this process and its descendants, in bytes."""
    try:
        import psutil
    except ImportError:
        return _proc_tree_rss(os.getpid())
    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total


def _proc_tree_rss(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    rss = next((int(x.split()[1]) * 1024 for x in status.splitlines() if x.startswith("VmRSS:")), 0)
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in task.read_text().split():
            rss += _proc_tree_rss(int(child)) or 0
    return rss


class PeakRss:
    def __init__(self, period_s: float = 0.002):
        self.period_s = period_s
        self.before: int | None = None
        self.peak: int | None = None
        self._stop = threading.Event()

    def __enter__(self) -> PeakRss:
        self.before = tree_rss()
        self.peak = self.before
        if self.before is not None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.before is not None:
            self._thread.join(timeout=10)
            self._note(tree_rss())

    @property
    def grew(self) -> int | None:
        """The highest RSS seen minus the one before, in bytes."""
        return None if self.peak is None or self.before is None else self.peak - self.before

    def _sample(self) -> None:
        while not self._stop.wait(self.period_s):
            self._note(tree_rss())

    def _note(self, rss: int | None) -> None:
        if rss is not None and self.peak is not None:
            self.peak = max(self.peak, rss)
