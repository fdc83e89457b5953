"""Several models served on demand: the request's `model` (and `adapters`) -> an engine.

One engine per (model folder, adapter). Only models the operator named can be selected
(any page can send a request here): which model a name selects is
server/served/names.py's ModelSelector.

At most `max_models` engines are resident. A model not resident is loaded on its own
thread (never on the event loop), after a memory check (server/served/loading.py, which
also says how a failed load never leaves the server without what it served). Making
room unloads the least recently used engine once it is drained: no lease (a handler
between its lookup and the end of its call) and no job pending in the engine
(server/served/lease.py). What /v1/models lists of them: server/served/cards.py.

Every engine draws on the default engine's PromptCache: one byte budget and
one eviction order across models (cache keys carry the model, so entries never mix),
and one DiskCache (one index, one disk budget).

Without a loader (library use, sharded serving) only the default model is served, as
before. With one, the pool owns the default engine too: it may unload and reload it,
and a model idle past its keep-alive is unloaded (server/served/idle.py decides when;
`unload` does it as a swap would). The settings file (models/settings_file.py) names
models too, gives them aliases, sampling defaults, a keep-alive or a pin.
State is touched only on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from mlx_prefix.config import FOREVER
from mlx_prefix.errors import InvalidRequest
from mlx_prefix.mlx_threads import on_loader_thread
from mlx_prefix.models.settings_file import NO_SETTINGS, ModelSettings, ModelsFile
from mlx_prefix.platform import available_memory

from .cards import ModelCard, model_cards
from .lease import Lease, busy
from .loading import (
    EngineLoader,
    EngineSwapper,
    Slot,
    memory_fit,
    weights_bytes,
)
from .names import ModelSelector, ModelSpec, ServedModel

if TYPE_CHECKING:
    from mlx_prefix.engine.interface import EngineAPI

DRAIN_POLL_S = 0.02


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
        settings: ModelsFile | None = None,
        keep_alive_s: float = 300.0,
        default_keep_alive_s: float = FOREVER,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`keep_alive_s`: how long a model loaded on demand stays once idle (FOREVER:
        until a swap needs its room); `default_keep_alive_s` the same for the default
        model. The settings file's keep_alive and pinned win over both; a request's
        keep_alive (`keep_alive`) over the file's keep_alive, never over a pin. `clock`:
        what a slot's last use is read from (seconds; the idle unloader reads the same
        one), a test's own instead of the process's monotonic clock, which asyncio's
        event loop reads too."""
        if max_models < 1:
            raise ValueError("max_models must be at least 1")
        self.clock = clock
        self.settings = settings or ModelsFile()
        self.keep_alive_s = keep_alive_s
        self.default_keep_alive_s = default_keep_alive_s
        default = ServedModel.of(engine, aliases)
        own = self._find_settings(default.spellings())
        default = replace(default, aliases=tuple(dict.fromkeys((*default.aliases, *own.aliases))))
        adapter = getattr(getattr(engine.model, "identity", None), "adapter", None)
        self.selector = ModelSelector(
            default,
            str(adapter) if adapter else None,
            strict=strict,
            model_aliases=model_aliases,
            allowed_models=allowed_models,
            settings=self.settings,
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
        first = Slot(
            self.default_spec, default, last_used=clock(), weights_bytes=weights_bytes(engine.model)
        )
        self._slots[self.default_spec.key] = first
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
            only = next(iter(self._slots.values()))
            return only.served, Lease(None)
        spec = self.spec_for(name, adapter)
        while True:
            slot = self._slots.get(spec.key)
            if slot is None:
                task = self._loading.get(spec.key)
                if task is None:
                    task = self._loading[spec.key] = asyncio.ensure_future(self._load(spec))
                    task.add_done_callback(lambda _: self._loading.pop(spec.key, None))
                slot = await asyncio.shield(task)
            if not slot.retiring:  # else it was chosen for unloading meanwhile: load again
                break
        self._slots.move_to_end(spec.key)
        slot.leases += 1
        slot.last_used = self.clock()
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

    def slots(self) -> list[Slot]:
        """The resident models' slots, least recently used first (read-only use)."""
        return list(self._slots.values())

    def settings_for(self, spec: ModelSpec) -> ModelSettings:
        """The settings file's table for `spec`'s model (NO_SETTINGS when it has none)."""
        if spec.default:
            return self._find_settings({spec.id, *self.names.default.spellings()})
        return self.settings.find(spec.id) or NO_SETTINGS

    def _find_settings(self, names: set[str]) -> ModelSettings:
        return next((found for n in sorted(names) if (found := self.settings.find(n))), NO_SETTINGS)

    def keep_alive_for(self, slot: Slot) -> float:
        """Seconds `slot` may stay idle before it is unloaded (FOREVER: it stays until a
        swap needs its room): a pin, else a request's keep_alive, else the settings
        file's, else the server's default for its kind (default or on demand)."""
        own = self.settings_for(slot.spec)
        if own.pinned or self.loader is None:  # without a loader nothing could reload it
            return FOREVER
        if slot.keep_alive_s is not None:
            return slot.keep_alive_s
        if own.keep_alive_s is not None:
            return own.keep_alive_s
        return self.default_keep_alive_s if slot.spec.default else self.keep_alive_s

    @property
    def can_unload(self) -> bool:
        """Whether a model may go when idle: only a pool that can load it back."""
        return self.loader is not None

    def keep_alive(
        self, name: str | None, seconds: float | None, adapter: str | None = None
    ) -> bool:
        """A request's keep_alive (Ollama's `keep_alive`): the model `name` selects stays
        `seconds` once idle from now on (0: unloaded as soon as it is idle; FOREVER:
        until a swap needs its room; None: the settings file's or the server's again, as
        an Ollama request without one resets it), until the next call or its unload. A
        pin still wins. Returns whether it is resident (a model not loaded has nothing
        to keep). ModelNotFound as `acquire`. Event loop only."""
        slot = self._slots.get(self.spec_for(name, adapter).key)
        if slot is None:
            return False
        slot.keep_alive_s = seconds
        slot.last_used = self.clock()
        return True

    def is_resident(self, name: str | None, adapter: str | None = None) -> bool:
        """Whether the model `name` selects is loaded (not loading, not unloading).
        ModelNotFound as `acquire`. Loads nothing."""
        return self.spec_for(name, adapter).key in self._slots

    def cards(self) -> list[ModelCard]:
        """/v1/models: the default (with its aliases), each --model-alias, then the
        other resident models; adapters under their base model's row."""
        return model_cards(
            self.default_spec, self.names.default.aliases, self.model_aliases, self.slots()
        )

    # -- loading and unloading ------------------------------------------------------
    async def _load(self, spec: ModelSpec) -> Slot:
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            if (slot := self._slots.get(spec.key)) is not None:
                return slot
            victims = self._victims()
            alongside = self._check_memory(spec, victims)
            for v in victims:  # no new lease from here on: a lookup loads it again
                v.retiring = True
                del self._slots[v.spec.key]
            for v in victims:
                while busy(v):
                    await asyncio.sleep(DRAIN_POLL_S)
            try:
                swap = self._swapper.swap  # type: ignore[union-attr]
                loaded = await asyncio.wrap_future(on_loader_thread(swap, victims, spec, alongside))
            except BaseException:
                await self._reinstate(victims)
                raise
            self.loads += 1
            aliases = self.names.default.aliases if spec == self.default_spec else ()
            served = ServedModel(spec.id, loaded.engine, aliases, str(spec.folder))
            slot = Slot(spec, served, last_used=self.clock(), weights_bytes=loaded.weights_bytes)
            self._slots[spec.key] = slot
            return slot

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
            reloaded = await asyncio.wrap_future(on_loader_thread(reload, gone))
            for slot in reversed(reloaded):
                slot.last_used = self.clock()
                self._slots[slot.spec.key] = slot
                self._slots.move_to_end(slot.spec.key, last=False)

    async def unload(self, key: tuple[str, str | None], reason: str) -> bool:
        """Unload the resident model of `key` if no request holds it or runs in it
        (`reason` goes to the log); returns whether it did. Its memory-tier entries go
        with it, its disk files stay, and the next request naming it loads it again."""
        if self._swapper is None:
            return False
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:  # never beside a swap
            slot = self._slots.get(key)
            if slot is None or busy(slot):
                return False
            slot.retiring = True  # no new lease from here on: a lookup loads it again
            del self._slots[key]
            unload = self._swapper.unload
            await asyncio.wrap_future(on_loader_thread(unload, slot, reason))
            return True

    def close(self, timeout: float = 10.0) -> None:
        """Shut every resident engine down (the server's shutdown)."""
        for slot in list(self._slots.values()):
            slot.served.engine.shutdown(timeout=timeout)
