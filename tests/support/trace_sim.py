"""The benchmark's mixed traffic replayed through the real prompt cache (no MLX).

tests/data/mixed_quick_{dense,hybrid}.json hold the request sequence one run of
`python -m benchmarks --profile quick --workloads mixed` sent (benchmarks/mixed_trace.py
wrote them): each prompt's shape (the prefix it shares with an earlier one, its chunk
grid, its planned checkpoints), the next-turn prefetch the engine queued after it, and
the tokens each of that run's servers reported cached. `replay` plays it through a
`PromptCache` the way the engine does, with payloads sized like the run's models
(float32: SmolLM2-135M, 45 KiB of KV a token; the random Qwen3.5, 2 KiB of KV a token
and 840 KiB of recurrent state a checkpoint):
- prefill runs chunk by chunk on the grid from the restored position, the running
  cache's KV growing in mlx-lm's 256-token steps (what `cache_nbytes` counts) and
  reported as active bytes after each chunk, naming the buffers it shares with the
  snapshots stored at that chunk's end (counted once: cache/eviction/active.py), and also just
  before each such insert (engine/prefill/checkpoints.py); the restored entry stays locked
  until the prefill ends; the reply's decode batch is counted before the prefill's
  bytes are dropped and that lock released (engine order);
- a dense model stores its prompt's end and its system prompt (a capture keeps the
  step-padded buffer it views); a hybrid stores every planned checkpoint and the
  branch point, sharing the prefill's KV, and captures the system prompt whole
  (engine/prefill/checkpoints.py);
- a queued next-turn prefetch runs once the engine is idle past its delay: in the
  dense run, after the next request (its log of store calls shows it); in the hybrid
  run, before it.
Run as it ran (`shared_once=False`: that engine counted a stored snapshot's buffers
again in its prefill's active bytes), the kind order and the value order as the run
had it (alpha 1.5) reproduce the run's cached tokens request by request, dense and
hybrid.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mlx_prefix.cache.eviction.policy import PROTECTED_ABOVE, EvictionPolicy
from mlx_prefix.cache.store import PromptCache
from mlx_prefix.cache.types import Buffer, CheckpointKind, new_buffer_key
from mlx_prefix.models.cost import PrefillCost
from support.paths import DATA

K = CheckpointKind
KEY = "m"
STEP = 256  # mlx-lm's KVCache grows by this many tokens


@dataclass(frozen=True)
class TraceModel:
    name: str
    kv_per_token: int  # bytes
    state_bytes: int  # recurrent state per checkpoint (0: all attention, trimmable)
    cost: PrefillCost  # estimate_prefill_cost of the run's model
    prefetch_lag: int  # a next-turn prefetch ran after this many more requests

    @property
    def hybrid(self) -> bool:
        return self.state_bytes > 0


DENSE = TraceModel("dense", 30 * 3 * 64 * 2 * 4, 0, PrefillCost(212406912.0, 69120.0), 1)
_STATE = 6 * (8 * 64 * 64 + 3 * 1024) * 4  # 6 Gated DeltaNet layers: state + conv
HYBRID = TraceModel("hybrid", 2 * 2 * 64 * 2 * 4, _STATE, PrefillCost(55347648.0, 4096.0), 0)


@dataclass(frozen=True)
class Prompt:
    tokens: tuple[int, ...]
    grid: tuple[int, ...]  # grid points, ascending
    checkpoints: dict[int, CheckpointKind]

    def align(self, n: int) -> int:
        return max((p for p in self.grid if p <= n), default=0)


@dataclass(frozen=True)
class TraceRequest:
    label: str
    prompt: Prompt
    prefetch: Prompt | None
    cached: dict[str, int]  # the run's cached tokens, per policy ("value", "kind")


@dataclass(frozen=True)
class Trace:
    model: str
    budget_bytes: int  # the run's --cache-budget
    requests: tuple[TraceRequest, ...]


def load(model: str) -> Trace:
    raw = json.loads((DATA / f"mixed_quick_{model}.json").read_text())
    prompts: list[Prompt] = []
    fresh = iter(range(10**6, 10**9))  # new tokens: ids no other sequence holds
    for s in raw["sequences"]:
        j, shared = s["prefix"]
        head = prompts[j].tokens[:shared] if j >= 0 else ()
        tokens = head + tuple(next(fresh) for _ in range(s["new"]))
        kinds = {p: K(k) for p, k in s["checkpoints"]}
        prompts.append(Prompt(tokens, tuple(s["grid"]), kinds))
    requests = tuple(
        TraceRequest(
            r["label"],
            prompts[r["prompt"]],
            prompts[r["prefetch"]] if r["prefetch"] is not None else None,
            r["cached"],
        )
        for r in raw["requests"]
    )
    return Trace(raw["model"], raw["budget_bytes"], requests)


@dataclass(frozen=True, slots=True)
class Payload:
    length: int
    nbytes: int
    buffers: tuple[Buffer, ...]
    trimmable: bool


class _KV:
    """An mlx-lm KVCache's buffer size (tokens) as it grows."""

    def __init__(self, size: int = 0) -> None:
        self.size = self.offset = size

    def update(self, n: int) -> None:
        if not self.size or self.offset + n > self.size:
            if self.size and self.offset % STEP:
                self.size = self.offset  # mlx-lm trims to the offset, then grows
            self.size += -(-n // STEP) * STEP
        self.offset += n


def _payload(model: TraceModel, length: int, *sizes: int, shared: Buffer | None = None):
    buffers = ((shared,) if shared else ()) + tuple(Buffer(new_buffer_key(), s) for s in sizes)
    return Payload(length, sum(b.nbytes for b in buffers), buffers, not model.hybrid)


class _Replay:
    def __init__(
        self, model: TraceModel, budget: int, policy: EvictionPolicy, shared_once: bool
    ) -> None:
        self.model, self.shared_once = model, shared_once
        self.store = PromptCache(budget, policy=policy, clock=iter(range(1 << 40)).__next__)
        self.store.set_prefill_cost(KEY, model.cost)
        self.tasks = 0

    def nbytes(self, kv: _KV, pending: int = 0) -> int:
        return kv.size * self.model.kv_per_token + self.model.state_bytes * (1 + pending)

    def prefill(self, p: Prompt, decode: bool = True) -> int:
        store, model, n = self.store, self.model, len(p.tokens)
        match = store.match(KEY, p.tokens, p.align)
        branch = p.align(min(match.matched_tokens, n - 1))
        reuse, lease, kv = 0, None, _KV()
        if match.entry_id is not None and store.acquire(match.entry_id) is not None:
            lease, reuse, kv = match.entry_id, match.reuse_tokens, _KV(match.reuse_tokens)
        planned = {q: k for q, k in p.checkpoints.items() if q > reuse}
        if model.hybrid and reuse < branch < n:
            planned[branch] = max(planned.get(branch, K.LAST_MESSAGE), K.LAST_MESSAGE)
        planned.setdefault(n, K.HISTORY)
        key = f"task{self.tasks}"
        self.tasks += 1
        ends = [q for q in p.grid if reuse < q < n] + [n]
        begin, deferred = reuse, []
        for end in ends:  # each chunk, then its checkpoint, then the active bytes
            kv.update(end - begin)
            begin, kind, live = end, planned.get(end), ()  # the chunk wrote new buffers

            def store_sharing(q: int, k: CheckpointKind, payload: Payload) -> None:
                nonlocal live  # the live cache holds these: reported before the insert
                if self.shared_once:
                    live = tuple({b.key: b for b in (*live, *payload.buffers)}.values())
                    store.set_active_bytes(key, self.nbytes(kv, len(deferred)), live)
                store.insert(KEY, p.tokens[:q], payload, k)

            if kind is not None and kind > PROTECTED_ABOVE:  # captured whole, now
                payload = _payload(model, end, self.nbytes(kv))
                if model.hybrid:  # its recurrent state may be a copy: not claimed shared
                    store.insert(KEY, p.tokens[:end], payload, kind)
                else:
                    store_sharing(end, kind, payload)
            elif kind is not None and model.hybrid:  # bound to the final KV at the end
                deferred.append((end, kind))
            elif kind is not None and end == n:  # a dense model: its end
                store_sharing(end, kind, _payload(model, end, self.nbytes(kv)))
            if end == n:  # the prefill's end: the deferred ones complete
                shared = Buffer(new_buffer_key(), kv.size * model.kv_per_token)
                while deferred:  # each counted as pending until stored
                    q, k = deferred[0]
                    payload = _payload(model, q, model.state_bytes, shared=shared)
                    store_sharing(q, k, payload)
                    deferred.pop(0)
                    live = tuple(b for b in live if b == shared or b not in payload.buffers)
            store.set_active_bytes(key, self.nbytes(kv, len(deferred)), live)
        if decode:  # the reply's batch joins (its cache: the prompt's tokens, no padding)
            store.set_active_bytes("batch", n * model.kv_per_token + model.state_bytes)
        store.drop_active(key)
        if lease is not None:
            store.release(lease)
        store.drop_active("batch")  # a few tokens later
        return reuse


def replay(
    trace: Trace,
    model: TraceModel,
    budget: int,
    policy: EvictionPolicy,
    *,
    shared_once: bool = True,
) -> list[int]:
    """Tokens restored per request, as `trace`'s requests come, under `budget` bytes.
    `shared_once=False`: as the engine that recorded the trace counted, a stored
    snapshot's buffers again in its live prefill cache's active bytes."""
    run = _Replay(model, budget, policy, shared_once)
    # The harness's warm-up: a 4-token completion, stored like any prompt's end.
    run.prefill(Prompt(tuple(range(-4, 0)), (), {}))
    out, queued = [], []
    for i, r in enumerate(trace.requests):
        out.append(run.prefill(r.prompt))
        if r.prefetch is not None:
            queued.append((i + model.prefetch_lag, r.prefetch))
        for due, p in [q for q in queued if q[0] <= i]:
            queued.remove((due, p))
            run.prefill(p, decode=False)  # one token, sampled from the prefill's logits
    run.store.check_integrity()
    return out
