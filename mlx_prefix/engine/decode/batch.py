"""DecodeBatch: the running requests' caches merged into one batched cache (MLX).

mlx-lm's batch caches (BatchKVCache, ArraysCache, CacheList, ...) left-pad shorter
sequences and mask the padding; a step is one forward of every row, as mlx_lm.server
decodes. Each layer kind merges its own way (cache/layers/: sliding-window rows kept in
temporal order, KV with room for the next steps). Batch invariance (--deterministic)
adds engine/forward/rowwise.py's row groups and per-row attention.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_prefix.cache.layers import kind_of
from mlx_prefix.cache.layers.rewind import Held, hold, keep_rows, trims_back
from mlx_prefix.cache.snapshot import cache_nbytes
from mlx_prefix.engine.decode.sampling import (
    TokenSampler,
    normalize,
    top_logprobs,
)
from mlx_prefix.engine.decode.step import RowSample, Step, read
from mlx_prefix.engine.forward.kv_quant import KvQuant
from mlx_prefix.engine.forward.rowwise import batched
from mlx_prefix.vision.forward import decode_positions
from mlx_prefix.vision.rope import positions


def batchable(cache: list) -> bool:
    """Whether this cache may decode batched (every layer's kind can merge)."""
    return all(kind_of(c).batchable(c) for c in cache)


def _tokens_in(cache: list) -> int:
    """Tokens a sequence's cache holds (a sliding window's total, not its window); a
    CacheList's (falcon_h1: Mamba-2 beside attention in one layer) by its members."""
    layers = [m for c in cache for m in getattr(c, "caches", (c,))]
    offsets = [c.offset for c in layers if isinstance(getattr(c, "offset", None), int)]
    return max(offsets, default=0)


def _merged(layers: Sequence[Any], steps: int) -> Any:
    """One layer of several sequences' caches as one batch cache, with room for `steps`
    more tokens where that saves a copy (cache/layers/: each kind merges its own way)."""
    return kind_of(layers[0]).merge(layers, steps)


class DecodeBatch:
    """Rows in insertion order; row i belongs to `members[i]`. Engine thread only.

    By default (`rows` None) a step is one forward of every row, as mlx_lm.server
    decodes: a row's numbers may then move with what shares its step (batching, never
    the cache: no decode state is stored). With `rows` (--deterministic) a step runs
    batch-invariant (engine/forward/rowwise.py): projections in groups of at most `rows` rows,
    attention per row over its own keys, so each row's numbers are those of the same
    request decoding alone.

    With `kv` (quantized KV, engine/forward/kv_quant.py) the batch holds one row, its cache
    unmerged (mlx-lm has no batched quantized cache), quantized after each step as
    mlx_lm does."""

    def __init__(
        self,
        model: nn.Module,
        rows: int | None = None,
        agree: Callable[[mx.array], mx.array] | None = None,
        kv: KvQuant | None = None,
        exact_verify: bool = True,
    ):
        self.model = model
        # A verify forward computes each position alone (`verify_rows`) even without
        # `rows`: --draft-model's replies are the target's own, bit for bit.
        self.exact_verify = exact_verify
        self.rows = rows  # rows one matmul may hold and still compute each like alone
        self.agree = agree  # sharded: every rank goes on with rank 0's tokens (sharded/group.py)
        self.kv = kv
        self.cache: list = []
        # Caches of sequences that joined since the last step: merged into `cache` all at
        # once (one copy of the batch, not one per joining sequence).
        self._joining: list[list] = []
        self._room = 0  # tokens the joining sequences may still decode (the most of them)
        self.members: list[Any] = []
        self._samplers: list[TokenSampler] = []
        self._inputs: list[int] = []  # next input token per row
        self._lengths: list[int] = []  # tokens in each row's cache
        self._deltas: list[int] = []  # each row's rotary shift (images in its prompt)
        self._launched: Step | None = None  # a step computing, not read yet (`step`)
        self._verifying = 0  # positions of a verify not settled yet (`verify_rows`)
        # A cache that cannot trim a rejected draft (recurrent layers), held before
        # the verify, and the verify's tokens (`settle` computes the kept ones again).
        self._verified: tuple[Held, Sequence[int]] | None = None

    def __len__(self) -> int:
        return len(self.members)

    def add(
        self,
        member: Any,
        cache: list,
        sampler: TokenSampler,
        first_token: int,
        steps: int = 0,
        delta: int = 0,
    ) -> None:
        """Join a sequence whose prompt is fully in `cache`; its next input is first_token.
        `steps`: decode steps it may take (the merged buffer makes room for them);
        `delta`: its rotary position less its index (images before: vision/positions.py)."""
        if self.kv is not None:
            assert not self.cache, "a quantized-KV engine decodes one request at a time"
            self.cache = list(cache)
        else:
            self._joining.append(list(cache))
            self._room = max(self._room, steps)
        self.members.append(member)
        self._samplers.append(sampler)
        self._inputs.append(first_token)
        self._lengths.append(_tokens_in(cache))
        self._deltas.append(delta)

    def join(self) -> None:
        """Merge the sequences that joined into the batch cache, in joining order (lazy:
        the next evaluation copies them)."""
        if not self._joining:
            return
        new = [_merged(layers, self._room) for layers in zip(*self._joining, strict=True)]
        self._joining, self._room = [], 0
        if not self.cache:
            self.cache = new
            return
        for layer, joined in zip(self.cache, new, strict=True):
            layer.extend(joined)

    def remove(self, members: Sequence[Any]) -> None:
        self.join()
        gone = {id(m) for m in members}
        keep = [i for i, m in enumerate(self.members) if id(m) not in gone]
        if len(keep) == len(self.members):
            return
        if not keep:
            self.cache, self.members, self._samplers, self._inputs = [], [], [], []
            self._lengths, self._deltas, self._launched = [], [], None
            self._verified = None  # a request that ended inside its verify
            return
        if self._launched is not None:  # its rows are the first ones (`in_flight`)
            launched = [i for i in keep if i < len(self._launched.members)]
            if launched:
                self._launched.keep(launched)
            else:
                self._launched = None
        for c in self.cache:
            c.filter(keep)
        self.members = [self.members[i] for i in keep]
        self._samplers = [self._samplers[i] for i in keep]
        self._inputs = [self._inputs[i] for i in keep]
        self._lengths = [self._lengths[i] for i in keep]
        self._deltas = [self._deltas[i] for i in keep]

    @property
    def launched(self) -> bool:
        """Whether a step is computing whose tokens nobody has read yet (`step(overlap=True)`)."""
        return self._launched is not None

    def in_flight(self, row: int) -> bool:
        """Whether row `row` has a token in the launched step: the launched rows are
        always the batch's first ones (joiners are appended, leavers filtered out)."""
        return self._launched is not None and row < len(self._launched.members)

    def step(
        self, want_logprobs: bool = False, top_n: int = 0, overlap: bool = False
    ) -> list[tuple[Any, RowSample]]:
        """One decode step for every row; returns (member, its sample) per row read.
        Logprobs (and the `top_n` most likely tokens) only when asked: computed with the
        tokens, in the same evaluation.

        With `overlap` the step is launched (mx.async_eval) with the tokens of the one
        before as its input, still lazy, and that earlier step is read meanwhile, as
        mlx_lm.generate pipelines: building a step's graph in Python overlaps the
        previous step's compute. So a call returns the tokens of the step launched by
        the call before (none on the first). A row that ends on a token read then has
        one token computed past its end, dropped with it. A step without `overlap` needs
        the launched one read first (`read_launched`): its rows then start from their
        newest token (a constraint's mask, a forced close)."""
        self.join()
        assert overlap or self._launched is None, "read the launched step first"
        step = self._launch(want_logprobs, top_n)
        if not overlap:
            return self._read(step)
        mx.async_eval(*step.arrays)
        earlier, self._launched = self._launched, step
        return self._read(earlier) if earlier is not None else []

    def read_launched(self) -> list[tuple[Any, RowSample]]:
        """The rows of the step launched ahead, read now (none if none); nothing launches."""
        step, self._launched = self._launched, None
        return self._read(step) if step is not None else []

    def _launch(self, want_logprobs: bool, top_n: int) -> Step:
        """Build one step of every row (lazy): each row's input is its token in the
        launched step, or its own next input when it has none there."""
        if self._launched is None:
            inputs = mx.array(self._inputs)
        else:
            inputs = self._launched.tokens
            if joined := self._inputs[len(self._launched.members) :]:
                inputs = mx.concatenate([inputs, mx.array(joined, dtype=inputs.dtype)])
        inputs = inputs[:, None]  # [B, 1]
        self._lengths = [n + 1 for n in self._lengths]
        with positions(decode_positions(self._deltas)):
            if self.kv is not None:
                logits = self.model(inputs, cache=self.cache)[:, -1, :]  # [1, V]
                self.kv.apply(self.cache)
            elif self.rows is None:
                logits = self.model(inputs, cache=self.cache)[:, -1, :]  # [B, V]
            else:
                with batched(self.rows, self._lengths):
                    logits = self.model(inputs, cache=self.cache)[:, -1, :]  # [B, V]
        logprobs = normalize(logits) if want_logprobs else None
        tokens = mx.concatenate(
            [
                s(logits[i : i + 1], None if logprobs is None else logprobs[i : i + 1])
                for i, s in enumerate(self._samplers)
            ]
        )  # [B]
        if self.agree is not None:
            tokens = self.agree(tokens)
        step = Step(list(self.members), tokens)
        if logprobs is not None:
            step.chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]  # [B]
            if top_n:
                step.top_ids, step.top_values = top_logprobs(logprobs, top_n)  # [B, n] each
        return step

    def _read(self, step: Step) -> list[tuple[Any, RowSample]]:
        """Wait for `step` and hand out its rows; they become those rows' next inputs."""
        tokens, samples = read(step)
        self._inputs[: len(tokens)] = tokens
        return list(zip(step.members, samples, strict=True))

    def sampler(self, row: int) -> TokenSampler:
        return self._samplers[row]

    def verify(self, tokens: Sequence[int]) -> mx.array:
        """The only row's input and the L-1 tokens after it, computed in one forward
        like L decode steps (engine/decode/speculative.py): logits [L, V]. The cache then holds
        all L; `settle` says which stay."""
        assert len(self.members) == 1 and self._launched is None
        assert tokens[0] == self._inputs[0]
        self.join()
        self._verified = None if trims_back(self.cache) else (hold(self.cache), tuple(tokens))
        return self._verify_forward([tokens])[0]

    def verify_rows(self, rows: Sequence[Sequence[int]]) -> mx.array:
        """Each row's input and the tokens drafted after it (one per member, in order;
        an input alone is a row too), computed in one forward [B, L] like decode steps:
        logits [B, L, V], L the longest row. A shorter row is padded at its end with
        its last token: causal attention keeps its own positions from the padding's,
        which `settle_rows` drops. The cache then holds L more positions of every row.

        With `rows` (--deterministic), or `exact_verify` (--draft-model), each position
        computes as the decode step at it would, alone, bit for bit
        (engine/forward/rowwise.py `verify`). Otherwise (prompt lookup by default) the
        forward is the model's own, as a batched decode step is: a position's numbers
        may differ from its decode step's in the last bits (the matmul holds more
        rows), the same kind of difference batching already allows."""
        assert len(rows) == len(self.members) and self._launched is None
        assert all(row[0] == token for row, token in zip(rows, self._inputs, strict=True))
        self.join()
        self._verified = None  # several rows: held by verify_rows.py where needed
        return self._verify_forward(rows)

    def recompute_rows(self, rows: Sequence[Sequence[int]]) -> None:
        """After `verify_rows` and its cache put back as held (verify_rows.py): each
        row's kept positions computed again in one forward, as `verify_rows` computed
        them (lazy: the next step's); `settle_rows` then settles them."""
        self._verify_forward(rows)

    def _verify_forward(self, rows: Sequence[Sequence[int]]) -> mx.array:
        width = max(len(row) for row in rows)
        self._verifying = width
        inputs = mx.array([[*row, *[row[-1]] * (width - len(row))] for row in rows])
        # A shorter row's padding is dropped by `settle_rows`: not computed (on a CPU a
        # padded position costs what a real one does, so a row drafting nothing beside
        # one drafting 8 would cost 9 positions).
        widths = [len(row) for row in rows]
        lengths = [n + width for n in self._lengths]
        exact = self.rows is not None or self.exact_verify
        with positions(decode_positions(self._deltas)):
            if not exact and all(w == width for w in widths):
                return self.model(inputs, cache=self.cache)  # [B, L, V]
            with batched(self.rows or 1, lengths, verify=True, widths=widths, exact=exact):
                return self.model(inputs, cache=self.cache)

    def settle(self, length: int, next_input: int, rejected: int) -> None:
        """After `verify`: drop its last `rejected` positions; the row then holds
        `length` tokens and goes on with `next_input`. A cache that cannot trim them is
        put back as it was before the verify and the kept positions computed again, as
        the verify computed them (cache/layers/rewind.py)."""
        verified, self._verified = self._verified, None
        if rejected and verified is not None:
            held, tokens = verified
            held.restore()
            self._verify_forward([tokens[: len(tokens) - rejected]])  # lazy: the next step's
        elif rejected:
            for c in self.cache:
                c.trim(rejected)
        self._lengths = [length]
        self._inputs = [next_input]
        self._verifying = 0

    def settle_rows(
        self, kept: Sequence[int], next_inputs: Sequence[int], computed: Sequence[int] = ()
    ) -> None:
        """After `verify_rows`, for the members still in the batch (in order): each keeps
        the first `kept[i]` of the verify's positions and goes on with `next_inputs[i]`.
        The rows stay left-padded, ending together: those that kept other than most
        rows did move, left into their left padding or right, and the positions past
        the end are trimmed (cache/layers/rewind.py `keep_rows`). After
        `recompute_rows`, `computed[i]` of its positions are row i's (the rest of its
        kept ones stayed from the verify)."""
        width, self._verifying = self._verifying, 0
        assert len(kept) == len(self.members) == len(next_inputs) and width
        keep_rows(self.cache, width, computed or kept)
        self._lengths = [n + k for n, k in zip(self._lengths, kept, strict=True)]
        self._inputs = list(next_inputs)

    def nbytes(self) -> int:
        joining = sum(cache_nbytes(c) for c in self._joining)
        return (cache_nbytes(self.cache) if self.cache else 0) + joining
