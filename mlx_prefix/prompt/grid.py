"""The canonical chunk grid (DESIGN invariant 4).

Prefill numerics depend on how a prompt is cut into chunks (with a real BLAS a 512|188
split and a 300|212|188 split give different logits). So chunk boundaries are a pure
function of the token prefix: position b (0 < b) is on the grid iff
  - b is a multiple of `chunk_size`, or
  - b >= 2 and tokens[b-1] is a segment token: the special token just before a
    message's content (`<|im_start|>` in ChatML, `<|end_header_id|>` in Llama 3, or an
    end-of-turn token like `</s>` for templates without one; see
    boundaries.detect_grid), or
  - tokens[:b] ends with the template's generation prompt (`<|im_start|>assistant\\n`).
Whether b is on the grid depends on tokens[:b] alone, so two prompts sharing a prefix
agree on every grid point inside it. Checkpoints are taken only on grid points and
prefill always runs chunk by chunk between consecutive grid points: a request restored
from any checkpoint then computes exactly the chunks a cold run computes.

Special tokens are hard BPE segmentation points, so a cut just after one survives
re-rendering; a cut after plain text (`...assistant\\n`) only counts when the whole
generation prompt matches. A segment token at position 0 (a BOS, ChatML's first
`<|im_start|>`) is no point: a one-token first chunk costs a forward pass and no
checkpoint wants it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Bump when the rules above change: entries cut by other rules (on disk, say) must not
# match, so the version is part of `signature()` and thereby of every cache key.
GRID_RULES = 2


@dataclass(frozen=True, slots=True)
class ChunkGrid:
    chunk_size: int
    segment_tokens: frozenset[int] = frozenset()  # a grid point falls right after these
    generation_suffix: tuple[int, ...] = ()  # ... and right after this token sequence

    def signature(self) -> str:
        """What decides where chunks end: part of every cache key (entries computed on
        another grid would not reproduce a cold run's numbers)."""
        specials = ",".join(map(str, sorted(self.segment_tokens)))
        suffix = ",".join(map(str, self.generation_suffix))
        return f"rules={GRID_RULES};chunk={self.chunk_size};after={specials};gen={suffix}"

    def is_point(self, tokens: Sequence[int], b: int) -> bool:
        """Whether position b (0 < b <= len(tokens)) is on the grid of `tokens`."""
        if b <= 0 or b > len(tokens):
            return False
        if b % self.chunk_size == 0 or (b >= 2 and tokens[b - 1] in self.segment_tokens):
            return True
        k = len(self.generation_suffix)
        return k > 0 and b >= k and tuple(tokens[b - k : b]) == self.generation_suffix

    def points(self, tokens: Sequence[int], start: int = 0, end: int | None = None) -> list[int]:
        """Grid points p with start < p <= end, ascending."""
        end = len(tokens) if end is None else end
        return [b for b in range(start + 1, end + 1) if self.is_point(tokens, b)]

    def align(self, tokens: Sequence[int], n: int) -> int:
        """The largest grid point <= n, or 0."""
        for b in range(min(n, len(tokens)), 0, -1):
            if self.is_point(tokens, b):
                return b
        return 0

    def chunk_ends(self, tokens: Sequence[int], start: int, end: int | None = None) -> list[int]:
        """Where prefill chunks end when computing tokens[start:end]; `start` must be 0 or a
        grid point. The last chunk ends at `end` even when it is not a grid point."""
        end = len(tokens) if end is None else end
        assert start == 0 or self.is_point(tokens, start), "prefill must resume on the grid"
        ends = self.points(tokens, start, end)
        if not ends or ends[-1] != end:
            ends.append(end)
        return ends
