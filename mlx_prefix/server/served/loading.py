"""Loading and unloading the model pool's engines (server/served/pool.py decides which).

Everything here runs on the process's loader thread (mlx_threads.py), never on the
event loop, except `memory_fit`, the check made before anything is unloaded: a model's weight
files' size must fit the memory available plus what unloading frees. A failed load never
leaves the server without what it served: with room for both, the new model is loaded
before anything is unloaded; without, the folder is checked first
(models/preflight.check_loadable: config, weight file headers, tokenizer), and the pool
loads the unloaded models again (`reload`) should the load still fail. Unloading shuts
the engine down, drops its memory cache entries (its disk files stay, keyed by its
model) and its weights.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from mlx_prefix.errors import MlxPrefixError, ModelNotFound
from mlx_prefix.models.preflight import check_loadable, load_estimate

from .names import ModelSpec, ServedModel
from .unloaded import unloaded

if TYPE_CHECKING:
    from mlx_prefix.engine.interface import EngineAPI

log = logging.getLogger("mlx_prefix.server")

# (spec, shared PromptCache, shared DiskCache or None) -> a started Engine
EngineLoader = Callable[[ModelSpec, Any, Any], "EngineAPI"]


class InsufficientMemory(MlxPrefixError):
    status = 507
    type = "server_error"
    code = "insufficient_memory"


@dataclass(eq=False)
class Slot:
    """A model the pool holds: resident, or chosen for unloading."""

    spec: ModelSpec
    served: ServedModel
    leases: int = 0
    retiring: bool = False  # chosen for unloading: new lookups load it again
    unloaded: bool = False  # its engine was shut down and its weights dropped
    loaded_at: float = field(default_factory=time.time)  # unix time
    # time.monotonic() when it last served (a lease or a running job): idle since then
    last_used: float = field(default_factory=time.monotonic)
    # A request's keep_alive (`ModelPool.keep_alive`), until the next one or the unload;
    # None: the settings file's, else the server's default.
    keep_alive_s: float | None = None
    weights_bytes: int = 0  # what its parameters hold (read when loaded)


def memory_fit(spec: ModelSpec, victims: Sequence[Slot], free: int, max_models: int) -> bool:
    """InsufficientMemory when `spec` does not fit in `free` bytes even after unloading
    `victims`; else whether it fits alongside them (then it is loaded before they go)."""
    import mlx.core as mx

    cpu = mx.default_device() == mx.cpu
    need = load_estimate(spec.folder, spec.adapter, cpu)
    freed = sum(load_estimate(v.spec.folder, v.spec.adapter, cpu) for v in victims)
    if need > free + freed:
        raise InsufficientMemory(
            f"model '{spec.id}' needs about {need / 2**30:.1f} GiB for its weights; "
            f"{(free + freed) / 2**30:.1f} GiB are available (with --max-models "
            f"{max_models} resident at most)",
            param="model",
        )
    return need <= free


@dataclass(frozen=True)
class Loaded:
    """A swap's result: the started engine and what its weights hold."""

    engine: EngineAPI
    weights_bytes: int


class EngineSwapper:
    """Loads engines with the operator's loader, every one sharing the default engine's
    PromptCache and DiskCache, and unloads them. Call on a loader thread."""

    def __init__(self, loader: EngineLoader, store: Any, disk_cache: Any, last: EngineAPI):
        self.loader = loader
        self._store = store
        self._disk_cache = disk_cache
        self.last = last  # the engine unloaded last (the views show it when none is left)
        self.unloads = 0

    def swap(self, victims: list[Slot], spec: ModelSpec, alongside: bool) -> Loaded:
        """Load `spec` and unload `victims` (drained). With room for both (`alongside`),
        the load comes first; else the folder is checked, then the victims go. Either
        way a malformed folder fails before anything is unloaded."""
        if alongside:
            engine = self._load(spec)
            for v in victims:
                self.unload(v)
            return Loaded(engine, weights_bytes(engine.model))
        if victims:
            try:
                check_loadable(spec.folder, spec.adapter)
            except ModelNotFound as e:
                log.warning("model %s not loaded: %s", spec.id, e)
                raise ModelNotFound(
                    f"model '{spec.id}' could not be loaded: {e}", param=e.param
                ) from None
        for v in victims:
            self.unload(v)
        engine = self._load(spec)
        return Loaded(engine, weights_bytes(engine.model))

    def reload(self, slots: list[Slot]) -> list[Slot]:
        """Load the models of `slots` again (the ones that fail are logged and left out:
        a later request loads them)."""
        back = []
        for old in slots:
            try:
                engine = self.loader(old.spec, self._store, self._disk_cache)
            except Exception:  # noqa: BLE001 - logged; the request gets the first error
                log.exception("model %s could not be loaded again", old.spec.id)
                continue
            log.info("model %s loaded again after a failed load", old.spec.id)
            served = replace(old.served, engine=engine)
            back.append(Slot(old.spec, served, weights_bytes=weights_bytes(engine.model)))
        return back

    def _load(self, spec: ModelSpec) -> EngineAPI:
        log.info(
            "loading model %s%s", spec.id, f" with adapter {spec.adapter}" if spec.adapter else ""
        )
        try:
            return self.loader(spec, self._store, self._disk_cache)
        except MlxPrefixError:
            raise
        except Exception as e:  # noqa: BLE001 - any library error: one line for the client
            log.exception("model %s could not be loaded", spec.id)
            raise MlxPrefixError(
                f"model '{spec.id}' could not be loaded: {type(e).__name__}: {e}"
            ) from e

    def unload(self, slot: Slot, reason: str = "least recently used") -> None:
        """Shut the engine down, drop its memory-tier entries (its disk files stay: a
        reload finds them) and its weights (and its draft's), and give the memory back
        to the system (platform.release_memory)."""
        from mlx_prefix.platform import release_memory

        engine = slot.served.engine
        log.info("unloading model %s (%s)", slot.spec.id, reason)
        started = time.monotonic()
        engine.shutdown(timeout=10.0)
        if self._store is not None:
            self._store.clear(engine.model_key)
        release = getattr(engine, "release", None)  # a test's fake has none
        if release is not None:
            release()
        drop_weights(engine.model)
        draft = getattr(engine, "draft", None)
        if draft is not None:
            drop_weights(draft)
        # The views keep a stand-in, not the engine: kept, it held a whole engine (a
        # vision model's tower and feature cache) after every unload of the last model.
        self.last = unloaded(engine)
        slot.served = replace(slot.served, engine=self.last)
        del engine, draft, release
        # What the weights held is free now, but on Linux glibc keeps it in the arena
        # of the thread that loaded it: without the trim, each swap and back kept ~500
        # MiB resident (RSS 171 -> 702 -> 1222 -> 1700 MiB over three swaps). The
        # engine's own objects must be gone first (cycles included) for theirs to be.
        gc.collect()
        release_memory()
        slot.unloaded = True
        self.unloads += 1
        log.info("model %s unloaded in %.1f s", slot.spec.id, time.monotonic() - started)


def drop_weights(model: Any) -> None:
    """Drop a LoadedModel's weights in place (arrays.drop_parameters) and its
    vision part's (the tower, the images it prepared): every holder of the module (an
    engine's phases, a request still finishing) lets go of them at once."""
    from mlx_prefix.arrays import drop_parameters

    vision = getattr(model, "vision", None)
    if vision is not None:
        vision.close()
    module = getattr(model, "model", None)
    if module is None or not hasattr(module, "parameters"):
        return  # a test's fake
    drop_parameters(module)


def weights_bytes(model: Any) -> int:
    """Bytes a LoadedModel's parameters hold (array sizes: no data is read); 0 for a
    test's fake."""
    from mlx_prefix.arrays import named_arrays

    module = getattr(model, "model", None)
    if module is None or not hasattr(module, "parameters"):
        return 0
    return sum(p.nbytes for _, p in named_arrays(module.parameters()))
