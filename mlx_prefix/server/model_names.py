"""Which served model answers a request: the `model` name -> a ServedModel.

A name selects a model when it is the model's served id, its folder (the path as given
or its last component), one of its `--alias` names, or "default" (the default model).
A name that matches nothing is answered by the default model, as llama.cpp does:
clients send names of their own (`gpt-4o-mini` from the openai examples, Claude Code's
`claude-...` ids), and a user should not have to learn the folder name first. The
reply's `model` field then names the model that answered. With `strict` such a name
is a 404 instead. Nothing here ever downloads a model: only served models are chosen.

Other models (--model-alias, --allowed-models: only what the operator named) are found
and loaded by server/model_pool.py, which asks this registry first and keeps the rule
above for names that select nothing (a path-shaped name is a 404 there). Pure: no I/O,
no MLX.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from mlx_prefix.errors import ModelNotFound

DEFAULT_NAME = "default"


@dataclass(frozen=True)
class ServedModel:
    id: str  # the served name, reported in every reply's `model` field
    engine: Any  # mlx_prefix.engine.Engine, or a fake with its interface
    aliases: tuple[str, ...] = ()  # --alias names, listed by /v1/models
    folder: str | None = None  # the model's folder, as loaded

    @classmethod
    def of(cls, engine: Any, aliases: Sequence[str] = ()) -> ServedModel:
        model = engine.model
        path = getattr(model, "path", None)
        return cls(model.name, engine, tuple(dict.fromkeys(aliases)), str(path) if path else None)

    def spellings(self) -> set[str]:
        """Every name that selects this model (besides "default" for the default one)."""
        names = {self.id, *self.aliases}
        if self.folder:
            names |= {self.folder.rstrip("/"), self.folder.rstrip("/").rsplit("/", 1)[-1]}
        return names


class ModelRegistry:
    """The served models; the first is the default. Immutable after construction."""

    def __init__(self, models: Sequence[ServedModel], *, strict: bool = False):
        if not models:
            raise ValueError("at least one served model is needed")
        self.models = tuple(models)
        self.strict = strict
        self._by_name: dict[str, ServedModel] = {}
        for served in self.models:
            for name in served.spellings():
                other = self._by_name.setdefault(name, served)
                if other is not served and name in (served.id, *served.aliases):
                    raise ValueError(f"the model name {name!r} is used by two served models")

    @property
    def default(self) -> ServedModel:
        return self.models[0]

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self.models)

    def find(self, name: str) -> ServedModel | None:
        """The model this exact name selects; None if it selects none."""
        if name == DEFAULT_NAME:
            return self.default
        return self._by_name.get(name) or self._by_name.get(name.rstrip("/"))

    def resolve(self, requested: str | None) -> ServedModel:
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
