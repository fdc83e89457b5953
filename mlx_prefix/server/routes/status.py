"""Read-only routes: the served models (/v1/models), what is loaded (/v1/ps, for
`mlx-prefix ps`), /health and Prometheus /metrics."""

from __future__ import annotations

import datetime
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..monitor.metrics import CONTENT_TYPE
from ..served.cards import ModelCard
from ..served.status import cache_use, model_statuses, status_body
from .common import ServerState, api, state


@api
async def list_models(request: Request) -> Response:
    """OpenAI's list: one card per served id and per alias (`alias_of` names its model),
    each --model-alias, and the other models resident (server/served/pool.py), then the
    embedding model's. A client sending `anthropic-version` (the Anthropic SDKs) gets
    Anthropic's shape, chat models only."""
    st = state(request)
    cards = [card for row in st.models.cards() for card in _cards(st, row)]
    if "anthropic-version" in request.headers:
        data = [_anthropic_card(st, c["id"]) for c in cards]
        first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
        return JSONResponse({"data": data, "has_more": False, "first_id": first, "last_id": last})
    return JSONResponse({"object": "list", "data": cards + _embedding_cards(st)})


@api
async def get_model(request: Request) -> Response:
    st = state(request)
    name = request.path_params["model_id"]
    embedding = st.embeddings is not None and st.embeddings.names.find(name) is not None
    if embedding and name != "default" and "anthropic-version" not in request.headers:
        cards = _embedding_cards(st)
        return JSONResponse(next((c for c in cards if c["id"] == name), cards[0]))
    spec = st.models.spec_for(request.path_params["model_id"])
    unloaded = ModelCard(spec.id, None, resident=False)
    row = next((c for c in st.models.cards() if c.id == spec.id), unloaded)
    if "anthropic-version" in request.headers:
        return JSONResponse(_anthropic_card(st, row.id))
    return JSONResponse(_cards(st, row)[0])


def _cards(st: ServerState, row: ModelCard) -> list[dict[str, Any]]:
    card = {
        "id": row.id,
        "object": "model",
        "created": st.started,
        "owned_by": "mlx-prefix",
        "context_length": row.context_length,
        "aliases": list(row.aliases),
    }
    if row.alias_of is not None:
        card["alias_of"] = row.alias_of
    if st.models.loader is not None:  # several models: say which are loaded
        card["resident"] = row.resident
        card["adapters"] = list(row.adapters)
    aliases = [{**card, "id": alias, "alias_of": row.id, "aliases": []} for alias in row.aliases]
    return [card, *aliases]


def _embedding_cards(st: ServerState) -> list[dict[str, Any]]:
    """The --embedding-model's card (and its aliases'): its vector size, pooling and the
    memory its weights hold beside the chat model's."""
    if st.embeddings is None:
        return []
    model = st.embeddings.worker.model
    card: dict[str, Any] = {
        "id": model.name,
        "object": "model",
        "created": st.started,
        "owned_by": "mlx-prefix",
        "type": "embedding",
        "context_length": model.context_length,
        "dimensions": model.dimensions,
        "matryoshka": model.pooling.matryoshka,
        "pooling": model.pooling.mode,
        "normalized": model.pooling.normalize,
        "weights_bytes": model.weights_bytes,
        "aliases": list(st.embeddings.names.default.aliases),
    }
    aliases = [{**card, "id": a, "alias_of": model.name, "aliases": []} for a in card["aliases"]]
    return [card, *aliases]


def _anthropic_card(st: ServerState, model_id: str) -> dict[str, Any]:
    created = datetime.datetime.fromtimestamp(st.started, datetime.timezone.utc)
    return {
        "type": "model",
        "id": model_id,
        "display_name": model_id,
        "created_at": created.isoformat().replace("+00:00", "Z"),
    }


@api
async def ps(request: Request) -> Response:
    """The resident models: memory, cache use, idle time and when each unloads."""
    st = state(request)
    engines = [served.engine for served in st.models.resident()]

    def read() -> tuple[dict, dict]:
        return {id(e): cache_use(e) for e in engines}, st.engine.views.cache_stats()

    caches, stats = await run_in_threadpool(read)
    rows = model_statuses(st.models, st.unloader, caches)
    return JSONResponse(status_body(st.models, rows, stats))


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
