"""The process group of a sharded server (started by `mlx.launch`): who this rank is, and
the collectives that carry the engine's control messages between ranks.

Every rank runs the same engine steps and rank 0 decides (engine/sharded/distributed.py). A
control message goes out as an `all_sum` of uint8 arrays to which rank 0 contributes
the bytes and every other rank zeros (a sum with zeros is a copy), as mlx_lm.server
does; values every rank contributes go through `all_gather`. They run on the CPU
stream. A peer that is gone makes the next collective raise (the ring backend:
"[ring] connection to a peer was lost"); the engine treats that as the end of the group.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import asdict, dataclass
from typing import cast

import mlx.core as mx
import numpy as np

HEADER_BYTES = 4096  # one exchange's fixed frame: length, every rank's word, inline payload
_WORD = 8  # bytes per rank's word (a uint64)


@dataclass(frozen=True, slots=True)
class RankInfo:
    rank: int
    host: str
    pid: int
    part: str  # what of the model it holds: "1/2 of every layer's heads", "layers 2-3 of 4"


@dataclass(frozen=True, slots=True)
class Cluster:
    """This process's place in the group and the group's layout (for the startup line,
    /v1/cache and /metrics)."""

    rank: int
    size: int
    backend: str  # ring | jaccl | mpi | nccl, read from what the launcher set
    mode: str  # "tensor" or "pipeline" parallel
    ranks: tuple[RankInfo, ...] = ()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        """One line: world size, backend, mode and what each rank holds."""
        parts = "; ".join(f"rank {r.rank} on {r.host} (pid {r.pid}): {r.part}" for r in self.ranks)
        return f"sharded over {self.size} ranks ({self.backend}, {self.mode} parallel): {parts}"

    def as_dict(self) -> dict:
        return {
            "world_size": self.size,
            "rank": self.rank,
            "backend": self.backend,
            "mode": self.mode,
            "ranks": [asdict(r) for r in self.ranks],
        }


def detect_backend() -> str:
    """Which backend the launcher set up, from the variables `mlx.launch` (or mpirun) sets."""
    env = os.environ
    if env.get("MLX_JACCL_COORDINATOR") or env.get("MLX_IBV_DEVICES"):
        return "jaccl"
    if env.get("MLX_HOSTFILE"):
        return "ring"
    if any(k in env for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")):
        return "mpi"
    if env.get("NCCL_HOST_IP"):
        return "nccl"
    return "unknown"


def host_name() -> str:
    return socket.gethostname()


class Channel:
    """Collectives for control messages. Every rank must call the same methods in the same
    order (they are collectives); engine thread only, once the model is loaded."""

    def __init__(self, group: mx.distributed.Group):
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        assert _WORD * (self.size + 1) < HEADER_BYTES, "too many ranks for the header frame"

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def exchange(self, payload: bytes | None, word: int) -> tuple[bytes, tuple[int, ...]]:
        """Rank 0's `payload` to every rank (others pass None), and every rank's `word`
        (a uint64, e.g. a digest of its state) to every rank. One collective when the
        payload fits the header frame, two otherwise."""
        frame = np.zeros(HEADER_BYTES, dtype=np.uint8)
        inline_at = _WORD * (self.size + 1)
        slot = _WORD * (self.rank + 1)
        frame[slot : slot + _WORD] = np.frombuffer(struct.pack("<Q", word), dtype=np.uint8)
        if self.leader:
            assert payload is not None
            frame[:_WORD] = np.frombuffer(struct.pack("<Q", len(payload)), dtype=np.uint8)
            if len(payload) <= HEADER_BYTES - inline_at:
                frame[inline_at : inline_at + len(payload)] = np.frombuffer(payload, np.uint8)
        summed = self._sum(frame)
        (length,) = struct.unpack("<Q", summed[:_WORD].tobytes())
        words = struct.unpack(f"<{self.size}Q", summed[_WORD:inline_at].tobytes())
        if length <= HEADER_BYTES - inline_at:
            return summed[inline_at : inline_at + length].tobytes(), words
        if self.leader and payload is not None:  # rank 0 passes the payload
            body = np.frombuffer(payload, np.uint8)
        else:
            body = np.zeros(length, np.uint8)
        return self._sum(body).tobytes(), words

    def agree_tokens(self, tokens: mx.array) -> mx.array:
        """Rank 0's sampled `tokens` [B] on every rank: sampling is decided once.

        `tokens` is evaluated first, on every rank: the forward that made it sums over
        the ranks too, and inside one evaluation an independent sum (zeros) could run
        before the forward's on one rank and after it on another, a deadlock."""
        mx.eval(tokens)
        mine = tokens if self.leader else mx.zeros_like(tokens)
        out = mx.distributed.all_sum(mine, group=self.group, stream=mx.cpu)
        mx.eval(out)
        return out

    def gather(self, value: int) -> tuple[int, ...]:
        """Every rank's `value` (an int64), in rank order."""
        out = mx.distributed.all_gather(
            mx.array([value], dtype=mx.int64), group=self.group, stream=mx.cpu
        )
        return tuple(int(v) for v in cast("list[int]", out.tolist()))

    def gather_bytes(self, blob: bytes, width: int = 512) -> list[bytes]:
        """Every rank's `blob` (at most `width` bytes), in rank order."""
        assert len(blob) <= width - 2, "blob too long for gather_bytes"
        frame = np.zeros(width, dtype=np.uint8)
        frame[:2] = np.frombuffer(struct.pack("<H", len(blob)), dtype=np.uint8)
        frame[2 : 2 + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
        out = mx.distributed.all_gather(mx.array(frame), group=self.group, stream=mx.cpu)
        rows = np.asarray(out).reshape(self.size, width)
        return [r[2 : 2 + struct.unpack("<H", r[:2].tobytes())[0]].tobytes() for r in rows]

    def _sum(self, frame: np.ndarray) -> np.ndarray:
        out = mx.distributed.all_sum(mx.array(frame), group=self.group, stream=mx.cpu)
        mx.eval(out)
        return np.asarray(out)
