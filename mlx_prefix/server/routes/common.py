"""What every handler shares: the app's state (with the served models), the model lookup
and the error wrapper."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from mlx_prefix.errors import MlxPrefixError

from ..errors import error_response_for
from ..monitor.dashboard import TreeShapes
from ..monitor.metrics import ServerMetrics
from ..protocol.request import Limits
from ..protocol.spec import SamplingDefaults
from ..replies.stream import InFlight
from ..responses_store import ResponseStore
from ..served.embeddings import ServedEmbeddings
from ..served.idle import IdleUnloader
from ..served.names import ServedModel
from ..served.pool import ModelPool
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
    unloader: IdleUnloader | None = None  # idle unload, when models load on demand

    def limits_named(self, body: dict[str, Any]) -> Limits:
        """The limits to parse `body` with: the server's, with the sampling defaults of
        the settings file's table for the model the body names (the body's own fields
        win). A name that selects nothing keeps the server's: the lookup after parsing
        gives its error."""
        name = body.get("model")
        try:
            spec = self.models.spec_for(name if isinstance(name, str) else None)
            own = self.models.settings_for(spec)
        except MlxPrefixError:
            return self.limits
        server = self.limits.sampling
        sampling = SamplingDefaults(
            *(
                server.get(f, None) if getattr(own, f) is None else getattr(own, f)
                for f in ("temperature", "top_p", "top_k", "min_p")
            )
        )
        default_max = own.max_tokens or self.limits.default_max_tokens
        return replace(self.limits, sampling=sampling, default_max_tokens=default_max)

    def limits_for(self, engine: EngineAPI, base: Limits | None = None) -> Limits:
        """The request limits of the model `engine` serves: its own context length (and
        `base`'s defaults: `limits_named`'s)."""
        cap = self.settings.max_tokens_limit
        return replace(base or self.limits, max_tokens=min(cap, engine.model.context_length or cap))

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
