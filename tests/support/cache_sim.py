"""A deterministic simulation of the prompt cache under a mixed workload (no MLX).

Requests are token sequences made of messages; the real `PromptCache` matches and
stores them with payloads sized like a real model's (attention KV per token, recurrent
state per checkpoint), stored the way the engine's Checkpointer stores them: a
hybrid keeps every planned checkpoint (system end, last message, history end,
periodic, branch point), sharing one KV buffer per prefill (unless `shared_kv` is off:
the behaviour before issue 14); a dense model keeps its end and its system prompt.
What a run yields is the prefill work (the model's own cost estimate) the cache saved.

Workload (all seeded): long documents asked about and edited, chats sharing a system
prompt, agent sessions appending tool results, and one-shot requests (an extension's
instruction with a new page each time) that are never continued.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from mlx_prefix.cache.eviction.policy import EvictionPolicy
from mlx_prefix.cache.store import PromptCache
from mlx_prefix.cache.types import Buffer, CheckpointKind, new_buffer_key
from mlx_prefix.models.cost import PrefillCost

K = CheckpointKind
MODEL = "sim"
STEP = 256  # KV buffers grow by this many tokens


@dataclass(frozen=True)
class SimModel:
    hybrid: bool
    kv_per_token: int  # bytes
    state_bytes: int  # per checkpoint (recurrent layers), 0 for a dense model
    cost: PrefillCost


# Shaped after real models (bf16 KV; float32 recurrent state, as mlx-lm keeps it).
# Dense: Qwen3-8B (36 layers, 8 KV heads of 128; 32 query heads).
DENSE = SimModel(False, 36 * 8 * 128 * 2 * 2, 0, PrefillCost(2 * 7e9, 36 * 4 * 32 * 128))
# Hybrid: Qwen3.5-27B (16 attention layers, 4 KV heads of 256; 48 Gated DeltaNet layers
# with 48 value heads of 128 x 128 state, conv kernel 4 over 10240 channels).
HYBRID = SimModel(
    True,
    16 * 4 * 256 * 2 * 2,
    48 * (48 * 128 * 128 * 4 + 3 * 10240 * 2),
    PrefillCost(2 * 26e9 + 48 * 6 * 48 * 128 * 128, 16 * 4 * 24 * 256),
)


@dataclass(frozen=True, slots=True)
class FakeSnapshot:
    """A stored state's stand-in for the store's own tests: its length and size only."""

    length: int
    trimmable: bool = True
    nbytes: int = 10


@dataclass(frozen=True, slots=True)
class SimPayload:
    length: int
    trimmable: bool
    nbytes: int
    buffers: tuple[Buffer, ...]


@dataclass(frozen=True)
class SimRequest:
    tokens: tuple[int, ...]
    starts: tuple[int, ...]  # where each message after the first begins
    system: int  # end of the system prompt (0: none)
    source: str = ""  # which part of the workload sent it


@dataclass
class SimResult:
    requests: int = 0
    prompt_work: float = 0.0
    saved_work: float = 0.0
    saved_tokens: int = 0
    saved_by_source: dict[str, float] = field(default_factory=dict)

    @property
    def saved_share(self) -> float:
        return self.saved_work / self.prompt_work


def _roundup(n: int) -> int:
    return -(-n // STEP) * STEP


def _grid(req: SimRequest, chunk: int = 256) -> set[int]:
    return {p for p in range(chunk, len(req.tokens) + 1, chunk)} | set(req.starts)


def _plan(req: SimRequest, interval: int) -> dict[int, CheckpointKind]:
    """Where the planner puts checkpoints (boundaries.py), on the grid."""
    n = len(req.tokens)
    plan = {p: K.PERIODIC for p in range(interval, n + 1, interval)}
    plan[n] = K.HISTORY
    if len(req.starts) > 0:
        plan[req.starts[-1]] = K.LAST_MESSAGE
    if req.system:
        plan[req.system] = K.SYSTEM
    return plan


def simulate(
    model: SimModel,
    requests: list[SimRequest],
    budget: int,
    policy: EvictionPolicy,
    *,
    interval: int = 512,
    shared_kv: bool = True,
    branch: bool = True,
) -> SimResult:
    store = PromptCache(budget, policy=policy, clock=iter(range(1 << 40)).__next__)
    store.set_prefill_cost(MODEL, model.cost)
    out = SimResult()
    for req in requests:
        tokens, n = req.tokens, len(req.tokens)
        grid = _grid(req)

        def align(m: int, grid: set[int] = grid) -> int:
            return max((p for p in grid if p <= m), default=0)

        match = store.match(MODEL, tokens, align)
        reuse = match.reuse_tokens
        lease = store.acquire(match.entry_id) if match.entry_id is not None else None
        out.requests += 1
        out.prompt_work += model.cost(0, n)
        out.saved_work += model.cost(0, reuse)
        out.saved_tokens += reuse
        by = out.saved_by_source
        by[req.source] = by.get(req.source, 0.0) + model.cost(0, reuse)
        plan = {p: k for p, k in _plan(req, interval).items() if p > reuse}
        if model.hybrid:
            at = align(min(match.matched_tokens, n - 1))
            if branch and at > reuse:
                plan[at] = max(plan.get(at, K.LAST_MESSAGE), K.LAST_MESSAGE)
            _store_hybrid(store, model, tokens, plan, shared_kv)
        else:
            for p in sorted(q for q, k in plan.items() if q == n or k is K.SYSTEM):
                kv = model.kv_per_token * _roundup(p)
                store.insert(MODEL, tokens[:p], _payload(p, True, [kv]), plan[p])
        if lease is not None:
            store.release(match.entry_id)
    store.check_integrity()
    return out


def _payload(length: int, trimmable: bool, sizes: list[int], shared: Buffer | None = None):
    buffers = tuple(Buffer(new_buffer_key(), s) for s in sizes)
    buffers = (shared, *buffers) if shared is not None else buffers
    return SimPayload(length, trimmable, sum(b.nbytes for b in buffers), buffers)


def _store_hybrid(store, model, tokens, plan, shared_kv) -> None:
    kv = Buffer(new_buffer_key(), model.kv_per_token * _roundup(len(tokens)))
    for p in sorted(plan):
        kind = plan[p]
        if shared_kv and kind <= K.LAST_MESSAGE:
            payload = _payload(p, False, [model.state_bytes], kv)
        else:  # a whole capture: its own copy of the prefix KV (step-padded)
            payload = _payload(p, False, [model.state_bytes + model.kv_per_token * _roundup(p)])
        store.insert(MODEL, tokens[:p], payload, kind)


# -- the workload -----------------------------------------------------------------


@dataclass
class _Ids:
    next: int = 1000

    def take(self, n: int) -> tuple[int, ...]:
        out = tuple(range(self.next, self.next + n))
        self.next += n
        return out


@dataclass
class _Session:
    messages: list[tuple[int, ...]] = field(default_factory=list)

    def request(self, source: str) -> SimRequest:
        tokens: list[int] = []
        starts = []
        for i, m in enumerate(self.messages):
            if i:
                starts.append(len(tokens))
            tokens.extend(m)
        system = starts[0] if starts else 0
        return SimRequest(tuple(tokens), tuple(starts), system, source)


def mixed_workload(seed: int = 0, requests: int = 240) -> list[SimRequest]:
    """Interleaved documents, chats, agent sessions and one-shots."""
    rng = random.Random(seed)
    ids = _Ids()
    chat_system = ids.take(400)
    agent_system = ids.take(3000)
    extension_system = ids.take(300)
    doc_system = ids.take(60)
    docs: list[tuple[int, ...]] = []
    chats: list[_Session] = []
    agents: list[_Session] = []
    out: list[SimRequest] = []

    def document() -> Iterator[SimRequest]:
        if not docs or rng.random() < 0.3:
            docs.append(ids.take(rng.choice((2048, 4096, 8192))))
        i = rng.randrange(len(docs)) if rng.random() < 0.5 else len(docs) - 1
        doc = docs[i]
        if rng.random() < 0.4:  # an edit somewhere in it
            at = rng.randrange(len(doc))
            doc = docs[i] = doc[:at] + ids.take(rng.randint(5, 40)) + doc[at + 40 :]
        yield _Session([doc_system, doc, ids.take(rng.randint(15, 40))]).request("document")

    def chat() -> Iterator[SimRequest]:
        if not chats or rng.random() < 0.25:
            chats.append(_Session([chat_system]))
        s = rng.choice(chats[-4:])
        if len(s.messages) > 1:
            s.messages.append(ids.take(rng.randint(60, 300)))  # the reply it got
        s.messages.append(ids.take(rng.randint(20, 120)))
        yield s.request("chat")

    def agent() -> Iterator[SimRequest]:
        if not agents or rng.random() < 0.15:
            agents.append(_Session([agent_system, ids.take(80)]))
        s = agents[-1] if rng.random() < 0.8 else rng.choice(agents)
        s.messages += [ids.take(rng.randint(30, 80)), ids.take(rng.randint(200, 900))]
        yield s.request("agent")

    def one_shot() -> Iterator[SimRequest]:
        # An extension's action on a selection (short) or on a whole page.
        n = rng.randint(20, 200) if rng.random() < 0.6 else rng.randint(500, 3000)
        yield _Session([extension_system, ids.take(n)]).request("one-shot")

    sources = [(document, 0.25), (chat, 0.3), (agent, 0.25), (one_shot, 0.2)]
    while len(out) < requests:
        source = rng.choices([s for s, _ in sources], [w for _, w in sources])[0]
        out.extend(source())
    return out
