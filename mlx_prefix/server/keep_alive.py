"""Ollama's `keep_alive` on the model pool (server/model_pool.py): how long a model stays
loaded once a request for it ends.

What the pool offers is what is honoured: it keeps models resident until another model
needs the place (--max-models) and can unload one on request. So:
- not sent: the server's own rule applies (the model stays until another needs its
  place), and a deadline an earlier request set is dropped, as each Ollama request
  resets the model's keep-alive;
- negative ("-1", "-1m"): the same, kept until another model needs the place;
- 0: unloaded as soon as its requests end (an empty /api/generate or /api/chat with
  keep_alive 0 is how Ollama's clients unload a model);
- a duration: unloaded once that long has passed with no request for it (a request in
  flight then keeps it: its own keep_alive decides when it ends).
A pool that cannot load a model back (a sharded group) refuses 0 and durations with a
400 naming keep_alive. State is touched only on the event loop's thread.

/api/ps reports each model's expiry from here. Idle unloading for every client, a
server-wide default, would replace the "not sent" rule above.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from dataclasses import dataclass, field

from mlx_prefix.errors import InvalidRequest

from .model_names import ModelSpec
from .model_pool import ModelPool
from .protocol.ollama_options import KeepAlive

# What Ollama reports as the expiry of a model kept for good (time.Duration's maximum
# after now, as its /api/ps shows): clients read it as "does not expire".
NEVER = datetime.datetime(2318, 1, 1, tzinfo=datetime.timezone.utc)


@dataclass(eq=False)
class _Deadline:
    at: float  # time.time() when the model goes
    at_once: bool  # keep_alive 0: unloaded once its requests end, whatever runs then
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class KeepAlives:
    def __init__(self, pool: ModelPool):
        self._pool = pool
        self._deadlines: dict[tuple[str, str | None], _Deadline] = {}
        self._unloading: set[asyncio.Future[bool]] = set()  # referenced until done

    def check(self, keep: KeepAlive | None) -> None:
        """InvalidRequest when this server cannot honour `keep`."""
        if keep is not None and not keep.forever and self._pool.loader is None:
            raise InvalidRequest(
                "keep_alive: this server cannot unload its model (it could not load it "
                "back: a sharded group); send a negative keep_alive or none",
                param="keep_alive",
            )

    def settle(self, spec: ModelSpec, keep: KeepAlive | None) -> None:
        """A request for `spec` ended (answered, failed or abandoned): apply its keep_alive."""
        old = self._deadlines.pop(spec.key, None)
        if old is not None and old.timer is not None:
            old.timer.cancel()
        if keep is None or keep.seconds is None or self._pool.loader is None:
            return
        deadline = _Deadline(time.time() + keep.seconds, at_once=keep.seconds == 0)
        loop = asyncio.get_running_loop()
        deadline.timer = loop.call_later(keep.seconds, self._expire, spec, deadline)
        self._deadlines[spec.key] = deadline

    def expires_at(self, spec: ModelSpec) -> datetime.datetime:
        deadline = self._deadlines.get(spec.key)
        if deadline is None:
            return NEVER
        return datetime.datetime.fromtimestamp(deadline.at, datetime.timezone.utc)

    def _expire(self, spec: ModelSpec, deadline: _Deadline) -> None:
        if self._deadlines.get(spec.key) is not deadline:
            return  # a later request set another deadline
        del self._deadlines[spec.key]
        if not deadline.at_once and _running(self._pool, spec):
            return  # a request in flight: when it ends, its own keep_alive decides
        reason = "keep_alive 0" if deadline.at_once else "keep_alive expired"
        task = asyncio.ensure_future(self._pool.unload(spec, reason))
        self._unloading.add(task)
        task.add_done_callback(self._unloading.discard)


def _running(pool: ModelPool, spec: ModelSpec) -> bool:
    """Whether `spec`'s engine has requests queued or running."""
    for resident, served in pool.resident_specs():
        if resident.key == spec.key:
            lifecycle = getattr(served.engine, "lifecycle", None)
            return lifecycle is not None and lifecycle.pending > 0
    return False
