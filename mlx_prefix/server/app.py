"""The Starlette app around an engine, and `serve`, which runs it under uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware

from .errors import EXCEPTION_HANDLERS
from .guards.hosts import HostPolicy
from .guards.middleware import ApiKeyAuth, HostGuard, cors
from .guards.namespaces import Namespaces
from .monitor.metrics import RequestCounter, ServerMetrics
from .ollama_port import bind_ollama_port, bound_address, covered
from .protocol.request import Limits
from .protocol.spec import SamplingDefaults
from .replies.stream import InFlight
from .responses_store import ResponseStore
from .routes import ROUTES
from .routes.common import ServerState
from .served.embeddings import ServedEmbeddings
from .served.idle import IdleUnloader
from .served.loading import EngineLoader
from .served.pool import ModelPool
from .settings import ServerSettings

if TYPE_CHECKING:
    from mlx_prefix.embeddings.worker import EmbeddingWorker
    from mlx_prefix.engine.interface import EngineAPI
    from mlx_prefix.models.settings_file import ModelsFile

log = logging.getLogger("mlx_prefix.server")


def create_app(
    engine: EngineAPI,
    settings: ServerSettings,
    loader: EngineLoader | None = None,
    embeddings: EmbeddingWorker | None = None,
    model_settings: ModelsFile | None = None,
) -> Starlette:
    """An app serving `engine`. Without a `loader` it never shuts the engine down: whoever
    made it owns it. With one, other models are loaded on demand (server/served/pool.py),
    idle ones unloaded (server/served/idle.py), and the app owns `engine` too: it may
    unload it (shut down, weights dropped). `embeddings` serves /v1/embeddings; its
    owner closes it. `model_settings`: the settings file, read (models/settings_file.py)."""
    return _build(engine, settings, None, loader, embeddings, model_settings)


def serve(
    engine: EngineAPI,
    settings: ServerSettings,
    loader: EngineLoader | None = None,
    embeddings: EmbeddingWorker | None = None,
    model_settings: ModelsFile | None = None,
    ollama_socket: socket.socket | None = None,
) -> None:
    """Serves until SIGINT/SIGTERM, then: stop accepting connections, give in-flight
    requests `settings.shutdown_grace_s` to finish, cancel the rest, shut the engines
    (and the embedding worker) down. With `settings.ollama`, also on Ollama's address,
    through `ollama_socket` when the caller bound it early (before loading the model),
    else bound here."""
    ollama = settings.ollama
    if ollama and ollama_socket is None and not covered(settings.host, settings.port, ollama):
        ollama_socket = bind_ollama_port(ollama)
    logging.getLogger("mlx_prefix").setLevel(settings.log_level.upper())
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    shut_down = False

    app = _build(engine, settings, lambda: shutdown_engine(), loader, embeddings, model_settings)
    pool: ModelPool = app.state.server.models

    def shutdown_engine() -> None:
        nonlocal shut_down
        if not shut_down:
            shut_down = True
            pool.close(timeout=settings.shutdown_grace_s)
            if embeddings is not None:
                embeddings.close(timeout=settings.shutdown_grace_s)

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        log_config=None,  # keep the host's logging setup
        access_log=False,  # we write one richer line per request
        # A backstop only: _GracefulServer cancels at the grace period through the
        # engine, so clients get an error event / 503 rather than a cut connection.
        # uvicorn annotates int but hands it to asyncio.wait_for, which takes a float.
        timeout_graceful_shutdown=settings.shutdown_grace_s + 5.0,  # type: ignore[arg-type]
        lifespan="on",
    )
    name = engine.model.name
    listening = lambda port: log.info("%s", serving_line(name, settings.host, port))  # noqa: E731
    if ollama_socket is not None:
        log.info(
            "Ollama's address: http://%s (its API is served on both)", bound_address(ollama_socket)
        )
    if embeddings is not None:
        log.info("%s", embeddings_line(embeddings))
    cluster = getattr(engine, "cluster", None)  # a sharded engine (engine/sharded/distributed.py)
    if cluster is not None:
        log.info("%s", cluster.describe())
    del engine  # the pool owns it: once unloaded, nothing here may keep its weights alive
    failed = lambda: getattr(pool.primary(), "failure", None) is not None  # noqa: E731
    try:
        # uvicorn re-raises the captured signal after its shutdown; the engine is shut
        # down in the app's lifespan before that, and here when startup failed.
        server = _GracefulServer(
            config, app.state.server.inflight, settings.shutdown_grace_s, failed, listening
        )
        if ollama_socket is None:
            server.run()
        else:  # both addresses on one server, the main one bound as uvicorn binds it
            server.run(sockets=[config.bind_socket(), ollama_socket])
    finally:
        shutdown_engine()


def serving_line(model_name: str, host: str, port: int) -> str:
    """The startup line: where the API listens and where to open the dashboard."""
    browse = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    bind, browse = (f"[{h}]" if ":" in h else h for h in (host, browse))
    return (
        f"serving {model_name} on http://{bind}:{port} "
        f"(dashboard: http://{browse}:{port}/dashboard)"
    )


def embeddings_line(worker: EmbeddingWorker) -> str:
    """What /v1/embeddings serves, and what its weights take beside the chat model's."""
    m = worker.model
    return (
        f"embeddings: {m.name} ({m.dimensions} dimensions, {m.pooling.mode} pooling"
        f"{', normalised' if m.pooling.normalize else ''}"
        f"{', Matryoshka' if m.pooling.matryoshka else ''}; "
        f"weights {m.weights_bytes / 2**20:.0f} MiB {m.dtype})"
    )


class _GracefulServer(uvicorn.Server):
    """uvicorn's shutdown (stop accepting, wait for open requests), plus: requests still
    running after `grace_s` are cancelled in the engine and end with an error event; an
    engine that can no longer serve (`failed`: a sharded group lost a rank) stops it; the
    startup line names the port bound (`--port 0` asks the system for a free one)."""

    def __init__(
        self,
        config: uvicorn.Config,
        inflight: InFlight,
        grace_s: float,
        failed: Callable[[], bool] = lambda: False,
        listening: Callable[[int], None] = lambda port: None,
    ):
        super().__init__(config)
        self._inflight = inflight
        self._grace_s = grace_s
        self._failed = failed
        self._listening = listening  # told the port once bound (`--port 0`: the one chosen)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.servers and self.servers[0].sockets:
            self._listening(self.servers[0].sockets[0].getsockname()[1])

    async def on_tick(self, counter: int) -> bool:
        if self._failed():
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._inflight:
            log.info("waiting up to %.0fs for %d request(s)", self._grace_s, len(self._inflight))
        timer = asyncio.get_running_loop().call_later(self._grace_s, self._cancel_inflight)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _cancel_inflight(self) -> None:
        if n := self._inflight.cancel_all():
            log.warning("grace period over: cancelled %d request(s)", n)


def _draft_names(engine: EngineAPI) -> tuple[str, ...]:
    """How a request's draft_model may name the server's --draft-model."""
    draft = getattr(engine, "draft", None)
    return () if draft is None else (draft.name, str(draft.path))


def host_policy(settings: ServerSettings) -> HostPolicy:
    return HostPolicy(settings.host, settings.allowed_hosts, settings.allowed_origins)


def _build(
    engine: EngineAPI,
    settings: ServerSettings,
    on_shutdown: Callable[[], None] | None,
    loader: EngineLoader | None = None,
    embeddings: EmbeddingWorker | None = None,
    model_settings: ModelsFile | None = None,
) -> Starlette:
    limits = Limits(  # for parsing: each served model's own limit comes after (limits_for)
        default_max_tokens=settings.default_max_tokens,
        max_tokens=settings.max_tokens_limit,
        sampling=SamplingDefaults(
            settings.temperature, settings.top_p, settings.top_k, settings.min_p
        ),
        draft_names=_draft_names(engine),
        images=settings.images,
    )
    models = ModelPool(
        engine,
        settings.aliases,
        strict=settings.strict_model_names,
        loader=loader,
        max_models=settings.max_models,
        model_aliases=settings.model_alias_map(),
        allowed_models=settings.allowed_models,
        settings=model_settings,
        keep_alive_s=settings.keep_alive_s,
        default_keep_alive_s=settings.model_keep_alive_s,
    )
    unloader = IdleUnloader(models) if loader is not None else None
    metrics = ServerMetrics(
        lambda: models.primary().views.cache_stats(), explain=settings.explain_requests
    )
    middleware = [
        Middleware(RequestCounter, metrics=metrics, endpoints=sorted({r.path for r in ROUTES})),
        Middleware(HostGuard, policy=host_policy(settings)),
        cors(settings.allowed_origins),
    ]
    if settings.api_key:
        middleware.append(Middleware(ApiKeyAuth, api_key=settings.api_key))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        watch = asyncio.create_task(unloader.run()) if unloader is not None else None
        yield
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
        metrics.explainer.close()
        if on_shutdown is not None:
            log.info("shutting down the engine")
            await run_in_threadpool(on_shutdown)

    app = Starlette(
        routes=ROUTES,
        middleware=middleware,
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    app.state.server = ServerState(
        models=models,
        settings=settings,
        metrics=metrics,
        limits=limits,
        inflight=InFlight(),
        started=int(time.time()),
        responses=ResponseStore(settings.responses_store, settings.responses_store_bytes),
        embeddings=ServedEmbeddings.of(embeddings, settings.embedding_aliases)
        if embeddings is not None
        else None,
        unloader=unloader,
    )
    app.state.namespaces = Namespaces(settings.cache_sharing, settings.api_key)
    return app
