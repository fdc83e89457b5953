"""What every handler shares: the app's state (with the served models), the model
lookup, the error wrapper and the JSON body reader."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from mlx_prefix.errors import MlxPrefixError

from ..dashboard import TreeShapes
from ..errors import PayloadTooLarge, UnsupportedMediaType, error_response_for
from ..generation import InFlight
from ..keep_alive import KeepAlives
from ..metrics import ServerMetrics
from ..model_names import ServedModel
from ..model_pool import ModelPool
from ..protocol.fields import parse_json_object
from ..protocol.request import Limits
from ..response_store import ResponseStore
from ..served_embeddings import ServedEmbeddings
from ..settings import ServerSettings

if TYPE_CHECKING:
    from mlx_prefix.engine.interface import EngineAPI

log = logging.getLogger("mlx_prefix.server")


@dataclass(frozen=True)
class ServerState:
    models: ModelPool  # which served model answers a request's `model` name
    settings: ServerSettings
    metrics: ServerMetrics
    limits: Limits
    inflight: InFlight
    started: int  # unix time, reported as the model's `created`
    responses: ResponseStore  # past /v1/responses answers, for previous_response_id
    tree_shapes: TreeShapes = field(default_factory=TreeShapes)  # the dashboard's, between polls
    embeddings: ServedEmbeddings | None = None  # --embedding-model, for /v1/embeddings
    keep_alives: KeepAlives = field(init=False)  # Ollama's keep_alive on `models`

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep_alives", KeepAlives(self.models))

    def limits_for(self, engine: EngineAPI) -> Limits:
        """The request limits of the model `engine` serves: its own context length."""
        cap = self.settings.max_tokens_limit
        return replace(self.limits, max_tokens=min(cap, engine.model.context_length or cap))

    @property
    def engine(self) -> EngineAPI:
        """The engine the cache routes, dashboard and /metrics show (ModelPool.primary):
        an mlx_prefix.engine.Engine, or a fake with its interface."""
        return self.models.primary()


def state(request: Request) -> ServerState:
    return request.app.state.server


async def model_for(request: Request, name: str | None, adapter: str | None = None) -> ServedModel:
    """The served model answering `name` (with the LoRA `adapter`), loaded if need be;
    it stays resident at least until the handler returns (`api` releases the lease)."""
    served, lease = await state(request).models.acquire(name, adapter)
    leases = getattr(request.state, "model_leases", None)
    if leases is None:
        leases = request.state.model_leases = []
    leases.append(lease)
    return served


Handler = Callable[[Request], Awaitable[Response]]


def api(handler: Handler) -> Handler:
    """Errors become the error shape of the path's API family (OpenAI's, or Anthropic's on
    the Messages routes) here, inside the middleware, so even a 500 carries CORS headers
    a browser page can read."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except MlxPrefixError as e:
            return error_response_for(request.url.path, e)
        except Exception as e:
            log.exception("unhandled error on %s %s", request.method, request.url.path)
            err = MlxPrefixError(f"internal error: {type(e).__name__}: {e}")
            return error_response_for(request.url.path, err)
        finally:
            for lease in getattr(request.state, "model_leases", ()):
                lease.release()

    return wrapped


async def read_json(request: Request) -> dict[str, Any]:
    # A browser page must send JSON: a form or text/plain body is what a page can send
    # without a preflight (refused origins never get here; this is the second fence).
    # Other clients (`curl -d`, scripts) often omit the header: their body is parsed as
    # JSON whatever it says.
    content_type = request.headers.get("content-type", "")
    from_page = "origin" in request.headers
    if from_page and content_type.partition(";")[0].strip().lower() != "application/json":
        raise UnsupportedMediaType(
            "send the request body as JSON with 'Content-Type: application/json'"
            + (f" (got {content_type!r})" if content_type else " (none was sent)")
        )
    limit = state(request).settings.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit}")
    # Content-Length may be absent (chunked) or lie, so count what actually arrives.
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return parse_json_object(b"".join(chunks))
