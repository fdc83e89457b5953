"""When a resident model is in use, so that nothing unloads it: a Lease held from a
handler's lookup to its end, or a job still pending in its engine (a stream decoding
after the handler returned). The pool (swaps, `unload`), the idle unloader and /v1/ps
ask `busy`; a slot's lease count changes only on the event loop's thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .loading import Slot

if TYPE_CHECKING:
    from mlx_prefix.engine.interface import EngineAPI


@dataclass(eq=False)
class Lease:
    """Keeps a slot resident from its lookup until the handler is done (then the
    engine's own pending count covers what still streams)."""

    slot: Slot | None
    released: bool = False

    def release(self) -> None:
        if not self.released and self.slot is not None:
            self.released = True
            self.slot.leases -= 1


def busy(slot: Slot) -> bool:
    """Whether a request holds the slot (a lease) or runs in its engine."""
    return slot.leases > 0 or _busy(slot.served.engine)


def _busy(engine: EngineAPI) -> bool:
    lifecycle = getattr(engine, "lifecycle", None)
    return lifecycle is not None and lifecycle.pending > 0
