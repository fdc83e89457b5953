"""Each namespace's recent prompts, with the replies the server generated for them: what
a new prompt is compared with to say where it stopped matching (issue 46).

A sequence is a request's prompt followed by its reply, packed (8 bytes a token). The
closest to a new prompt is the one sharing the longest prefix with it, compared in place
(memcmp, token_ids.common_tokens). Only a namespace's own sequences are ever compared
(invariant 10): another client's prompt is never a reason, and never text in a record.

Bounded: `per_key` sequences per entry key (a sequence that a newer one extends is
dropped first: the newer serves every comparison it would), `max_keys` keys per
namespace, and `max_tokens` tokens over all namespaces, the least recently used
namespace's oldest sequences going first. Not thread-safe: the explainer's thread only.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from mlx_prefix.cache.token_ids import WIDTH, common_tokens

PER_KEY = 8
MAX_KEYS = 8
MAX_TOKENS = 1 << 20  # 8 MiB of packed ids in all
DIVERGENCES = 8  # recent divergences remembered per key (the `volatile` reason)


@dataclass(frozen=True, slots=True)
class Seen:
    """One request's prompt and reply, as a later request is compared with it."""

    raw: bytes  # packed ids: the prompt, then the reply
    prompt_len: int  # tokens of the prompt (the rest is the reply the server generated)
    entry_key: str  # the cache key its entries went under (model, namespace, salt)
    identity: str  # the model's identity key
    cache_key: str  # the model's whole cache key (with grid, kernels, KV bits)
    salt: str | None
    kwargs: str  # its chat_template_kwargs (trace.kwargs_digest)

    @property
    def length(self) -> int:
        return len(self.raw) // WIDTH


@dataclass(frozen=True, slots=True)
class Closest:
    seen: Seen
    shared: int  # tokens a query has in common with it, from the start


@dataclass(frozen=True, slots=True)
class Divergence:
    position: int  # the first token that differed
    message: int | None  # the message it lies in (None: not a chat prompt)


@dataclass(slots=True)
class _Space:
    keys: OrderedDict[str, deque[Seen]] = field(default_factory=OrderedDict)
    divergences: dict[str, deque[Divergence]] = field(default_factory=dict)
    tokens: int = 0


class PromptHistory:
    def __init__(
        self, per_key: int = PER_KEY, max_keys: int = MAX_KEYS, max_tokens: int = MAX_TOKENS
    ) -> None:
        self.per_key = per_key
        self.max_keys = max_keys
        self.max_tokens = max_tokens
        self._spaces: OrderedDict[str, _Space] = OrderedDict()  # least recently used first
        self.tokens = 0  # held over all namespaces

    def closest(self, namespace: str, key: str, raw: bytes) -> Closest | None:
        """The sequence of `namespace` under `key` sharing the longest prefix with `raw`
        (ties: the newest). Does not mutate."""
        space = self._spaces.get(namespace)
        return _best(space.keys.get(key, ()) if space else (), raw)

    def elsewhere(self, namespace: str, key: str, raw: bytes) -> Closest | None:
        """The closest of `namespace`'s sequences under its other keys (another model, other
        cache settings, another salt). Does not mutate."""
        space = self._spaces.get(namespace)
        if space is None:
            return None
        return _best((s for k, q in space.keys.items() if k != key for s in q), raw)

    def divergences(self, namespace: str, key: str) -> tuple[Divergence, ...]:
        """Where the recent prompts of `namespace` under `key` stopped matching, newest
        first. Does not mutate."""
        space = self._spaces.get(namespace)
        found = space.divergences.get(key) if space else None
        return tuple(reversed(found)) if found else ()

    def add(self, namespace: str, seen: Seen, divergence: Divergence | None) -> None:
        """Remember a request's sequence (and where it diverged from the closest, if it
        did inside it) (mutates)."""
        space = self._spaces.pop(namespace, None) or _Space()
        self._spaces[namespace] = space  # most recently used
        queue = space.keys.pop(seen.entry_key, None) or deque()
        space.keys[seen.entry_key] = queue
        for old in [s for s in queue if seen.raw.startswith(s.raw)]:
            queue.remove(old)  # the new sequence extends it: it serves every comparison
            self._count(space, -old.length)
        queue.append(seen)
        self._count(space, seen.length)
        if divergence is not None:
            kept = space.divergences.setdefault(seen.entry_key, deque(maxlen=DIVERGENCES))
            kept.append(divergence)
        while len(queue) > self.per_key:
            self._count(space, -queue.popleft().length)
        while len(space.keys) > self.max_keys:
            key, dropped = space.keys.popitem(last=False)
            space.divergences.pop(key, None)
            self._count(space, -sum(s.length for s in dropped))
        self._shrink()

    def forget(self, namespace: str | None = None) -> None:
        """Drop one namespace's sequences (None: every namespace's) (mutates): after a
        flush nothing of them is in the cache."""
        if namespace is None:
            self._spaces.clear()
            self.tokens = 0
        elif (space := self._spaces.pop(namespace, None)) is not None:
            self.tokens -= space.tokens

    def check_integrity(self) -> None:
        """Assert the counts and bounds. Does not mutate."""
        total = 0
        for space in self._spaces.values():
            held = sum(s.length for q in space.keys.values() for s in q)
            assert held == space.tokens, "namespace token count"
            assert all(len(q) <= self.per_key for q in space.keys.values())
            total += held
        assert total == self.tokens, "total token count"

    def _count(self, space: _Space, tokens: int) -> None:
        space.tokens += tokens
        self.tokens += tokens

    def _shrink(self) -> None:
        """Oldest sequences of the least recently used namespaces first; the newest
        sequence of the namespace just used stays, whatever its size."""
        while self.tokens > self.max_tokens and self._spaces:
            namespace, space = next(iter(self._spaces.items()))
            key, queue = next(iter(space.keys.items()))
            if len(self._spaces) == 1 and len(space.keys) == 1 and len(queue) == 1:
                return
            self._count(space, -queue.popleft().length)
            if not queue:
                del space.keys[key]
                space.divergences.pop(key, None)
            if not space.keys:
                del self._spaces[namespace]


def _best(candidates, raw: bytes) -> Closest | None:
    best: Closest | None = None
    for seen in candidates:  # oldest first: `>=` keeps the newest of equals
        shared = common_tokens(raw, 0, seen.raw)
        if best is None or shared >= best.shared:
            best = Closest(seen, shared)
    return best
