"""One reason per request, from what the server knows (issue 46). Pure: the explainer
gathers the evidence, `decide` weighs it.

Words used below: the closest is the namespace's sequence (an earlier prompt and the
reply the server generated for it) sharing the longest prefix with this prompt under
the same cache key; `shared` is that prefix. What the cache could have restored is what
earlier prefills computed of it (`cacheable`: the closest's prompt part, or the stored
entries' own longest match, which next-turn prefetches extend), aligned down on the
chunk grid and leaving one token to compute (invariants 3 and 4): `expected`.

In order, the first that holds:
- disabled: the request (prefix_cache off) or the server does not use the cache;
- new / model / settings: nothing of this namespace under this key shares more than the
  template's opening (or, no message having changed, than its first grid point); `model`
  or `settings` when a prompt sent with another model, other cache settings or another
  cache_salt does (and chat_template_kwargs that changed what the closest had rendered
  are `settings` too);
- cancelled: what it restored is where a cancelled prefill stopped (or what it stored
  running on once its client had gone): "resumed at token N";
- evicted: the cache restored less than `expected` and its record of evicted (or
  refused) entries holds one that would have given more;
- re_rendered: the prompt left the closest inside the reply the server generated (and its
  text came back changed), or inside an earlier assistant message;
- volatile: it left the closest in an earlier message, at the place (within a few tokens)
  where a recent prompt under the same key left its own closest;
- edited: it left the closest in an earlier message;
- grid: the cache restored less than `expected`: a checkpoint further back was the last
  one before the divergence (caches that restore only exact checkpoints);
- hit: everything shareable was restored, up to the grid.
`lost`: the tokens the request computed that the cache would have served had the reason
not been: the closest's prompt for a changed message, `expected` otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_prefix.cache.eviction.log import EvictedPrefix
from mlx_prefix.explain.history import Closest

REASONS = (
    "hit",
    "new",
    "edited",
    "re_rendered",
    "volatile",
    "evicted",
    "cancelled",
    "grid",
    "model",
    "settings",
    "disabled",
)


@dataclass(frozen=True, slots=True)
class EvictedHit:
    record: EvictedPrefix
    reuse: int  # tokens it would have restored


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where the prompt left its closest, when it did inside it (the caller's reading)."""

    earlier_message: bool  # in a message before the prompt's last (raw prompt: anywhere)
    assistant: bool  # in an assistant message
    reply_changed: bool  # inside the closest's reply, whose text came back changed
    volatile: bool  # a recent prompt under this key diverged at the same place


NO_DIVERGENCE = Divergence(False, False, False, False)


@dataclass(frozen=True, slots=True)
class Evidence:
    length: int  # prompt tokens
    cached: int  # restored
    enabled: bool
    off: str  # why not enabled
    opening: int  # tokens every prompt of the template starts with
    stored_match: int  # longest common prefix with a stored entry of its key
    closest: Closest | None
    elsewhere: Closest | None  # the closest under the namespace's other keys
    identity: str
    cache_key: str
    salt: str | None
    kwargs: str
    align: Callable[[int], int]  # the largest grid point <= n of this prompt
    divergence: Divergence
    evicted: Callable[[int], EvictedHit | None]  # an evicted entry restoring more than n
    resumed_cancelled: bool = False  # it restored a cancelled prefill's entry


@dataclass(frozen=True, slots=True)
class Verdict:
    reason: str
    lost: int  # tokens computed that the cache would have served but for the reason
    detail: str  # one sentence
    against: Closest | None  # what diverged_at and the texts compare with
    diverged_at: int | None


def decide(e: Evidence) -> Verdict:
    limit = e.length - 1  # at least one token is always computed
    c = e.closest
    d = c.shared if c is not None else 0
    diverged = max(d, e.stored_match)
    cacheable = max(min(d, c.seen.prompt_len) if c is not None else 0, e.stored_match)
    expected = e.align(min(cacheable, limit)) if cacheable > 0 else 0
    at = diverged if c is not None or e.stored_match else None

    def lost(upto: int) -> int:
        return max(0, min(upto, limit) - e.cached)

    def new() -> Verdict:
        o = e.elsewhere
        if o is not None and o.shared > max(e.opening, diverged):
            reason, what = _other_settings(e, o.seen)
            return Verdict(reason, lost(min(o.shared, o.seen.prompt_len)), what, o, o.shared)
        what = "nothing this client sent before shares more than the template's opening"
        return Verdict("new", 0, what, c, at)

    if not e.enabled:
        return Verdict("disabled", expected, e.off, c, at)
    if diverged <= e.opening:
        return new()
    # Past here the closest is the store's entries' match when those share more than the
    # history: a next-turn prefetch the server rendered (then the prompt is no edit).
    # Inside both: a prompt that is all in the closest (sent again) did not leave it.
    own = c if c is not None and e.stored_match <= d < min(c.seen.length, e.length) else None
    if own is not None and own.seen.kwargs != e.kwargs and d < own.seen.prompt_len:
        what = "chat_template_kwargs changed what the template wrote"
        return Verdict("settings", lost(own.seen.prompt_len), what, own, d)
    if e.resumed_cancelled and e.cached > 0:
        what = f"resumed at token {e.cached}, where a cancelled prefill of it stopped"
        return Verdict("cancelled", lost(cacheable), what, c, at)
    if e.cached < expected and (hit := e.evicted(e.cached)) is not None:
        return Verdict("evicted", hit.reuse - e.cached, _evicted(hit), c, at)
    if own is not None:
        div, seen = e.divergence, own.seen
        if d >= seen.prompt_len and div.reply_changed:
            what = "the reply came back unlike what the model generated (re-rendered)"
            return Verdict("re_rendered", lost(seen.length), what, own, d)
        if d < seen.prompt_len and div.earlier_message:
            if div.assistant:
                what = "an earlier assistant turn came back unlike what was stored"
                return Verdict("re_rendered", lost(seen.prompt_len), what, own, d)
            if div.volatile:
                what = "this place changes from request to request (a date, an id, a counter?)"
                return Verdict("volatile", lost(seen.prompt_len), what, own, d)
            what = "an earlier message changed"
            return Verdict("edited", lost(seen.prompt_len), what, own, d)
    if expected == 0:  # what it shares ends before the first grid point
        return new()
    if e.cached < expected:
        what = (
            f"restored at token {e.cached}, the last checkpoint before the divergence; "
            f"{min(cacheable, limit) - e.cached} shared tokens computed again"
        )
        return Verdict("grid", lost(cacheable), what, c, at)
    what = "reused everything it shares with the closest prompt, up to the chunk grid"
    return Verdict("hit", lost(cacheable), what, c, at)


def _other_settings(e: Evidence, other: Any) -> tuple[str, str]:
    if other.identity != e.identity:
        return "model", "a prompt sharing more was sent to another model"
    if other.cache_key != e.cache_key:
        return "settings", "a prompt sharing more was cached with other cache settings (KV bits)"
    if other.salt != e.salt:
        return "settings", "a prompt sharing more was sent with another cache_salt"
    return "settings", "a prompt sharing more was cached under other settings"


def _evicted(hit: EvictedHit) -> str:
    r = hit.record
    how = "was not stored for lack of room" if r.refused else "was evicted"
    more = f"; {_mib(r.short)} more budget would have kept it" if r.short > 1 else ""
    return f"a cached prefix of {r.length} tokens ({_mib(r.nbytes)}) {how}{more}"


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:.0f} KiB"
