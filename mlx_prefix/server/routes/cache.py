"""The prompt cache over HTTP: GET /v1/cache (stats, entries), DELETE /v1/cache (flush),
POST /v1/cache/warm (prefill a prompt into the cache without generating), GET
/v1/cache/requests (why recent requests reused what they did: explain/). Entries,
flushes and request records are the caller's namespace's, warm-ups go into it
(server/guards/namespaces.py); the admin key sees every namespace."""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import replace
from typing import Any

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import ExplainOff, WarmTimeout
from ..guards.body import read_json
from ..guards.namespaces import caller, visible
from ..protocol.cache import parse_requests_query, parse_warm
from ..protocol.fields import field
from ..replies.stream import ClientGone, until_disconnect
from .common import api, model_for, state
from .flow import check_images

log = logging.getLogger("mlx_prefix.server")


@api
async def cache_info(request: Request) -> Response:
    engine = state(request).engine
    stats = await run_in_threadpool(engine.views.cache_stats)
    entries = visible(caller(request), await run_in_threadpool(engine.views.cache_entries))
    # The store's CheckpointKind is an IntEnum: show "HISTORY", not 2.
    entries = [
        {k: v.name if isinstance(v, enum.Enum) else v for k, v in entry.items()}
        for entry in entries
    ]
    return JSONResponse({"stats": stats, "entries": entries})


@api
async def cache_requests(request: Request) -> Response:
    """The caller's recent requests, newest first: `?limit=N` (1 to the records kept)."""
    limit = parse_requests_query(request.query_params)
    explainer = state(request).metrics.explainer
    if not explainer.enabled:
        raise ExplainOff("this server keeps no request records (it was started with --no-explain)")
    records = visible(caller(request), await run_in_threadpool(explainer.records))
    data = [r.as_json() for r in records[:limit]]
    return JSONResponse({"object": "list", "data": data})


@api
async def cache_warm(request: Request) -> Response:
    st = state(request)
    body = await read_json(request)
    served = await model_for(request, field(body, "model", str, None))
    # Off the event loop (its images' headers are read), then its images checked whole
    # before the engine decodes any.
    warm = await run_in_threadpool(parse_warm, body, st.settings.images)
    check_images(warm.prompt, st.settings.images, served.engine)
    started = time.perf_counter()
    timeout = st.settings.warm_timeout_s
    cache = replace(warm.cache, namespace=caller(request).namespace)
    handle, future = await run_in_threadpool(served.engine.start_warm, warm.prompt, warm.pin, cache)
    settled = asyncio.wrap_future(future)
    # A warm-up given up (timeout, hang-up) is still settled by the engine, with
    # EngineBusy: read it then, or asyncio logs "exception was never retrieved".
    settled.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def finished() -> Any:
        with anyio.fail_after(timeout):
            # Shielded: the engine owns the future; the handle is how to stop the job.
            return await asyncio.shield(settled)

    try:
        result = await until_disconnect(request, finished, on_gone=handle.cancel)
    except TimeoutError:
        handle.cancel()
        raise WarmTimeout(
            f"the warm-up did not finish within {timeout:g}s (the server's warm_timeout_s); "
            "it was cancelled"
        ) from None
    except ClientGone:
        log.info("warm client_disconnected after %.0fms", (time.perf_counter() - started) * 1000)
        return Response(status_code=499)
    log.info(
        "warm prompt=%d cached=%d pinned=%s took=%.0fms",
        result.prompt_tokens, result.cached_tokens, result.pinned,
        (time.perf_counter() - started) * 1000,
    )  # fmt: skip
    return JSONResponse(
        {
            "prompt_tokens": result.prompt_tokens,
            "cached_tokens": result.cached_tokens,
            "pinned": result.pinned,
        }
    )


@api
async def cache_flush(request: Request) -> Response:
    who = caller(request)
    namespace = None if who.admin else who.namespace  # None: every namespace
    st = state(request)
    # Every resident model's entries (the views show the primary's only): listed here, on
    # the event loop, where the pool's state lives.
    engines = [served.engine for served in st.models.resident()] or [st.engine]

    def flush() -> int:
        removed = sum(engine.views.flush_cache(namespace) for engine in engines)
        st.metrics.explainer.forget(namespace)  # what it held is no reason any more
        return removed

    return JSONResponse({"removed": await run_in_threadpool(flush)})
