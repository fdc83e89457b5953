"""Several models served on demand: the request's `model` (and `adapters`) -> an engine.

One engine per (model folder, adapter). Only models the operator named can be selected
(any page can send a request here): a name selects, in this order, the default model
(its id, folder, --alias names, or "default"), a `--model-alias NAME=PATH`, or an entry
of `--allowed-models` (a folder or a Hugging Face repo id already in the local hub
cache, never downloaded; named as given or, for a folder, by its last component). An
`adapters` folder must be the default model's --adapter or an --allowed-models entry.
Any other name is answered by the default model (server/model_names.py: clients send
names of their own), or is a 404 with --strict-model-names; a name shaped like a path
is always a 404. The 404 says the same for every name that is not allowed, whatever
exists on disk under it: the file system is never consulted for a request's own name.

At most `max_models` engines are resident. A model not resident is loaded on its own
thread (never on the event loop), after a memory check: its weight files' size must
fit the memory available plus what unloading makes free. Making room unloads the least
recently used engine once it is drained: no lease (a handler between its lookup and the
end of its call) and no job pending in the engine. Unloading shuts the engine down,
drops its memory cache entries (its disk files stay, keyed by its model) and its
weights. A failed load never leaves the server without what it served: when memory
holds both, the new model is loaded before anything is unloaded; when it does not, the
folder is checked first (models/catalog.check_loadable: config, weight file headers,
tokenizer) and, should the load still fail, the unloaded models are loaded again.

Every engine draws on the default engine's PromptCache: one byte budget and
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
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mlx_prefix.errors import InvalidRequest, MlxPrefixError, ModelNotFound
from mlx_prefix.models.catalog import (
    adapter_folder,
    check_loadable,
    find_local_model,
    load_estimate,
)
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
    unloaded: bool = False  # its engine was shut down and its weights dropped


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
        allowed_models: Sequence[str] = (),
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
        self.allowed = AllowList(allowed_models)
        self._memory = memory  # None: platform.available_memory
        identity = getattr(engine.model, "identity", None)
        adapter = getattr(identity, "adapter", None)
        self.default_spec = ModelSpec(
            Path(default.folder or default.id), Path(adapter) if adapter else None, default.id, True
        )
        self._default_adapter = str(adapter) if adapter else None
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
            entry = self.allowed.find(adapter)
            if entry is None and adapter.rstrip("/") == (self._default_adapter or "").rstrip("/"):
                entry = self._default_adapter
            if entry is None:
                raise ModelNotFound(
                    f"adapter '{adapter}' is not served here: a request may name the "
                    "server's --adapter or one listed in --allowed-models",
                    param="adapters",
                )
            spec = replace(spec, adapter=adapter_folder(entry))
        return spec

    def _base_spec(self, name: str | None) -> ModelSpec:
        if name is None or self.names.find(name) is not None:
            return self.default_spec
        if name in self.model_aliases:
            return self._operators(name, self.model_aliases[name], f"--model-alias {name}=")
        entry = self.allowed.find(name)
        if entry is not None:
            return self._operators(entry, entry, "--allowed-models ")
        if is_path(name):  # meant as a model folder: never answered by another model
            raise self._not_served(name)
        if self.names.strict:
            raise self._not_served(name)
        return self.default_spec

    def _operators(self, served_id: str, target: str, flag: str) -> ModelSpec:
        """The spec of a model the operator named (`flag` + `target`); only these names
        are looked up on disk or in the hub cache, so the error may say why."""
        for slot in self._slots.values():  # resident: no need to look again
            if slot.spec.adapter is None and slot.spec.id == served_id:
                return slot.spec
        try:
            found = find_local_model(target)
        except ModelNotFound:
            found = None
        if found is None:
            raise ModelNotFound(
                f"model '{served_id}' ({flag}{target}) not found: not a model folder nor a "
                "model in the local Hugging Face cache",
                param="model",
            )
        if found.path == self.default_spec.folder and self.default_spec.adapter is None:
            return self.default_spec
        return ModelSpec(found.path, None, served_id)

    def _not_served(self, name: str) -> ModelNotFound:
        served = sorted({self.default_spec.id, *self.names.default.aliases, *self.model_aliases})
        return ModelNotFound(
            f"The model {name!r} is not served here. Served models: {', '.join(served)}; "
            "an operator can allow others with --model-alias or --allowed-models",
            param="model",
        )

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
            alongside = self._check_memory(spec, victims)
            for v in victims:  # no new lease from here on: a lookup loads it again
                v.retiring = True
                del self._slots[v.spec.key]
            for v in victims:
                while v.leases or _busy(v.served.engine):
                    await asyncio.sleep(DRAIN_POLL_S)
            try:
                engine = await asyncio.wrap_future(
                    _on_own_thread(self._swap, victims, spec, alongside)
                )
            except BaseException:
                await self._reinstate(victims)
                raise
            self.loads += 1
            aliases = self.names.default.aliases if spec == self.default_spec else ()
            served = ServedModel(spec.id, engine, aliases, str(spec.folder))
            slot = self._slots[spec.key] = _Slot(spec, served)
            return slot

    def _victims(self) -> list[_Slot]:
        """The least recently used slots to unload so that one more fits."""
        excess = len(self._slots) + 1 - self.max_models
        return list(self._slots.values())[: max(excess, 0)]

    async def _reinstate(self, victims: list[_Slot]) -> None:
        """After a failed load: the models it was to replace serve again, those still
        loaded at once, those already unloaded loaded anew (on a loader thread)."""
        for v in reversed(victims):
            if not v.unloaded:
                v.retiring = False
                self._slots[v.spec.key] = v
                self._slots.move_to_end(v.spec.key, last=False)  # still the least recent
        gone = [v for v in victims if v.unloaded]
        if gone:
            reloaded = await asyncio.wrap_future(_on_own_thread(self._reload, gone))
            for slot in reversed(reloaded):
                self._slots[slot.spec.key] = slot
                self._slots.move_to_end(slot.spec.key, last=False)

    def _reload(self, slots: list[_Slot]) -> list[_Slot]:
        """On a loader thread: load the models of `slots` again (the ones that fail are
        logged and left out: a later request loads them)."""
        back = []
        for old in slots:
            try:
                engine = self.loader(old.spec, self._store, self._disk_cache)  # type: ignore[misc]
            except Exception:  # noqa: BLE001 - logged; the request gets the first error
                log.exception("model %s could not be loaded again", old.spec.id)
                continue
            log.info("model %s loaded again after a failed load", old.spec.id)
            back.append(_Slot(old.spec, replace(old.served, engine=engine)))
        return back

    def _check_memory(self, spec: ModelSpec, victims: list[_Slot]) -> bool:
        """InsufficientMemory when `spec` does not fit even after unloading `victims`;
        else whether it fits alongside them (then it is loaded before they go)."""
        free = (self._memory or available_memory)()
        if free is None:
            return not victims
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
        return need <= free

    def _swap(self, victims: list[_Slot], spec: ModelSpec, alongside: bool) -> Any:
        """On a loader thread: load `spec` and unload `victims` (drained). With room for
        both (`alongside`), the load comes first; else the folder is checked, then the
        victims go. Either way a malformed folder fails before anything is unloaded."""
        if alongside:
            engine = self._load_engine(spec)
            for v in victims:
                self._unload(v)
            return engine
        if victims:
            try:
                check_loadable(spec.folder, spec.adapter)
            except ModelNotFound as e:
                log.warning("model %s not loaded: %s", spec.id, e)
                raise ModelNotFound(
                    f"model '{spec.id}' could not be loaded: {e}", param=e.param
                ) from None
        for v in victims:
            self._unload(v)
        return self._load_engine(spec)

    def _load_engine(self, spec: ModelSpec) -> Any:
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
        slot.unloaded = True
        self.unloads += 1

    def close(self, timeout: float = 10.0) -> None:
        """Shut every resident engine down (the server's shutdown)."""
        for slot in list(self._slots.values()):
            slot.served.engine.shutdown(timeout=timeout)


class AllowList:
    """--allowed-models: the folders and hub ids a request may name beyond the served
    model and the --model-alias names. A request's name matches an entry as given
    (trailing slashes aside) or, for a folder, by its last component. Pure: nothing is
    looked up on disk here."""

    def __init__(self, entries: Sequence[str]):
        self.models = tuple(dict.fromkeys(e.rstrip("/") or e for e in entries))
        self._by_name: dict[str, str] = {}
        for entry in self.models:
            self._by_name[entry] = entry
            if is_path(entry):
                self._by_name.setdefault(entry.rsplit("/", 1)[-1], entry)

    def find(self, name: str) -> str | None:
        """The entry `name` selects; None if none."""
        return self._by_name.get(name.rstrip("/") or name)


_PATH_PREFIXES = ("/", ".", "~")  # absolute, ./ ../ (and dot names), home


def is_path(name: str) -> bool:
    """Whether a model name is shaped like a file system path (not a served name nor a
    hub id `org/repo`)."""
    return name.startswith(_PATH_PREFIXES) or "\\" in name or name.count("/") > 1


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
