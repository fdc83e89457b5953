"""Read-only routes: the served models (/v1/models), /health and Prometheus /metrics."""

from __future__ import annotations

import datetime
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..metrics import CONTENT_TYPE
from ..model_names import ServedModel
from .common import ServerState, api, state


@api
async def list_models(request: Request) -> Response:
    """OpenAI's list: one card per served id and per alias (`alias_of` names its model).
    A client sending `anthropic-version` (the Anthropic SDKs) gets Anthropic's shape."""
    st = state(request)
    cards = [card for served in st.models for card in _cards(st, served)]
    if "anthropic-version" in request.headers:
        data = [_anthropic_card(st, c["id"]) for c in cards]
        first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
        return JSONResponse({"data": data, "has_more": False, "first_id": first, "last_id": last})
    return JSONResponse({"object": "list", "data": cards})


@api
async def get_model(request: Request) -> Response:
    st = state(request)
    served = st.models.resolve(request.path_params["model_id"])
    if "anthropic-version" in request.headers:
        return JSONResponse(_anthropic_card(st, served.id))
    return JSONResponse(_cards(st, served)[0])


def _cards(st: ServerState, served: ServedModel) -> list[dict[str, Any]]:
    card = {
        "id": served.id,
        "object": "model",
        "created": st.started,
        "owned_by": "mlx-prefix",
        "context_length": served.engine.model.context_length,
        "aliases": list(served.aliases),
    }
    aliases = [
        {**card, "id": alias, "alias_of": served.id, "aliases": []} for alias in served.aliases
    ]
    return [card, *aliases]


def _anthropic_card(st: ServerState, model_id: str) -> dict[str, Any]:
    created = datetime.datetime.fromtimestamp(st.started, datetime.timezone.utc)
    return {
        "type": "model",
        "id": model_id,
        "display_name": model_id,
        "created_at": created.isoformat().replace("+00:00", "Z"),
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
