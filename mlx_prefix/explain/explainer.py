"""The Explainer: finished requests in, records of why each reused what it did out.

`submit` only queues the request's trace (any thread, O(1)): comparing the prompt with
its namespace's history, decoding the texts and deciding the reason run on the
explainer's own thread, off the engine thread and the event loop. Readers call
`records` (which first lets the queue drain, briefly) and `totals`.

Bounded: the last `size` records, the history's bounds (history.py), the store's
eviction record (cache/eviction/log.py). Records carry the sender's namespace id, and every
listing goes through the server's `visible`: a client reads its own records only.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from mlx_prefix.cache.eviction.log import digest
from mlx_prefix.cache.token_ids import WIDTH, packed
from mlx_prefix.explain import texts
from mlx_prefix.explain.history import Closest, PromptHistory, Seen
from mlx_prefix.explain.history import Divergence as Place
from mlx_prefix.explain.reasons import (
    NO_DIVERGENCE,
    REASONS,
    Divergence,
    EvictedHit,
    Evidence,
    Verdict,
    decide,
)
from mlx_prefix.explain.texts import Location
from mlx_prefix.explain.trace import CacheTrace

log = logging.getLogger("mlx_prefix.explain")

RECENT = 500  # records kept
NEARBY = 8  # tokens apart that still count as "the same place" (volatile)
EVICTED_CHECKS = 32  # evicted records of a key compared with a prompt, newest first


@dataclass(frozen=True, slots=True)
class ExplainedRequest:
    id: str
    created: int  # unix time
    model: str
    api: str  # chat, completions, messages, responses
    prompt_tokens: int
    cached_tokens: int
    source: str  # memory, disk, none
    reason: str
    diverged_at: int | None  # first token that differs from the closest prompt seen
    location: Location | None  # the message that token lies in
    before: str | None  # the text there, as stored (at most texts.TEXT_CHARS)
    after: str | None  # ... and as this request sent it
    lost_tokens: int  # computed, though the cache would have served them but for `reason`
    detail: str
    namespace: str  # the sender's namespace id: who may read this record (not shown)

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["namespace"]
        return out


@dataclass(frozen=True, slots=True)
class _Job:
    trace: CacheTrace
    request_id: str
    api: str
    namespace_id: str
    created: int


class Explainer:
    def __init__(
        self, size: int = RECENT, history: PromptHistory | None = None, *, enabled: bool = True
    ) -> None:
        self.enabled = enabled  # False (--no-explain): nothing is queued or kept
        self._queue: queue.SimpleQueue[_Job | tuple[str, str | None] | None] = queue.SimpleQueue()
        self._records: deque[ExplainedRequest] = deque(maxlen=size)
        self._history = history or PromptHistory()
        self._totals = {r: [0, 0] for r in REASONS}  # reason -> [requests, tokens lost]
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._pending = 0
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- any thread -------------------------------------------------------------------
    def submit(self, trace: CacheTrace, request_id: str, api: str, namespace_id: str) -> None:
        """Queue a finished request (admitted by the engine) to be explained."""
        if not trace.admitted or not self.enabled:
            return  # never reached the cache (refused, or cancelled while waiting)
        self._put(_Job(trace, request_id, api, namespace_id, int(time.time())))

    def forget(self, namespace: str | None) -> None:
        """After a flush of `namespace` (None: all), its earlier prompts are no reason."""
        self._put(("forget", namespace))

    def records(self, wait_s: float = 2.0) -> list[ExplainedRequest]:
        """Newest first, once the requests queued before the call are explained (waiting
        at most `wait_s`). Does not mutate."""
        with self._drained:
            self._drained.wait_for(lambda: self._pending == 0, wait_s)
            return list(reversed(self._records))

    def totals(self) -> dict[str, tuple[int, int]]:
        """Per reason: requests and tokens lost, since start."""
        with self._lock:
            return {r: (n, t) for r, (n, t) in self._totals.items()}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(5)

    def _put(self, item: _Job | tuple[str, str | None]) -> None:
        with self._lock:
            if self._closed:
                return
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="mlx-prefix-explain", daemon=True
                )
                self._thread.start()
        self._queue.put(item)

    # -- the explainer's thread -------------------------------------------------------
    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                if isinstance(item, _Job):
                    self._add(self._explain(item))
                else:
                    self._history.forget(item[1])
            except Exception:  # a record lost, never the thread
                log.exception("could not explain a request")
            finally:
                # Not held while waiting for the next: a trace holds its model's tokenizer
                # and renderer and the request's images, which an unload must free.
                item = None
                with self._drained:
                    self._pending -= 1
                    self._drained.notify_all()

    def _add(self, record: ExplainedRequest) -> None:
        with self._lock:
            self._records.append(record)
            counts = self._totals[record.reason]
            counts[0] += 1
            counts[1] += record.lost_tokens
        if record.reason != "hit" and record.lost_tokens > 0:
            where = (
                f" (message {record.location.message}, {record.location.role})"
                if record.location
                else ""
            )
            log.info(
                "%s %s: reused %d of %d prompt tokens, %d lost; diverged at token %s%s: "
                "%s; was %r, now %r",
                record.id, record.reason, record.cached_tokens, record.prompt_tokens,
                record.lost_tokens, record.diverged_at, where, record.detail,
                (record.before or "")[:60], (record.after or "")[:60],
            )  # fmt: skip

    def _explain(self, job: _Job) -> ExplainedRequest:
        t = job.trace
        ctx = t.context
        raw = packed(t.tokens)
        history = self._history
        closest = history.closest(t.namespace, t.entry_key, raw)
        d = closest.shared if closest is not None else 0
        messages = t.prompt.messages if t.prompt is not None else None
        where = texts.location(ctx.grid, t.tokens, messages, d) if closest is not None else None
        divergence = NO_DIVERGENCE
        if closest is not None and d < min(closest.seen.length, len(t.tokens)):
            divergence = self._divergence(t, closest, where, messages)

        def align(n: int) -> int:
            return ctx.grid.align(t.tokens, n)

        evidence = Evidence(
            length=len(t.tokens),
            cached=t.cached,
            enabled=t.enabled,
            off=t.off,
            opening=ctx.opening() if messages else 0,
            stored_match=max(t.stored_match, t.cached),
            closest=closest,
            elsewhere=history.elsewhere(t.namespace, t.entry_key, raw),
            identity=ctx.identity,
            cache_key=ctx.cache_key,
            salt=t.salt,
            kwargs=t.template_kwargs,
            align=align,
            divergence=divergence,
            evicted=lambda cached: _evicted(t, raw, closest, align, cached),
            resumed_cancelled=t.resumed_cancelled,
        )
        verdict = decide(evidence)
        record = self._record(job, verdict, where if verdict.diverged_at == d else None)
        if t.enabled:
            seen = Seen(
                raw=raw + packed(t.reply),
                prompt_len=len(t.tokens),
                entry_key=t.entry_key,
                identity=ctx.identity,
                cache_key=ctx.cache_key,
                salt=t.salt,
                kwargs=t.template_kwargs,
            )
            place = None
            if verdict.reason in ("edited", "volatile", "re_rendered"):
                place = Place(d, where.message if where is not None else None)
            history.add(t.namespace, seen, place)
        return record

    def _divergence(
        self, t: CacheTrace, closest: Closest, where: Location | None, messages: Any
    ) -> Divergence:
        d, seen = closest.shared, closest.seen
        tokenizer = t.context.tokenizer
        if d >= seen.prompt_len:  # inside the reply the server generated for it
            reply = texts.stored_ids(seen.raw, seen.prompt_len, seen.length)
            back = texts.reply_came_back(tokenizer, reply, t.tokens[seen.prompt_len :])
            return Divergence(False, False, not back, False)
        if messages:
            last = len(messages) - 1
            earlier = where is not None and where.message < last
            assistant = earlier and where is not None and where.role == "assistant"
        else:
            earlier, assistant = True, False  # a raw prompt: any change inside the closest's
        place = where.message if where is not None else None
        volatile = earlier and any(
            abs(p.position - d) <= NEARBY and p.message == place
            for p in self._history.divergences(t.namespace, t.entry_key)[:2]
        )
        return Divergence(earlier, assistant, False, volatile)

    def _record(self, job: _Job, verdict: Verdict, where: Location | None) -> ExplainedRequest:
        t = job.trace
        at = verdict.diverged_at
        before = after = None
        against = verdict.against
        if at is not None and against is not None and at == against.shared:
            tokenizer = t.context.tokenizer
            stored, offset = texts.window(against.seen.raw, at)
            before = texts.around(tokenizer, stored, offset)
            after = texts.around(tokenizer, t.tokens, at)
        if where is None and at is not None:
            messages = t.prompt.messages if t.prompt is not None else None
            where = texts.location(t.context.grid, t.tokens, messages, at)
        return ExplainedRequest(
            id=job.request_id,
            created=job.created,
            model=t.context.model,
            api=job.api,
            prompt_tokens=len(t.tokens),
            cached_tokens=t.cached,
            source=t.source,
            reason=verdict.reason,
            diverged_at=at,
            location=where,
            before=before,
            after=after,
            lost_tokens=verdict.lost,
            detail=verdict.detail,
            namespace=job.namespace_id,
        )


def _evicted(
    t: CacheTrace, raw: bytes, closest: Closest | None, align: Any, cached: int
) -> EvictedHit | None:
    """The evicted (or refused) entry of the request's key that would have restored the
    most, if more than `cached`: one that is a prefix of the prompt, or a trimmable one
    that is a prefix of the closest sequence (it serves what that shares)."""
    limit = len(t.tokens) - 1
    best: EvictedHit | None = None
    for r in t.context.evicted.of(t.entry_key)[:EVICTED_CHECKS]:
        if r.length <= cached:
            continue
        reuse = 0
        n = r.length * WIDTH
        if r.length <= len(t.tokens) and digest(raw[:n]) == r.digest:
            if r.trimmable:
                reuse = align(min(r.length, limit))
            elif r.length <= limit and align(r.length) == r.length:
                reuse = r.length
        elif (
            r.trimmable
            and closest is not None
            and r.length <= closest.seen.length
            and digest(closest.seen.raw[:n]) == r.digest
        ):
            reuse = align(min(r.length, closest.shared, limit))
        if reuse > cached and (best is None or reuse > best.reuse):
            best = EvictedHit(r, reuse)
    return best
