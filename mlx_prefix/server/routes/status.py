"""Read-only routes: the served model (/v1/models), /health and Prometheus /metrics."""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..metrics import CONTENT_TYPE
from .common import ServerState, api, resolve_model, state


@api
async def list_models(request: Request) -> Response:
    st = state(request)
    return JSONResponse({"object": "list", "data": [_model_card(st)]})


@api
async def get_model(request: Request) -> Response:
    st = state(request)
    resolve_model(st.engine, request.path_params["model_id"])
    return JSONResponse(_model_card(st))


def _model_card(st: ServerState) -> dict[str, Any]:
    model = st.engine.model
    return {
        "id": model.name,
        "object": "model",
        "created": st.started,
        "owned_by": "mlx-prefix",
        "context_length": model.context_length,
    }


async def health(request: Request) -> Response:
    engine = state(request).engine
    failure = getattr(engine, "failure", None)  # a sharded group that lost a rank
    if failure is not None:
        body = {"status": "unavailable", "model": engine.model.name, "error": failure}
        return JSONResponse(body, status_code=503)
    return JSONResponse({"status": "ok", "model": engine.model.name})


async def metrics(request: Request) -> Response:
    body = await run_in_threadpool(state(request).metrics.exposition)
    return Response(body, media_type=CONTENT_TYPE)
