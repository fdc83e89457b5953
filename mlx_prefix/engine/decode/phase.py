"""The decode phase: requests whose prompt is computed, one token per step each.

A request joins with its prefill logits: the first token is sampled from them, then its
cache is merged into the decode batch (engine/decode/batch.py). Each token becomes a
TokenEvent; a request ends at EOS, a stop string, its token limit or a cancel. The
batch's resident bytes count against the store's byte budget. Engine thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import mlx.core as mx

from mlx_prefix.cache.handover import keep_inside, row_snapshot
from mlx_prefix.cache.store import PromptCache
from mlx_prefix.engine.decode.arrival import Arrival, sampler_for
from mlx_prefix.engine.decode.batch import DecodeBatch
from mlx_prefix.engine.decode.lookup import PromptLookup
from mlx_prefix.engine.decode.reasoning_budget import ReasoningBudget
from mlx_prefix.engine.decode.running import HandBack, Running
from mlx_prefix.engine.decode.sampling import alternatives, draw_token
from mlx_prefix.engine.decode.speculative import Speculator
from mlx_prefix.engine.decode.step import RowSample
from mlx_prefix.engine.decode.text import TextStream
from mlx_prefix.engine.decode.verify import Accept
from mlx_prefix.engine.forward.kv_quant import KvQuant
from mlx_prefix.engine.requests.jobs import Job, usage
from mlx_prefix.models.load import LoadedModel
from mlx_prefix.prompt.reply.reasoning import ReasoningMarkers
from mlx_prefix.records import DoneEvent, ErrorEvent, TokenEvent, TopLogprob

ACTIVE_BYTES_EVERY = 64  # decode steps between updates of the batch's resident bytes


class DecodePhase:
    def __init__(
        self,
        model: LoadedModel,
        store: PromptCache,
        bytes_key: str,
        end: Callable[[Job, DoneEvent | ErrorEvent], None],
        on_reply: Callable[[Job, str], None],
        *,
        kv: KvQuant | None = None,
        speculator: Speculator | None = None,
        lookup: PromptLookup | None = None,
        reasoning: ReasoningMarkers | None = None,
        agree_tokens: Callable[[mx.array], mx.array] | None = None,
    ):
        self.model = model
        self.store = store
        self._bytes_key = bytes_key  # this engine's batch bytes in the store's budget
        self._end = end  # sends a job's final event
        self._on_reply = on_reply  # a request finished with this reply (not cancelled)
        # Sharded: the tokens every rank goes on with, rank 0's (engine/sharded/distributed.py).
        self.agree_tokens = agree_tokens
        self.kv = kv  # quantized KV: one request at a time, unmerged (engine/decode/batch.py)
        # Decode rows one matmul may hold (engine/forward/rowwise.py); None: all, until
        # the engine's calibration says more (`set_rows`).
        self.rows: int | None = None
        # With --draft-model: a request decoding alone speculates (engine/decode/speculative.py).
        self.speculator = speculator
        # Prompt lookup: each request drafts from its own sequence (lookup.py).
        self.lookup = lookup
        self.batch = self._new_batch()
        self.reasoning = reasoning  # the model's think markers, for reasoning budgets
        self.steps = 0
        self.peak_batch = 0  # most requests ever decoded together (observability, tests)
        # Launch a step before the one ahead of it is read (DecodeBatch.step): only where
        # the device computes asynchronously. On the CPU, mx.async_eval returns only once
        # most of the step is computed (MLX's CPU scheduler bounds its queued tasks:
        # measured 60-83 ms of an 80-95 ms SmolLM2 step), so overlapping gains nothing there
        # and would hand each token out one step late (a burst's first gap: 527 ms
        # against 280).
        self.pipelined = mx.default_device() != mx.cpu
        self.overlapped = 0  # steps launched before the step ahead of them was read

    def __len__(self) -> int:
        return len(self.batch)

    def _new_batch(self) -> DecodeBatch:
        # Prompt lookup's verify is the model's own forward unless --deterministic
        # (DecodeBatch.verify_rows); a draft model's is exact.
        return DecodeBatch(
            self.model.model, self.rows, self.agree_tokens, self.kv,
            exact_verify=self.lookup is None,
        )  # fmt: skip

    def running(self) -> list[Running]:
        return list(self.batch.members)

    def set_rows(self, rows: int | None) -> None:
        """Decode rows one matmul may hold (engine/forward/rowwise.py; None: one plain forward of
        every row); before any request runs."""
        assert not len(self.batch)
        self.rows = rows
        self.batch = self._new_batch()

    def admit(self, arrivals: Sequence[Arrival]) -> None:
        """Requests whose prompt is computed join the batch: each samples its first
        token from its logits and may produce `limit` tokens; one its first token ends
        leaves at once. The batch cache is merged before the first tokens go out, so
        that copy never sits between a request's first and second token. The caller
        closes the prefills after."""
        firsts = [self._arrive(arrival) for arrival in arrivals]
        self.batch.join()
        mx.eval([c.state for c in self.batch.cache])
        # The prefills' caches are the batch's now (a lone one's very buffer: layers/kv.py),
        # and are closed right after: counted once, as the batch's, never both.
        for arrival in arrivals:
            self.store.drop_active(arrival.bytes_key)
        for running, token, logprob, top in firsts:
            self._accept_token(running, token, logprob, top)
        if len(self.batch):
            self.store.set_active_bytes(self._bytes_key, self._nbytes())

    def _arrive(
        self, arrival: Arrival
    ) -> tuple[Running, int, float | None, tuple[TopLogprob, ...]]:
        """Sample the arrival's first token and add it to the batch; the token is not
        handed on yet."""
        job, logits, limit, reuse = arrival.job, arrival.logits, arrival.limit, arrival.reuse
        job.handle.cached_tokens = reuse
        job.handle.cache_written_tokens = max(0, job.stored_to - reuse)
        sampler = sampler_for(job, self.model.tokenizer)
        budget = ReasoningBudget.of(
            job.sampling.reasoning_budget, self.reasoning, job.prompt.opens_reasoning, sampler
        )
        token, logprob, top = draw_token(logits, job.sampling, sampler, self.agree_tokens)
        stream = TextStream(self.model.tokenizer, job.sampling.stop)
        now = time.perf_counter()
        running = Running(job, stream, limit, reuse, arrival.prefill_tps, now, reasoning=budget)
        running.hand_back = arrival.hand_back
        if (trace := job.handle.trace) is not None:  # read by the request explainer
            trace.reply = running.emitted  # complete by the final event
        vision = job.prompt.vision
        delta = vision.delta if vision is not None else 0  # text after images: vision/rope.py
        self.batch.add(running, arrival.cache, sampler, token, max(limit - 1, 0), delta)
        if self.speculator is not None and arrival.draft is not None:
            self.speculator.adopt(running, arrival.draft)
        return running, token, logprob, top

    def step(self, stopping: bool, overlap: bool = True) -> None:
        """Drop cancelled requests (all of them when `stopping`), then one token for every
        running request. With `overlap` the next step may launch before this one's tokens
        are read (`_overlaps`); without it a step is computed and read whole, so its
        time is the step's own (engine/requests/pace.py)."""
        for running in [
            r for r in self.batch.members if r.job.handle.cancelled.is_set() or stopping
        ]:
            self._finish(running, "cancelled")
        if not len(self.batch):
            return
        self.peak_batch = max(self.peak_batch, len(self.batch))
        overlap = overlap and self.pipelined and self._overlaps()
        if self.batch.launched and not overlap:
            self.read_launched()  # then a step of its own, from every row's newest token
            if not len(self.batch):
                return  # every row ended on the tokens in flight
        if not overlap and self._speculate():
            self.steps += 1
            return
        if overlap and self.lookup is not None:
            self.lookup.plain_step(self.batch.members)
        asked = [r.job.sampling for r in self.batch.members if r.job.sampling.logprobs]
        top_n = max((s.top_logprobs for s in asked), default=0)
        self.overlapped += overlap
        rows, start = len(self.batch), time.perf_counter()
        self._accept_rows(self.batch.step(bool(asked), top_n, overlap))
        if self.lookup is not None and not overlap:  # computed and read: its own time
            self.lookup.stepped(rows, time.perf_counter() - start)
        self.steps += 1
        if self.steps % ACTIVE_BYTES_EVERY == 0 and len(self.batch):
            self.store.set_active_bytes(self._bytes_key, self._nbytes())

    def _speculate(self) -> bool:
        """A verify step: the only request's with the draft model's tokens, or with
        drafts from each request's own sequence (prompt lookup, several requests in one
        forward); False: a plain step."""
        members = self.batch.members
        if any(_bounding(r) for r in members):
            return False
        if self.speculator is not None:
            running = members[0]
            if len(members) != 1 or not (k := self.speculator.tokens_for(running)):
                return False
            accept = lambda t, lp, top: self._accept_token(running, t, lp, top)  # noqa: E731
            self.speculator.step(self.batch, running, k, accept)
            return True
        lookup = self.lookup
        return lookup is not None and lookup.step(
            self.model, self.rows, self.batch, self._accepting
        )

    def _accepting(self, running: Running) -> Accept:
        """Hands a verify's tokens to `running` (`_accept_token`)."""
        return lambda token, logprob, top: self._accept_token(running, token, logprob, top)

    def read_launched(self) -> None:
        """Hand out the tokens of a step launched ahead (if any) and launch none: before
        a prefill step, so that the prefill's time is its own and the decode step after
        it starts from every row's newest token."""
        self._accept_rows(self.batch.read_launched())

    def _accept_rows(self, rows: Sequence[tuple[Running, RowSample]]) -> None:
        for running, row in rows:
            params = running.job.sampling
            if not params.logprobs:
                self._accept_token(running, row.token, None)
                continue
            top = alternatives(row.top_ids, row.top_values, params.top_logprobs)
            self._accept_token(running, row.token, row.logprob, top)

    def _overlaps(self) -> bool:
        """Whether the next step may launch before the newest tokens are read
        (DecodeBatch.step): only where every row's next input is the token its sampler
        draws on the device, and some row goes on past the tokens in flight."""
        if self.agree_tokens is not None or self.kv is not None:
            return False  # sharded ranks agree on each token; a quantized cache steps alone
        if (len(self.batch) == 1 and self.speculator is not None) or self._may_look_up():
            return False  # the next step may speculate, from the newest token
        all_end = True
        for row, running in enumerate(self.batch.members):
            if running.job.constraint is not None or _bounding(running):
                return False  # its mask, or a forced close, needs its newest token first
            all_end = all_end and running.count + self.batch.in_flight(row) >= running.limit
        return not all_end

    def _may_look_up(self) -> bool:
        """Whether some request may draft by prompt lookup at the next step (lookup.py
        `quiet`: a paused request, or one whose reply copies nothing, does not)."""
        lookup = self.lookup
        return lookup is not None and not lookup.quiet(self.batch.members)

    def _nbytes(self) -> int:
        """The batch's resident bytes, the draft caches beside it included."""
        spec = self.speculator.nbytes() if self.speculator is not None else 0
        # A hybrid's checkpoint states, held for the entries its row gives back (handover.py).
        ends = sum(
            s.buffer.nbytes
            for r in self.batch.members
            if r.hand_back is not None
            for s in r.hand_back.states
        )
        return self.batch.nbytes() + spec + ends

    def drop_all(self) -> list[Job]:
        """Empty the batch without events (after an error); returns the jobs it held."""
        jobs = [r.job for r in self.batch.members]
        self.batch = self._new_batch()
        self.store.drop_active(self._bytes_key)
        if self.speculator is not None:
            self.speculator.clear()
        if self.lookup is not None:
            self.lookup.clear()
        return jobs

    def _accept_token(
        self,
        running: Running,
        token: int,
        logprob: float | None,
        top: tuple[TopLogprob, ...] = (),
    ) -> bool:
        """Hand a sampled token to its request; True if the request ended with it."""
        constraint = running.job.constraint
        if constraint is not None and not constraint.advance(token):
            self._finish(running, "error", f"constrained decoding failed: {constraint.error}")
            return True
        if token in self.model.tokenizer.eos_token_ids:
            self._finish(running, "stop")
            return True
        running.count += 1
        running.emitted.append(token)
        if running.reasoning is not None:
            running.reasoning.after(token)
        delta = running.stream.add(token)
        running.job.handle.emit(TokenEvent(delta, token, logprob, top))
        if running.stream.stopped or (constraint is not None and constraint.finished):
            self._finish(running, "stop")
        elif running.count >= running.limit:
            self._finish(running, "length")
        else:
            return False
        return True

    def _finish(self, running: Running, reason: str, error: str | None = None) -> None:
        job = running.job
        tail = running.stream.finish()
        if tail:
            job.handle.emit(TokenEvent(tail, None, None))
        if running.hand_back is not None:
            self._hand_back(running, running.hand_back)
        self.batch.remove([running])
        if self.speculator is not None:
            self.speculator.forget(running)
        if self.lookup is not None:
            self.lookup.forget(running)
        if len(self.batch):
            self.store.set_active_bytes(self._bytes_key, self._nbytes())
        else:
            self.store.drop_active(self._bytes_key)
        if error is not None:
            self._end(job, ErrorEvent(error))
            return
        decode_s = time.perf_counter() - running.first_at
        decode_tps = (running.count - 1) / decode_s if running.count > 1 and decode_s > 0 else 0.0
        ttft = running.first_at - job.submitted_at
        done = usage(job, running.reuse, running.count, ttft, running.prefill_tps, decode_tps)
        stop = running.stream.matched if reason == "stop" else None
        self._end(job, DoneEvent(reason, done, stop))  # type: ignore[arg-type]
        if reason != "cancelled":
            self._on_reply(job, running.stream.text)

    def _hand_back(self, running: Running, back: HandBack) -> None:
        """Store the prompt of a request whose restored entry was handed to it, from its
        row: a lone row's buffer goes to the entry as it is (the batch lets go of it right
        after: its bytes move from the batch to the entry, never counted twice), a row
        among others is copied out (cache/handover.py)."""
        self.batch.join()
        lone = len(self.batch) == 1
        row = next(i for i, m in enumerate(self.batch.members) if m is running)
        n = len(back.tokens)
        end = back.states[-1] if back.states and back.states[-1].length == n else None
        snapshot = row_snapshot(self.batch.cache, row, n, lone, end)
        # The entries' buffers are the batch's (a lone row's KV, a hybrid's states):
        # report them as shared first, so they count once.
        states = tuple(s.buffer for s in back.states)
        shared = (*snapshot.buffers, *states) if lone else states
        self.store.set_active_bytes(self._bytes_key, self._nbytes(), shared)
        keep_inside(self.store, back.key, back.tokens, snapshot, back.states)  # KV shared
        if self.store.insert(back.key, back.tokens, snapshot, back.kind):
            running.job.stored_to = max(running.job.stored_to, len(back.tokens))


def _bounding(running: Running) -> bool:
    """Its reasoning budget may still force tokens: it decodes without speculation, and
    each step waits for its token before the next launches."""
    return running.reasoning is not None and running.reasoning.bounding
