"""In-process ranks for the sharded engine's tests: several engines in one process, each
on its own (whole) copy of a model, exchanging control messages through a barrier the
way group.Channel does over mx.distributed. What differs from mlx.launch is only that
a forward is not a collective; the engine's decisions travel exactly the same way."""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx

from mlx_prefix.engine.sharded.group import Cluster
from mlx_prefix.engine.sharded.plan import TurnPlan

WAIT_S = 60.0  # a rank that waits longer than this for the others counts them as gone


class LocalGroup:
    def __init__(self, size: int):
        self.size = size
        self._barrier = threading.Barrier(size)
        self._slots: list[Any] = [None] * size

    def channel(self, rank: int) -> LocalChannel:
        return LocalChannel(self, rank)

    def cluster(self, rank: int) -> Cluster:
        return Cluster(rank, self.size, "local", "tensor", ())

    def lose(self) -> None:
        """As if a rank died: every waiting and later exchange raises."""
        self._barrier.abort()

    def lose_at_next_job(self) -> None:
        """As if a rank died just as rank 0 sends a plan carrying a job: that exchange
        raises, so the job is in no phase of the engine yet."""
        self.losing_at_job = True

    losing_at_job = False

    def _round(self, rank: int, value: Any) -> list[Any]:
        try:
            self._slots[rank] = value
            self._barrier.wait(WAIT_S)
            values = list(self._slots)
            self._barrier.wait(WAIT_S)
        except threading.BrokenBarrierError:
            raise RuntimeError("[local] connection to a peer was lost") from None
        return values


class LocalChannel:
    """group.Channel's interface over a LocalGroup."""

    def __init__(self, group: LocalGroup, rank: int):
        self._group = group
        self.rank = rank
        self.size = group.size

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def exchange(self, payload: bytes | None, word: int) -> tuple[bytes, tuple[int, ...]]:
        if self._group.losing_at_job and payload is not None and TurnPlan.decode(payload).jobs:
            self._group.lose()
        values = self._group._round(self.rank, (payload, word))
        return values[0][0], tuple(v[1] for v in values)

    def agree_tokens(self, tokens: mx.array) -> mx.array:
        values = self._group._round(self.rank, tokens.tolist())
        return mx.array(values[0], dtype=tokens.dtype)

    def gather(self, value: int) -> tuple[int, ...]:
        return tuple(self._group._round(self.rank, value))

    def gather_bytes(self, blob: bytes, width: int = 512) -> list[bytes]:
        return list(self._group._round(self.rank, blob))


def on_every_rank(group: LocalGroup, fn) -> list:
    """Run `fn(rank)` on one thread per rank (they may exchange); results by rank."""
    results: list = [None] * group.size

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except Exception as e:  # noqa: BLE001 - handed back to the test
            results[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(group.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    return results
