"""Several models served on demand: the request's `model` (and `adapters`) -> an engine.

One engine per (model folder, adapter). A name selects, in this order: the default
model (its id, folder, --alias names, or "default"), a `--model-alias NAME=PATH`, a
local folder, a Hugging Face repo id already in the local hub cache (never downloaded).
A path that does not exist is a 404; any other name is answered by the default model
(server/model_names.py: clients send names of their own), or is a 404 with
--strict-model-names.

At most `max_models` engines are resident. A model not resident is loaded on its own
thread (never on the event loop), after a memory check: its weight files' size must
fit the memory available plus what unloading makes free. Making room unloads the least
recently used engine once it is drained: no lease (a handler between its lookup and the
end of its call) and no job pending in the engine. Unloading shuts the engine down,
drops its memory cache entries (its disk files stay, keyed by its model) and its
weights. Every engine draws on the default engine's PromptCache: one byte budget and
one eviction order across models (cache keys carry the model, so entries never mix),
and one DiskCache (one index, one disk budget).

Without a loader (library use, sharded serving) only the default model is served, as
before. With one, the pool owns the default engine too: it may unload and reload it.
State is touched only on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mlx_prefix.errors import InvalidRequest, MlxPrefixError, ModelNotFound
from mlx_prefix.models.catalog import adapter_folder, find_local_model, load_estimate
from mlx_prefix.platform import available_memory

from .model_names import ModelRegistry, ServedModel

log = logging.getLogger("mlx_prefix.server")

DRAIN_POLL_S = 0.02


class InsufficientMemory(MlxPrefixError):
    status = 507
    type = "server_error"
    code = "insufficient_memory"


@dataclass(frozen=True)
class ModelSpec:
    """What to load: a model folder and optionally a LoRA adapter folder."""

    folder: Path
    adapter: Path | None
    id: str  # the served id: reported in replies' `model` field
    default: bool = False  # the server's own model: its --chat-template applies

    @property
    def key(self) -> tuple[str, str | None]:
        return str(self.folder), str(self.adapter) if self.adapter else None


# (spec, shared PromptCache, shared DiskCache or None) -> a started Engine
EngineLoader = Callable[[ModelSpec, Any, Any], Any]


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
class _Slot:
    spec: ModelSpec
    served: ServedModel
    leases: int = 0
    retiring: bool = False  # chosen for unloading: new lookups load it again


@dataclass(eq=False)
class Lease:
    """Keeps a slot resident from its lookup until the handler is done (then the
    engine's own pending count covers what still streams)."""

    slot: _Slot | None
    released: bool = False

    def release(self) -> None:
        if not self.released and self.slot is not None:
            self.released = True
            self.slot.leases -= 1


class ModelPool:
    def __init__(
        self,
        engine: Any,
        aliases: tuple[str, ...] = (),
        *,
        strict: bool = False,
        loader: EngineLoader | None = None,
        max_models: int = 1,
        model_aliases: Mapping[str, str] | None = None,
        memory: Callable[[], int | None] | None = None,
    ):
        if max_models < 1:
            raise ValueError("max_models must be at least 1")
        default = ServedModel.of(engine, aliases)
        # Names only: the registry must not keep the default engine alive once unloaded.
        self.names = ModelRegistry([replace(default, engine=None)], strict=strict)
        self.loader = loader
        self.max_models = max_models
        self.model_aliases = dict(model_aliases or {})
        self._memory = memory  # None: platform.available_memory
        identity = getattr(engine.model, "identity", None)
        adapter = getattr(identity, "adapter", None)
        self.default_spec = ModelSpec(
            Path(default.folder or default.id), Path(adapter) if adapter else None, default.id, True
        )
        self._store = getattr(engine, "store", None)
        disk = getattr(engine, "disk", None)
        self._disk_cache = disk.cache if disk is not None else None
        self._slots: OrderedDict[tuple[str, str | None], _Slot] = OrderedDict()
        self._slots[self.default_spec.key] = _Slot(self.default_spec, default)
        self._loading: dict[tuple[str, str | None], asyncio.Future[_Slot]] = {}
        self._lock: asyncio.Lock | None = None  # made on the event loop
        self._last: Any = engine  # the views' engine when none is resident
        self.loads = 0  # models loaded on demand (observability, tests)
        self.unloads = 0

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
        spec = self._base_spec(name)
        if adapter is not None:
            spec = replace(spec, adapter=adapter_folder(adapter))
        return spec

    def _base_spec(self, name: str | None) -> ModelSpec:
        if name is None or self.names.find(name) is not None:
            return self.default_spec
        if name in self.model_aliases:
            target = self.model_aliases[name]
            found = find_local_model(target)
            if found is None:
                raise ModelNotFound(
                    f"model '{name}' (--model-alias {name}={target}) not found: not a local "
                    "folder nor a model in the local Hugging Face cache",
                    param="model",
                )
            return ModelSpec(found.path, None, name, found.path == self.default_spec.folder)
        for slot in self._slots.values():  # what the lookups below would find again
            if slot.spec.adapter is None and name == slot.spec.id:
                return slot.spec
        found = find_local_model(name)
        if found is not None:
            if found.path == self.default_spec.folder and self.default_spec.adapter is None:
                return self.default_spec
            return ModelSpec(found.path, None, name.rstrip("/"))
        self.names.resolve(name)  # a 404 when strict
        return self.default_spec

    # -- views ----------------------------------------------------------------------
    def primary(self) -> Any:
        """The engine the cache routes, dashboard, /metrics and /health show: the
        default model's when resident, else the most recently used one."""
        slot = self._slots.get(self.default_spec.key)
        if slot is None and self._slots:
            slot = next(reversed(self._slots.values()))
        return slot.served.engine if slot is not None else self._last

    def resident(self) -> list[ServedModel]:
        return [s.served for s in self._slots.values()]

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
    async def _load(self, spec: ModelSpec) -> _Slot:
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            if (slot := self._slots.get(spec.key)) is not None:
                return slot
            victims = self._victims()
            self._check_memory(spec, victims)
            for v in victims:  # no new lease from here on: a lookup loads it again
                v.retiring = True
                del self._slots[v.spec.key]
            for v in victims:
                while v.leases or _busy(v.served.engine):
                    await asyncio.sleep(DRAIN_POLL_S)
            engine = await asyncio.wrap_future(_on_own_thread(self._swap, victims, spec))
            self.loads += 1
            aliases = self.names.default.aliases if spec == self.default_spec else ()
            served = ServedModel(spec.id, engine, aliases, str(spec.folder))
            slot = self._slots[spec.key] = _Slot(spec, served)
            return slot

    def _victims(self) -> list[_Slot]:
        """The least recently used slots to unload so that one more fits."""
        excess = len(self._slots) + 1 - self.max_models
        return list(self._slots.values())[: max(excess, 0)]

    def _check_memory(self, spec: ModelSpec, victims: list[_Slot]) -> None:
        free = (self._memory or available_memory)()
        if free is None:
            return
        import mlx.core as mx

        cpu = mx.default_device() == mx.cpu
        need = load_estimate(spec.folder, spec.adapter, cpu)
        freed = sum(load_estimate(v.spec.folder, v.spec.adapter, cpu) for v in victims)
        if need > free + freed:
            raise InsufficientMemory(
                f"model '{spec.id}' needs about {need / 2**30:.1f} GiB for its weights; "
                f"{(free + freed) / 2**30:.1f} GiB are available (with --max-models "
                f"{self.max_models} resident at most)",
                param="model",
            )

    def _swap(self, victims: list[_Slot], spec: ModelSpec) -> Any:
        """On a loader thread: unload `victims` (drained), then load `spec`."""
        for v in victims:
            self._unload(v)
        log.info(
            "loading model %s%s", spec.id, f" with adapter {spec.adapter}" if spec.adapter else ""
        )
        try:
            return self.loader(spec, self._store, self._disk_cache)  # type: ignore[misc]
        except MlxPrefixError:
            raise
        except Exception as e:  # noqa: BLE001 - any library error: one line for the client
            log.exception("model %s could not be loaded", spec.id)
            raise MlxPrefixError(
                f"model '{spec.id}' could not be loaded: {type(e).__name__}: {e}"
            ) from e

    def _unload(self, slot: _Slot) -> None:
        import mlx.core as mx
        from mlx.utils import tree_map

        engine = slot.served.engine
        log.info("unloading model %s (least recently used)", slot.spec.id)
        engine.shutdown(timeout=10.0)
        if self._store is not None:
            self._store.clear(engine.model_key)  # its disk files stay: a reload finds them
        # Replace the weights in place: every holder of the module (the engine's phases)
        # lets go of them at once, though the engine object may still be referenced
        # (the views keep the last one).
        empty = mx.zeros((0,))
        mx.eval(empty)
        engine.model.model.update(tree_map(lambda _: empty, engine.model.model.parameters()))
        mx.clear_cache()
        self._last = engine
        self.unloads += 1

    def close(self, timeout: float = 10.0) -> None:
        """Shut every resident engine down (the server's shutdown)."""
        for slot in list(self._slots.values()):
            slot.served.engine.shutdown(timeout=timeout)


def _busy(engine: Any) -> bool:
    lifecycle = getattr(engine, "lifecycle", None)
    return lifecycle is not None and lifecycle.pending > 0


def _context(slot: _Slot | None) -> int | None:
    return slot.served.engine.model.context_length if slot is not None else None


def _on_own_thread(fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """Run `fn` on a fresh thread that destroys its MLX streams when done (MLX streams
    are thread-local: see Engine._loop)."""
    future: Future[Any] = Future()

    def run() -> None:
        import mlx.core as mx

        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting request
            future.set_exception(e)
        finally:
            mx.clear_streams()

    threading.Thread(target=run, name="mlx-prefix-load", daemon=True).start()
    return future
