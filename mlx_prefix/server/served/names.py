"""Which served model answers a request: the `model` name -> a ServedModel.

A name selects a model when it is the model's served id, its folder (the path as given
or its last component), one of its `--alias` names, or "default" (the default model).
A name that matches nothing is answered by the default model, as llama.cpp does:
clients send names of their own (`gpt-4o-mini` from the openai examples, Claude Code's
`claude-...` ids), and a user should not have to learn the folder name first. The
reply's `model` field then names the model that answered. With `strict` such a name
is a 404 instead. Nothing here ever downloads a model: only served models are chosen.

A server that loads models on demand (server/served/pool.py) lets a name select, after
the served model, only what the operator named: a `--model-alias NAME=PATH`, or an
entry of `--allowed-models` (a folder or a Hugging Face repo id already in the local hub
cache, never downloaded; named as given or, for a folder, by its last component).
`ModelSelector` turns such a name (and `adapters`) into a ModelSpec, what to load; an
`adapters` folder must be the default model's --adapter or an --allowed-models entry.
A table of the settings file (models/settings_file.py) is named by the operator too:
its name and its aliases select it, served under its name. A name that selects
nothing keeps the rule above, except that a name shaped like a path is always a 404.
The 404 says the same for every name that is not allowed,
whatever exists on disk under it: the file system is consulted only for the
operator's names (models/resolve.py: which folder a name means). No MLX.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from mlx_prefix.errors import ModelNotFound
from mlx_prefix.models.resolve import adapter_folder, find_local_model, is_path
from mlx_prefix.models.settings_file import ModelsFile

if TYPE_CHECKING:
    from mlx_prefix.engine.interface import EngineAPI

DEFAULT_NAME = "default"


@dataclass(frozen=True)
class ModelNames:
    """The names of a served model, without the model: what ModelRegistry keeps."""

    id: str  # the served name, reported in every reply's `model` field
    aliases: tuple[str, ...] = ()  # --alias names, listed by /v1/models
    folder: str | None = None  # the model's folder, as loaded

    def spellings(self) -> set[str]:
        """Every name that selects this model (besides "default" for the default one)."""
        names = {self.id, *self.aliases}
        if self.folder:
            names |= {self.folder.rstrip("/"), self.folder.rstrip("/").rsplit("/", 1)[-1]}
        return names


@dataclass(frozen=True)
class ServedModel:
    id: str  # the served name, reported in every reply's `model` field
    engine: EngineAPI  # an Engine, a DistributedEngine, or a test's fake of the interface
    aliases: tuple[str, ...] = ()  # --alias names, listed by /v1/models
    folder: str | None = None  # the model's folder, as loaded

    @classmethod
    def of(cls, engine: EngineAPI, aliases: Sequence[str] = ()) -> ServedModel:
        model = engine.model
        path = getattr(model, "path", None)
        return cls(model.name, engine, tuple(dict.fromkeys(aliases)), str(path) if path else None)

    @property
    def names(self) -> ModelNames:
        return ModelNames(self.id, self.aliases, self.folder)

    def spellings(self) -> set[str]:
        return self.names.spellings()


class ModelRegistry:
    """The served models' names; the first is the default. Immutable after construction.
    Names only: it must not keep an engine alive once its model is unloaded."""

    def __init__(self, models: Sequence[ModelNames], *, strict: bool = False):
        if not models:
            raise ValueError("at least one served model is needed")
        self.models = tuple(models)
        self.strict = strict
        self._by_name: dict[str, ModelNames] = {}
        for served in self.models:
            for name in served.spellings():
                other = self._by_name.setdefault(name, served)
                if other is not served and name in (served.id, *served.aliases):
                    raise ValueError(f"the model name {name!r} is used by two served models")

    @property
    def default(self) -> ModelNames:
        return self.models[0]

    def __iter__(self) -> Iterator[ModelNames]:
        return iter(self.models)

    def find(self, name: str) -> ModelNames | None:
        """The model this exact name selects; None if it selects none."""
        if name == DEFAULT_NAME:
            return self.default
        return self._by_name.get(name) or self._by_name.get(name.rstrip("/"))

    def resolve(self, requested: str | None) -> ModelNames:
        """The model that answers a request naming `requested` (None: not named).
        ModelNotFound only when strict and the name selects no served model."""
        if requested is None:
            return self.default
        found = self.find(requested)
        if found is not None:
            return found
        if not self.strict:
            return self.default
        names = ", ".join(sorted({n for m in self.models for n in (m.id, *m.aliases)}))
        raise ModelNotFound(
            f"The model {requested!r} does not exist. Served models: {names} (also accepted: "
            "their folders and 'default'; the server runs with --strict-model-names)",
            param="model",
        )


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


class ModelSelector:
    """A request's `model` (and `adapters`) -> the ModelSpec to serve it, among the
    default model and what the operator named (the module docstring's rules)."""

    def __init__(
        self,
        default: ServedModel,
        default_adapter: str | None = None,
        *,
        strict: bool = False,
        model_aliases: Mapping[str, str] | None = None,
        allowed_models: Sequence[str] = (),
        settings: ModelsFile | None = None,
    ):
        self.registry = ModelRegistry([default.names], strict=strict)
        self.model_aliases = dict(model_aliases or {})
        self.settings = settings or ModelsFile()
        self.allowed = AllowList(allowed_models)
        self.default_adapter = default_adapter
        adapter = Path(default_adapter) if default_adapter else None
        self.default_spec = ModelSpec(Path(default.folder or default.id), adapter, default.id, True)

    def spec_for(
        self, name: str | None, adapter: str | None = None, resident: Iterable[ModelSpec] = ()
    ) -> ModelSpec:
        """What `name` (with `adapter`) selects; `resident` specs need no new lookup.
        ModelNotFound (404) for a name or adapter not served here."""
        spec = self._base_spec(name, resident)
        if adapter is not None:
            entry = self.allowed.find(adapter)
            if entry is None and adapter.rstrip("/") == (self.default_adapter or "").rstrip("/"):
                entry = self.default_adapter
            if entry is None:
                raise ModelNotFound(
                    f"adapter '{adapter}' is not served here: a request may name the "
                    "server's --adapter or one listed in --allowed-models",
                    param="adapters",
                )
            spec = replace(spec, adapter=adapter_folder(entry))
        return spec

    def named(self, name: str) -> bool:
        """Whether `name` is one of the served names (not a fallback to the default)."""
        return (
            self.registry.find(name) is not None
            or name in self.model_aliases
            or self.settings.find(name) is not None
            or self.allowed.find(name) is not None
        )

    def _base_spec(self, name: str | None, resident: Iterable[ModelSpec]) -> ModelSpec:
        if name is None or self.registry.find(name) is not None:
            return self.default_spec
        if name in self.model_aliases:
            target = self.model_aliases[name]
            return self._operators(name, target, f"--model-alias {name}=", resident)
        if (table := self.settings.find(name)) is not None:  # served under its table's name
            if self.registry.find(table.name) is not None:
                return self.default_spec
            where = f"{self.settings.path or 'the settings file'}: "
            return self._operators(table.name, table.name, where, resident)
        entry = self.allowed.find(name)
        if entry is not None:
            return self._operators(entry, entry, "--allowed-models ", resident)
        if is_path(name):  # meant as a model folder: never answered by another model
            raise self._not_served(name)
        if self.registry.strict:
            raise self._not_served(name)
        return self.default_spec

    def _operators(
        self, served_id: str, target: str, flag: str, resident: Iterable[ModelSpec]
    ) -> ModelSpec:
        """The spec of a model the operator named (`flag` + `target`); only these names
        are looked up on disk or in the hub cache, so the error may say why."""
        for spec in resident:  # resident: no need to look again
            if spec.adapter is None and spec.id == served_id:
                return spec
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
        served = sorted({self.default_spec.id, *self.registry.default.aliases, *self.model_aliases})
        return ModelNotFound(
            f"The model {name!r} is not served here. Served models: {', '.join(served)}; "
            "an operator can allow others with --model-alias or --allowed-models",
            param="model",
        )
