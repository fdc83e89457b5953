"""Speculative decoding: a small draft model proposes tokens, the target checks them in
one forward, and the reply is exactly the target's own (mlx_lm.server's --draft-model).

Exact, not just "the same distribution": a request decoding alone runs the verify
forward of its input token and k drafted tokens [1, k+1] batch-invariant
(engine/forward/rowwise.py, `verify`): every projection row in a group that computes like one
row, query i attending over exactly the keys the decode step at its position would hold,
with that step's mask. So row i's logits equal, bit for bit, those of the i-th plain
decode step. The request's own sampler then draws at each position in order (the same
PRNG key chain, logits processors and constraint as plain decoding); a drafted token is
accepted only when it equals that draw, and the first draw that differs (or the one
after k accepted tokens) is emitted as the target's own. Greedy or seeded, the tokens
and logprobs are those of plain decoding. Rejected positions are trimmed from both
caches, or taken back from recurrent and sliding-window layers by putting the cache back
as it was before and computing the kept positions again (cache/layers/rewind.py).

The draft proposes greedily from its own KV cache of the sequence, which lives beside
the request (not in the batch) and catches up on whatever the request emitted while it
shared the batch with others: with several requests decoding, the plain batched step
runs (as mlx_lm.server, which serves one request at a time with a draft). The draft's
numbers never reach the reply, so its cache needs no grid or batch invariance.
Engine thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from mlx_prefix.cache.layers.rewind import Held, hold
from mlx_prefix.cache.snapshot import Snapshot, cache_nbytes, restore
from mlx_prefix.engine.decode.batch import DecodeBatch
from mlx_prefix.engine.decode.running import Running
from mlx_prefix.engine.decode.sampling import (
    TokenSampler,
    int_list,
    item_float,
    item_int,
    normalize,
)
from mlx_prefix.engine.decode.verify import Accept, SpeculationStats, verify_step
from mlx_prefix.engine.forward.runner import ChunkWork, always_trimmable, compute_chunks
from mlx_prefix.errors import InvalidRequest, MlxPrefixError
from mlx_prefix.models.load import LoadedModel
from mlx_prefix.records import SamplingParams

MAX_DRAFT_TOKENS = 32  # a request's num_draft_tokens above this is refused
DRAFT_CHUNK = 512  # draft catch-up tokens per forward (its numbers never matter)


class DraftMismatch(MlxPrefixError):
    """The draft model cannot serve this target (refused at startup)."""


def check_draft(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse, in one line, a draft that does not share the target's vocabulary. Either
    may have recurrent or sliding-window layers (mlx_lm refuses those): a rejected
    draft is taken back from them by putting the cache back as it was
    (cache/layers/rewind.py)."""
    t_vocab, d_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if t_vocab != d_vocab:
        raise DraftMismatch(
            f"--draft-model {draft.name}: its tokenizer differs from {target.name}'s "
            f"({len(d_vocab)} vs {len(t_vocab)} tokens); a draft must share the vocabulary"
        )


def check_request(sampling: SamplingParams, speculator: Speculator | None) -> None:
    """A request's num_draft_tokens: refused without a draft model or out of bounds."""
    k = sampling.num_draft_tokens
    if k is None:
        return
    if speculator is None:
        raise InvalidRequest(
            "num_draft_tokens needs a server started with --draft-model", param="num_draft_tokens"
        )
    if not 0 <= k <= MAX_DRAFT_TOKENS:
        raise InvalidRequest(
            f"num_draft_tokens must be between 0 and {MAX_DRAFT_TOKENS}", param="num_draft_tokens"
        )


def check_lookup_request(sampling: SamplingParams, has_lookup: bool) -> None:
    """A request's prompt_lookup: refused out of bounds, or where this engine has no
    prompt lookup at all (a --draft-model drafts instead, or a sharded model)."""
    k = sampling.prompt_lookup
    if k is None:
        return
    if not 0 <= k <= MAX_DRAFT_TOKENS:
        raise InvalidRequest(
            f"prompt_lookup must be between 0 and {MAX_DRAFT_TOKENS}", param="prompt_lookup"
        )
    if not has_lookup and k:
        raise InvalidRequest(
            "prompt_lookup is not available on this server (its --draft-model drafts, or "
            "the model is sharded over ranks)",
            param="prompt_lookup",
        )


def verify_matches(model: nn.Module, rows: int, vocab: int, k: int = 3) -> bool:
    """Startup check (engine thread): a verify forward of k+1 tokens gives the tokens and
    logprobs of k+1 plain decode steps on a synthetic prompt, bit for bit. A model whose
    layers bypass the batch-invariant ones (engine/forward/rowwise.py) would fail it."""
    prompt = [10 + (7 * i) % max(2, min(vocab, 1000) - 10) for i in range(40)]

    def fresh() -> DecodeBatch:
        cache = make_prompt_cache(model)
        compute_chunks(model, [ChunkWork(cache, prompt, 0, len(prompt))], group=False)
        batch = DecodeBatch(model, rows)
        batch.add(0, cache, TokenSampler(SamplingParams(temperature=0.0)), prompt[-1])
        return batch

    batch = fresh()
    steps = [batch.step(want_logprobs=True)[0][1] for _ in range(k + 1)]
    inputs = [prompt[-1], *(s.token for s in steps[:-1])]
    logprobs = [normalize(row[None]) for row in fresh().verify(inputs)]
    return all(
        item_int(mx.argmax(lp, axis=-1)) == s.token and item_float(lp[0, s.token]) == s.logprob
        for lp, s in zip(logprobs, steps, strict=True)
    )


@dataclass(slots=True)
class DraftCache:
    """The draft model's KV of a sequence's first `held` tokens."""

    model: nn.Module
    cache: list
    held: int = 0
    # A draft with recurrent or sliding-window layers: its cache as it was before the
    # draft tokens of the last proposal, and the tokens it held then (`trim` puts it back).
    before: tuple[Held, int] | None = None

    def extend(self, tokens: Sequence[int], end: int) -> mx.array | None:
        """Compute tokens[held:end] into the cache; the last position's logits [1, V]
        (lazy), None if there was nothing to compute."""
        logits = None
        for start in range(self.held, end, DRAFT_CHUNK):
            stop = min(start + DRAFT_CHUNK, end)
            chunk = mx.array(tuple(tokens[start:stop]))[None]  # [1, L]
            logits = self.model(chunk, cache=self.cache)[:, -1, :]
            if stop < end:
                mx.eval([c.state for c in self.cache])
        self.held = max(self.held, end)
        return logits

    def trim(self, keep: int) -> None:
        """Keep the first `keep` tokens (a cache that cannot trim goes back to before
        the proposal, and `extend` computes the kept draft tokens again)."""
        before, self.before = self.before, None
        if keep < self.held and before is not None:
            before[0].restore()
            self.held = before[1]
        elif keep < self.held:
            for layer in self.cache:
                layer.trim(self.held - keep)
            self.held = keep

    def nbytes(self) -> int:
        return cache_nbytes(self.cache)


@dataclass(slots=True)
class Speculator:
    draft: LoadedModel
    num_draft_tokens: int  # the server's default k (a request may ask for another)
    stats: SpeculationStats = field(default_factory=SpeculationStats)
    enabled: bool = True  # False: the startup check found the verify forward inexact
    _states: dict[int, DraftCache] = field(default_factory=dict)  # by id(Running)

    def draft_for(
        self, snapshot: Snapshot | None, trim: int, reuse: int, first: int = 0
    ) -> DraftCache:
        """A prefill's draft cache: restored beside the target's from the entry's draft
        part (with room for a first chunk of `first` tokens), or empty (prefill computes
        the draft over the prefix: `prefill_to`)."""
        part = snapshot.draft if snapshot is not None else None
        untrimmable = not always_trimmable(make_prompt_cache(self.draft.model))
        if part is not None and part.length - trim == reuse and not (trim and untrimmable):
            self.stats.draft_restored += reuse
            cache = restore(part, trim=trim, extend=min(first, DRAFT_CHUNK))
            return DraftCache(self.draft.model, cache, reuse)
        return DraftCache(self.draft.model, make_prompt_cache(self.draft.model))

    def prefill_to(self, draft: DraftCache, tokens: Sequence[int], end: int) -> None:
        """The draft follows the target's prefill to `end` (before its checkpoint)."""
        self.stats.draft_computed += max(0, end - draft.held)
        draft.extend(tokens, end)
        mx.eval([c.state for c in draft.cache])

    def adopt(self, running: Running, draft: DraftCache) -> None:
        """`running` joined the decode batch with the prompt in `draft`."""
        self._states[id(running)] = draft

    def nbytes(self) -> int:
        return sum(d.nbytes() for d in self._states.values())

    def tokens_for(self, running: Running) -> int:
        """Draft tokens for this request's next step (0: a plain decode step; always for a
        prompt with images: the draft model sees no images)."""
        if not self.enabled or running.job.prompt.vision is not None:
            return 0
        asked = running.job.sampling.num_draft_tokens
        k = self.num_draft_tokens if asked is None else asked
        return max(0, min(k, running.limit - running.count - 1))

    def forget(self, running: Running) -> None:
        self._states.pop(id(running), None)

    def clear(self) -> None:
        self._states.clear()

    def step(self, batch: DecodeBatch, running: Running, k: int, accept: Accept) -> None:
        """One verify step for the batch's only request (engine/decode/verify.py)."""
        assert len(batch) == 1 and k > 0
        sequence = (*running.job.tokens, *running.emitted)  # the last is the batch's input
        held = len(sequence) - 1  # tokens in the target's cache
        drafted = self._propose(running, sequence, k)
        kept, _ = verify_step(batch, running, drafted, accept, self.stats)
        state = self._states.get(id(running))
        if state is not None:  # drop the draft's rejected tokens
            state.trim(held + kept)

    def _propose(self, running: Running, sequence: Sequence[int], k: int) -> list[int]:
        """k greedy draft tokens after `sequence` (the draft's cache catches up first:
        with what the request emitted, or the whole prompt if it has no cache yet)."""
        state = self._states.get(id(running))
        if state is None:
            state = DraftCache(self.draft.model, make_prompt_cache(self.draft.model))
            self._states[id(running)] = state
        logits = state.extend(sequence, len(sequence))
        assert logits is not None, "the draft holds the whole sequence"
        if not always_trimmable(state.cache):  # taken back by `trim`, not trimmed
            state.before = (hold(state.cache), len(sequence))
        tokens = [mx.argmax(logits, axis=-1)]  # [1]
        for _ in range(k - 1):
            logits = state.model(tokens[-1][:, None], cache=state.cache)[:, -1, :]
            tokens.append(mx.argmax(logits, axis=-1))
        drafted = mx.concatenate(tokens)
        mx.eval(drafted)
        state.held = len(sequence) + k - 1
        return int_list(drafted)
