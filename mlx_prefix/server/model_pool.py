"""Several models served on demand: the request's `model` (and `adapters`) -> an engine.

One engine per (model folder, adapter). Only models the operator named can be selected
(any page can send a request here): which model a name selects is
server/model_names.py's ModelSelector.

At most `max_models` engines are resident. A model not resident is loaded on its own
thread (never on the event loop), after a memory check (server/model_loading.py, which
also says how a failed load never leaves the server without what it served). Making
room unloads the least recently used engine once it is drained: no lease (a handler
between its lookup and the end of its call) and no job pending in the engine.

Every engine draws on the default engine's PromptCache: one byte budget and
one eviction order across models (cache keys carry the model, so entries never mix),
and one DiskCache (one index, one disk budget).

Without a loader (library use, sharded serving) only the default model is served, as
before. With one, the pool owns the default engine too: it may unload and reload it.
State is touched only on the event loop's thread.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from mlx_prefix.errors import InvalidRequest
from mlx_prefix.platform import available_memory

from .model_loading import EngineLoader, EngineSwapper, Slot, memory_fit, on_own_thread
from .model_names import ModelSelector, ModelSpec, ServedModel

if TYPE_CHECKING:
    from mlx_prefix.engine.interface import EngineAPI

DRAIN_POLL_S = 0.02


@dataclass(frozen=True)
class ModelCard:
    """One /v1/models row."""

    id: str
    context_length: int | None
    aliases: tuple[str, ...] = ()
    alias_of: str | None = None  # --model-alias rows: the folder or hub id it names
    resident: bool = True
    adapters: tuple[str, ...] = ()  # adapter folders with an engine resident


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


class ModelPool:
    def __init__(
        self,
        engine: EngineAPI,
        aliases: tuple[str, ...] = (),
        *,
        strict: bool = False,
        loader: EngineLoader | None = None,
        max_models: int = 1,
        model_aliases: Mapping[str, str] | None = None,
        allowed_models: Sequence[str] = (),
        memory: Callable[[], int | None] | None = None,
    ):
        if max_models < 1:
            raise ValueError("max_models must be at least 1")
        default = ServedModel.of(engine, aliases)
        adapter = getattr(getattr(engine.model, "identity", None), "adapter", None)
        self.selector = ModelSelector(
            default,
            str(adapter) if adapter else None,
            strict=strict,
            model_aliases=model_aliases,
            allowed_models=allowed_models,
        )
        self.names = self.selector.registry  # the default model's names
        self.default_spec = self.selector.default_spec
        self.model_aliases = self.selector.model_aliases
        self.loader = loader
        self.max_models = max_models
        self._memory = memory  # None: platform.available_memory
        disk = getattr(engine, "disk", None)
        self._swapper = (
            EngineSwapper(
                loader,
                getattr(engine, "store", None),
                disk.cache if disk is not None else None,
                last=engine,
            )
            if loader is not None
            else None
        )
        self._slots: OrderedDict[tuple[str, str | None], Slot] = OrderedDict()
        self._slots[self.default_spec.key] = Slot(self.default_spec, default)
        self._loading: dict[tuple[str, str | None], asyncio.Future[Slot]] = {}
        self._lock: asyncio.Lock | None = None  # made on the event loop
        self.loads = 0  # models loaded on demand (observability, tests)

    @property
    def unloads(self) -> int:
        """Models unloaded to make room (observability, tests)."""
        return self._swapper.unloads if self._swapper is not None else 0

    # -- lookups (event loop) -------------------------------------------------------
    async def acquire(
        self, name: str | None, adapter: str | None = None
    ) -> tuple[ServedModel, Lease]:
        """The model answering `name` (with `adapter`), loaded if need be, and a lease
        keeping it resident until released. Raises ModelNotFound (404), InvalidRequest,
        InsufficientMemory (507), or the load's own error."""
        if self.loader is None:
            if adapter is not None:
                raise InvalidRequest(
                    "adapters: this server cannot load models on demand (a sharded group, "
                    "or an app without a loader); start it with --adapter",
                    param="adapters",
                )
            self.names.resolve(name)  # a 404 when strict and unknown
            slot = next(iter(self._slots.values()))
            return slot.served, Lease(None)
        spec = self.spec_for(name, adapter)
        while True:
            slot = self._slots.get(spec.key)
            if slot is None:
                task = self._loading.get(spec.key)
                if task is None:
                    task = self._loading[spec.key] = asyncio.ensure_future(self._load(spec))
                    task.add_done_callback(lambda _, k=spec.key: self._loading.pop(k, None))
                slot = await asyncio.shield(task)
            if not slot.retiring:  # else it was chosen for unloading meanwhile: load again
                break
        self._slots.move_to_end(spec.key)
        slot.leases += 1
        return slot.served, Lease(slot)

    def spec_for(self, name: str | None, adapter: str | None = None) -> ModelSpec:
        """What `name` (with `adapter`) selects; ModelNotFound as `acquire`. Loads nothing."""
        if self.loader is None:
            self.names.resolve(name)  # a 404 when strict and unknown
            return self.default_spec
        resident = [slot.spec for slot in self._slots.values()]
        return self.selector.spec_for(name, adapter, resident)

    # -- views ----------------------------------------------------------------------
    def primary(self) -> EngineAPI:
        """The engine the cache routes, dashboard, /metrics and /health show: the
        default model's when resident, else the most recently used one."""
        slot = self._slots.get(self.default_spec.key)
        if slot is None and self._slots:
            slot = next(reversed(self._slots.values()))
        if slot is None:  # every model was unloaded: only a pool with a loader unloads
            assert self._swapper is not None
            return self._swapper.last
        return slot.served.engine

    def resident(self) -> list[ServedModel]:
        return [s.served for s in self._slots.values()]

    def resident_specs(self) -> list[tuple[ModelSpec, ServedModel]]:
        """The resident engines with what they were loaded as (least recent first)."""
        return [(s.spec, s.served) for s in self._slots.values()]

    def cards(self) -> list[ModelCard]:
        """/v1/models: the default (with its aliases), each --model-alias, then the
        other resident models; adapters under their base model's row."""
        default = self._slots.get(self.default_spec.key)
        rows = {
            self.default_spec.id: ModelCard(
                self.default_spec.id,
                _context(default),
                self.names.default.aliases,
                resident=default is not None,
            )
        }
        for alias, target in self.model_aliases.items():
            rows.setdefault(alias, ModelCard(alias, None, alias_of=target, resident=False))
        for slot in self._slots.values():
            row = rows.get(slot.spec.id) or ModelCard(slot.spec.id, None, resident=False)
            if slot.spec.adapter is None or slot.spec == self.default_spec:
                row = replace(row, resident=True, context_length=_context(slot))
            else:
                row = replace(row, adapters=(*row.adapters, str(slot.spec.adapter)))
            rows[slot.spec.id] = row
        return list(rows.values())

    # -- loading and unloading ------------------------------------------------------
    async def _load(self, spec: ModelSpec) -> Slot:
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            if (slot := self._slots.get(spec.key)) is not None:
                return slot
            victims = self._victims()
            free = (self._memory or available_memory)()
            alongside = (
                not victims if free is None else memory_fit(spec, victims, free, self.max_models)
            )
            for v in victims:  # no new lease from here on: a lookup loads it again
                v.retiring = True
                del self._slots[v.spec.key]
            for v in victims:
                while v.leases or _busy(v.served.engine):
                    await asyncio.sleep(DRAIN_POLL_S)
            try:
                swap = self._swapper.swap  # type: ignore[union-attr]
                engine = await asyncio.wrap_future(on_own_thread(swap, victims, spec, alongside))
            except BaseException:
                await self._reinstate(victims)
                raise
            self.loads += 1
            aliases = self.names.default.aliases if spec == self.default_spec else ()
            served = ServedModel(spec.id, engine, aliases, str(spec.folder))
            slot = self._slots[spec.key] = Slot(spec, served)
            return slot

    async def unload(self, spec: ModelSpec, reason: str) -> bool:
        """Unload `spec`'s engine once its requests end (a client asked: Ollama's
        keep_alive). A lookup meanwhile loads it again, after this. False when it is not
        resident, or when this pool could not load it back (no loader)."""
        if self._swapper is None or spec.key not in self._slots:
            return False
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            slot = self._slots.pop(spec.key, None)
            if slot is None:
                return False
            slot.retiring = True  # no new lease from here on: a lookup loads it again
            while slot.leases or _busy(slot.served.engine):
                await asyncio.sleep(DRAIN_POLL_S)
            await asyncio.wrap_future(on_own_thread(self._swapper.unload, slot, reason))
        return True

    def _check_memory(self, spec: ModelSpec, victims: list[Slot]) -> bool:
        """InsufficientMemory when `spec` does not fit even after unloading `victims`;
        else whether it fits alongside them (unknown memory: only when none go)."""
        free = (self._memory or available_memory)()
        return not victims if free is None else memory_fit(spec, victims, free, self.max_models)

    def _victims(self) -> list[Slot]:
        """The least recently used slots to unload so that one more fits."""
        excess = len(self._slots) + 1 - self.max_models
        return list(self._slots.values())[: max(excess, 0)]

    async def _reinstate(self, victims: list[Slot]) -> None:
        """After a failed load: the models it was to replace serve again, those still
        loaded at once, those already unloaded loaded anew (on a loader thread)."""
        for v in reversed(victims):
            if not v.unloaded:
                v.retiring = False
                self._slots[v.spec.key] = v
                self._slots.move_to_end(v.spec.key, last=False)  # still the least recent
        gone = [v for v in victims if v.unloaded]
        if gone:
            reload = self._swapper.reload  # type: ignore[union-attr]
            reloaded = await asyncio.wrap_future(on_own_thread(reload, gone))
            for slot in reversed(reloaded):
                self._slots[slot.spec.key] = slot
                self._slots.move_to_end(slot.spec.key, last=False)

    def close(self, timeout: float = 10.0) -> None:
        """Shut every resident engine down (the server's shutdown)."""
        for slot in list(self._slots.values()):
            slot.served.engine.shutdown(timeout=timeout)


def _busy(engine: EngineAPI) -> bool:
    lifecycle = getattr(engine, "lifecycle", None)
    return lifecycle is not None and lifecycle.pending > 0


def _context(slot: Slot | None) -> int | None:
    return slot.served.engine.model.context_length if slot is not None else None
