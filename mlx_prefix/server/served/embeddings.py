"""The embedding model a server serves beside its chat model (--embedding-model), and
which `model` names select it.

Unlike the chat routes, /v1/embeddings answers only names of its own model (its id,
folder, folder name, --embedding-alias names, or "default"): vectors from two models
live in different spaces, so a client that indexed documents with one model must not
get another's vectors under the name it asked for (after a restart with another
--embedding-model, say). Any other name is a 404 (model_not_found); a name of the chat
model is a 400 saying which model embeds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_prefix.embeddings.worker import EmbeddingWorker
from mlx_prefix.errors import InvalidRequest, ModelNotFound

from .names import ModelNames, ModelRegistry


class NoEmbeddingModel(InvalidRequest):
    """/v1/embeddings on a server started without --embedding-model."""

    code = "embeddings_not_served"


@dataclass(frozen=True)
class ServedEmbeddings:
    worker: EmbeddingWorker
    names: ModelRegistry

    @classmethod
    def of(cls, worker: EmbeddingWorker, aliases: tuple[str, ...] = ()) -> ServedEmbeddings:
        model = worker.model
        names = ModelNames(model.name, tuple(dict.fromkeys(aliases)), str(model.path))
        return cls(worker, ModelRegistry([names], strict=True))

    @property
    def id(self) -> str:
        return self.names.default.id

    def select(self, name: str | None, chat_names: Any) -> None:
        """Check that `name` (None: not given) selects the embedding model. `chat_names`
        (the chat models' ModelRegistry) only words the refusal."""
        if name is None or self.names.find(name) is not None:
            return
        if chat_names.find(name) is not None:
            raise InvalidRequest(
                f"model '{name}' is a chat model; this server embeds with '{self.id}'",
                param="model",
            )
        raise ModelNotFound(
            f"The model '{name}' does not exist: this server embeds with '{self.id}' "
            f"(also named: {', '.join(sorted(self.names.default.spellings() - {self.id}))})",
            param="model",
        )


def require(served: ServedEmbeddings | None) -> ServedEmbeddings:
    if served is None:
        raise NoEmbeddingModel(
            "this server has no embedding model: start it with --embedding-model FOLDER "
            "(a decoder embedding model such as Qwen3-Embedding) to serve /v1/embeddings",
            param="model",
        )
    return served
