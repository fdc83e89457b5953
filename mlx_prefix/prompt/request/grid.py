"""The canonical chunk grid (invariant 4).

Prefill numerics depend on how a prompt is cut into chunks (with a real BLAS a 512|188
split and a 300|212|188 split give different logits). So chunk boundaries are a pure
function of the token prefix: position b (0 < b) is on the grid iff
  - b is a multiple of `chunk_size`, or
  - b is one of the early points: chunk_size/2, chunk_size/4, ... down to EARLY_MIN
    (64 and 128 for the default 256), so a prompt's first chunk is cut geometrically
    and a divergence near its start still restores close to it, or
  - b >= 2 and tokens[b-1] is a segment token: the special token just before a
    message's content (`<|im_start|>` in ChatML, `<|end_header_id|>` in Llama 3, or an
    end-of-turn token like `</s>` for templates without one; see
    boundaries.detect_grid), or
  - tokens[:b] ends with the template's generation prompt (`<|im_start|>assistant\\n`), or
  - tokens[:b] ends with the template's turn start: the tokens that open an assistant
    turn in the history as in the generation prompt (`<|assistant|>` in GLM-4.7, whose
    generation prompt goes on with `<think>` while an earlier turn goes on with
    `</think>`; boundaries.detect_grid finds them), so a conversation whose template
    re-renders an earlier reply (drops or moves its reasoning) diverges on the grid.
and never inside an image: where tokens[b-1] is an image's placeholder value other
than its last (a prompt's key salts each image's placeholder run: vision/key.py; the
values are below -2**32, the last one marked), b is no point, whatever the rules above say,
so an image is always computed in one chunk; the special token that opens an image
(`<|vision_start|>`) is a segment token of a vision model, so its start is a point, and
so is its end (tokens[b-1] the last of its values): text after the same image restores
past it.
Whether b is on the grid depends on tokens[:b] alone, so two prompts sharing a prefix
agree on every grid point inside it. Checkpoints are taken only on grid points and
prefill always runs chunk by chunk between consecutive grid points: a request restored
from any checkpoint then computes exactly the chunks a cold run computes.

Special tokens are hard BPE segmentation points, so a cut just after one survives
re-rendering; a cut after plain text (`...assistant\\n`) only counts when the whole
generation prompt matches. A segment token at position 0 (a BOS, ChatML's first
`<|im_start|>`) is no point: a one-token first chunk costs a forward pass and no
checkpoint wants it.

Periodic checkpoints (`periodic`) sit on a geometric-then-regular series: the early
points, then chunk_size x 2^k below the interval, then every multiple of the interval
(64, 128, 256, 512, 1024, 1536, ... for the defaults). A divergence at position p then
finds a periodic checkpoint r with p - r < interval and p - r <= max(63, p // 2): the
recompute is a bounded share of what came before it, at most 512 tokens, and the series
costs log2(interval / EARLY_MIN) checkpoints more than the regular grid (a hybrid pays
its recurrent state for each; their attention KV is shared: engine/prefill/checkpoints.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mlx_prefix.vision.key import ends_span, inside_span

# Bump when the rules above change: entries cut by other rules (on disk, say) must not
# match, so the version is part of `signature()` and thereby of every cache key.
GRID_RULES = 5
# The smallest early point: a shorter first chunk costs a forward pass for too little.
EARLY_MIN = 64


@dataclass(frozen=True, slots=True)
class ChunkGrid:
    chunk_size: int
    segment_tokens: frozenset[int] = frozenset()  # a grid point falls right after these
    generation_suffix: tuple[int, ...] = ()  # ... and right after this token sequence
    # ... and right after any of these: the runs that open an assistant turn (after a
    # user message, after a tool result)
    turn_start: tuple[tuple[int, ...], ...] = ()

    def signature(self) -> str:
        """What decides where chunks end: part of every cache key (entries computed on
        another grid would not reproduce a cold run's numbers)."""
        specials = ",".join(map(str, sorted(self.segment_tokens)))
        suffix = ",".join(map(str, self.generation_suffix))
        turn = "|".join(",".join(map(str, run)) for run in self.turn_start)
        return (
            f"rules={GRID_RULES};chunk={self.chunk_size};after={specials};gen={suffix};turn={turn}"
        )

    def is_point(self, tokens: Sequence[int], b: int) -> bool:
        """Whether position b (0 < b <= len(tokens)) is on the grid of `tokens`."""
        if b <= 0 or b > len(tokens) or inside_span(tokens, b):
            return False
        if b % self.chunk_size == 0 or (b >= 2 and tokens[b - 1] in self.segment_tokens):
            return True
        if ends_span(tokens[b - 1]):
            return True
        if b < self.chunk_size and b >= EARLY_MIN and self.chunk_size % b == 0:
            if (self.chunk_size // b) & (self.chunk_size // b - 1) == 0:  # a power of 2
                return True
        if any(_ends_with(tokens, b, run) for run in self.turn_start):
            return True
        return _ends_with(tokens, b, self.generation_suffix)

    def turn_starts(self, tokens: Sequence[int]) -> list[int]:
        """Where assistant turns open in `tokens` (ascending): grid points, each the
        place a template that re-renders an earlier reply makes a conversation diverge."""
        lasts = {run[-1] for run in self.turn_start}
        return [
            i + 1
            for i, t in enumerate(tokens)
            if t in lasts and any(_ends_with(tokens, i + 1, run) for run in self.turn_start)
        ]

    def early_points(self) -> tuple[int, ...]:
        """chunk_size/2, chunk_size/4, ... down to EARLY_MIN, ascending."""
        out, b = [], self.chunk_size
        while b % 2 == 0 and b // 2 >= EARLY_MIN:
            b //= 2
            out.append(b)
        return tuple(reversed(out))

    def periodic(self, n: int, interval: int) -> list[int]:
        """Periodic checkpoint positions <= n (the module docstring's series); every one
        is a grid point of any prompt without images (with images, align each: one may
        fall inside an image). `interval` is a multiple of the chunk size."""
        out = [b for b in self.early_points() if b <= n]
        b = self.chunk_size
        while b < interval and b <= n:
            out.append(b)
            b *= 2
        out += range(interval, n + 1, interval)
        return out

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


def _ends_with(tokens: Sequence[int], b: int, run: tuple[int, ...]) -> bool:
    k = len(run)
    return k > 0 and b >= k and tuple(tokens[b - k : b]) == run
