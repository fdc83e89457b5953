"""Idle unload: a model nobody used for its keep-alive is unloaded, and the next request
naming it loads it again (server/served/pool.py does both, as a swap would).

A model is in use while a request holds it (a lease: a handler between its lookup and
its return) or runs in its engine (a stream still decoding); its idle time counts from
the last check that saw it in use. How long it may stay idle is the pool's
`keep_alive_for`: a pin in the settings file (never), a request's keep_alive, the
file's keep_alive, else `serve --keep-alive` for models loaded on demand (5 minutes, as
Ollama) and `--model-keep-alive` for the --model one (forever). Unloading gives the
memory back (platform.release_memory). One task on the event loop, polling a few times
per shortest keep-alive (at most once a second): no thread, no MLX here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from mlx_prefix.config import FOREVER, format_duration

from .lease import busy

if TYPE_CHECKING:
    from .pool import ModelPool

log = logging.getLogger("mlx_prefix.server")

MAX_POLL_S = 1.0
MIN_POLL_S = 0.05


class IdleUnloader:
    def __init__(self, pool: ModelPool, clock: Callable[[], float] | None = None):
        """`clock`: the pool's (ModelPool.clock) unless given: a slot's last use and
        now must come from the same one."""
        self.pool = pool
        self.clock = clock or pool.clock
        self.unloaded: list[str] = []  # ids unloaded when idle, in order (tests, logs)

    def poll_s(self) -> float:
        """A quarter of the shortest finite keep-alive among resident models, within
        [MIN_POLL_S, MAX_POLL_S]."""
        finite = [t for t in map(self.pool.keep_alive_for, self.pool.slots()) if t != FOREVER]
        return min(max(min(finite, default=MAX_POLL_S) / 4, MIN_POLL_S), MAX_POLL_S)

    async def run(self) -> None:
        """Check until cancelled (the app's shutdown)."""
        while True:
            await asyncio.sleep(self.poll_s())
            try:
                await self.check()
            except Exception:  # noqa: BLE001 - a failed unload must not end the watch
                log.exception("idle unload failed")

    async def check(self) -> list[str]:
        """Unload every resident model idle past its keep-alive; returns their ids."""
        now = self.clock()
        gone = []
        for slot in self.pool.slots():
            if busy(slot):
                slot.last_used = now
                continue
            keep = self.pool.keep_alive_for(slot)
            if keep == FOREVER or now - slot.last_used < keep:
                continue
            reason = f"idle for {format_duration(keep)}" if keep else "keep_alive 0"
            if await self.pool.unload(slot.spec.key, reason):
                gone.append(slot.spec.id)
        self.unloaded += gone
        return gone
