"""The Ollama family's model routes: GET and HEAD / ("Ollama is running", what its
clients probe; a browser is sent to the dashboard), GET /api/version, GET /api/tags (the
served models), POST /api/show (one model's details, template and capabilities), GET
/api/ps (what is loaded, its memory, its expiry: the pool's keep-alive, as /v1/ps reads
it, served/status.py), and the model store routes, which answer in Ollama's shape: a
pull of a model served here succeeds at once, anything else is a clear error pointing
at the CLI (`mlx-prefix pull`, `rm`) and keep_alive 0. Nothing here loads a model;
folders are read off the event loop."""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from mlx_prefix.errors import InvalidRequest, ModelNotFound
from mlx_prefix.models.load import context_length
from mlx_prefix.models.preflight import load_estimate
from mlx_prefix.vision.tower import carries_tower, is_vision_config

from ...guards.body import read_json
from ...served.ollama import ModelFacts, capabilities, facts, listed_name, requested_name
from ...served.status import model_statuses
from .. import dashboard
from ..common import ServerState, api, state

log = logging.getLogger("mlx_prefix.server")

# The Ollama release whose API this server follows (clients gate features on it).
OLLAMA_VERSION = "0.32.0"
RUNNING = "Ollama is running"
SHOW_FIELDS = frozenset({"model", "name", "verbose"})
# What Ollama reports as the expiry of a model kept for good (time.Duration's maximum
# after now, as its /api/ps shows): clients read it as "does not expire".
NEVER = datetime.datetime(2318, 1, 1, tzinfo=datetime.timezone.utc)


async def root(request: Request) -> Response:
    """Ollama's liveness probe; a browser (asking for HTML) goes to the dashboard."""
    if "text/html" in request.headers.get("accept", ""):
        return await dashboard.root(request)
    return PlainTextResponse(RUNNING)


@api
async def version(request: Request) -> Response:
    from mlx_prefix import __version__ as ours

    return JSONResponse({"version": OLLAMA_VERSION, "mlx_prefix": ours})


@api
async def tags(request: Request) -> Response:
    st = state(request)
    rows = []
    resident = {slot.spec.id: slot.served for slot in st.models.slots()}
    for card in st.models.cards():
        try:
            folder = st.models.spec_for(card.id).folder
        except ModelNotFound:  # an operator's --model-alias whose folder went away
            folder = None
        dtype = _dtype(resident.get(card.id))
        found = await run_in_threadpool(facts, folder, dtype)
        rows += [_tag_row(name, found) for name in (card.id, *card.aliases)]
    if st.embeddings is not None:
        model = st.embeddings.worker.model
        found = await run_in_threadpool(facts, model.path, None)
        rows += [_tag_row(n, found) for n in (model.name, *st.embeddings.names.default.aliases)]
    return JSONResponse({"models": rows})


@api
async def show(request: Request) -> Response:
    st = state(request)
    body = await read_json(request)
    unknown = sorted(set(body) - SHOW_FIELDS)
    if unknown:
        raise InvalidRequest(f"'{unknown[0]}' is not supported by /api/show", param=unknown[0])
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest("model is required", param="model")
    embedding = _embedding(st, name)
    if embedding is not None:
        model = embedding.worker.model
        found = await run_in_threadpool(facts, model.path, None)
        return JSONResponse(_show(found, model.context_length, ["embedding"], model.path))
    ours = requested_name(st.models.selector, name)
    try:
        spec = st.models.spec_for(ours)
    except ModelNotFound as e:
        raise ModelNotFound(f"model '{name}' not found: {e.message}", param="model") from None
    served = next((s.served for s in st.models.slots() if s.spec.key == spec.key), None)
    found = await run_in_threadpool(facts, spec.folder, _dtype(served))
    if served is not None:
        model = served.engine.model
        vision = getattr(model, "vision", None) is not None  # a sharded model: no tower
        tokenizer, ctx = model.tokenizer, model.context_length
    else:
        tokenizer, ctx = None, context_length(found.config)
        vision = is_vision_config(found.config) and await run_in_threadpool(
            carries_tower, spec.folder
        )
    caps = capabilities(tokenizer, found.template, vision)
    return JSONResponse(_show(found, ctx, caps, spec.folder))


@api
async def ps(request: Request) -> Response:
    st = state(request)
    cpu = _on_cpu()
    rows = []
    now = time.time()
    slots = st.models.slots()
    for slot, status in zip(slots, model_statuses(st.models, st.unloader, {}), strict=True):
        spec, served = slot.spec, slot.served
        expires = _expires_at(now, status.unloads_in_s)
        try:
            found = await run_in_threadpool(facts, spec.folder, _dtype(served))
            size = status.weights_bytes or await run_in_threadpool(
                load_estimate, spec.folder, spec.adapter, cpu
            )
            rows.append(_ps_row(served.id, found, size, cpu, expires, status.context_length))
        except Exception:  # noqa: BLE001 - one model's row must not fail the listing
            log.exception("/api/ps: %s listed with what is known of it", served.id)
            rows.append(_bare_ps_row(served.id, status.weights_bytes, cpu, expires))
    if st.embeddings is not None:
        model = st.embeddings.worker.model
        found = await run_in_threadpool(facts, model.path, None)
        rows.append(
            _ps_row(model.name, found, model.weights_bytes, cpu, NEVER, model.context_length)
        )
    return JSONResponse({"models": rows})


@api
async def pull(request: Request) -> Response:
    st = state(request)
    body = await read_json(request)
    name = body.get("model") or body.get("name")
    if isinstance(name, str) and name:
        ours = requested_name(st.models.selector, name)
        if st.models.selector.named(ours) or _embedding(st, name) is not None:
            return JSONResponse({"status": "success"})  # already here: nothing to download
    raise ModelNotFound(
        f"pull: model {name!r} is not served here, and this server downloads nothing over "
        "its API: run `mlx-prefix pull REPO` on its machine, then serve it (--model, "
        "--allowed-models, or a table in models.toml)",
        param="model",
    )


def store_route(action: str) -> Any:
    @api
    async def refuse(request: Request) -> Response:
        raise InvalidRequest(
            f"{action} is not supported: mlx-prefix serves the model folders its operator "
            "named (serve --model, --allowed-models, models.toml) and keeps no model "
            "store of its own (`mlx-prefix pull`, `ls` and `rm` manage the downloaded "
            "models); to unload a model, send keep_alive 0",
            param="model",
        )

    refuse.__name__ = f"refuse_{action.replace(' ', '_')}"
    return refuse


def _tag_row(name: str, found: ModelFacts) -> dict[str, Any]:
    listed = listed_name(name)
    return {
        "name": listed,
        "model": listed,
        "modified_at": found.modified_at,
        "size": found.size,
        "digest": found.digest,
        "details": found.details(),
    }


def _show(found: ModelFacts, ctx: int | None, caps: list[str], folder: Any) -> dict[str, Any]:
    return {
        "license": "",
        "modelfile": f"# Modelfile generated by mlx-prefix\nFROM {folder}\n",
        "parameters": "",
        "template": found.template,
        "details": {**found.details(), **({"context_length": ctx} if ctx else {})},
        "model_info": found.model_info(ctx),
        "capabilities": caps,
        "modified_at": found.modified_at,
    }


def _ps_row(name: str, found: ModelFacts, size: int, cpu: bool, expires: Any, ctx: Any) -> dict:
    listed = listed_name(name)
    return {
        "name": listed,
        "model": listed,
        "size": size,
        "digest": found.digest,
        "details": found.details(),
        "expires_at": expires.isoformat().replace("+00:00", "Z"),
        "size_vram": 0 if cpu else size,  # unified memory: a GPU's weights are all "VRAM"
        "context_length": ctx or 0,
    }


def _expires_at(now: float, unloads_in_s: float | None) -> datetime.datetime:
    """When a model unloads if left idle, as a date: NEVER for one kept for good, or
    one whose keep-alive ends past what a date can hold (config.MAX_DURATION_S keeps a
    request's below it; the settings file's or a library caller's may not)."""
    if unloads_in_s is None:
        return NEVER
    try:
        return min(
            datetime.datetime.fromtimestamp(now + unloads_in_s, datetime.timezone.utc), NEVER
        )
    except (OverflowError, OSError, ValueError):
        return NEVER


def _bare_ps_row(name: str, size: int, cpu: bool, expires: datetime.datetime) -> dict:
    """A /api/ps row with only what the pool knows (its folder could not be read)."""
    listed = listed_name(name)
    return {
        "name": listed,
        "model": listed,
        "size": size,
        "digest": "",
        "details": {
            "parent_model": "",
            "format": "safetensors",
            "family": "",
            "families": [],
            "parameter_size": "",
            "quantization_level": "",
        },  # fmt: skip
        "expires_at": expires.isoformat().replace("+00:00", "Z"),
        "size_vram": 0 if cpu else size,
        "context_length": 0,
    }


def _embedding(st: ServerState, name: str) -> Any:
    """The embedding model when `name` (with or without its tag) names it; else None."""
    served = st.embeddings
    if served is None:
        return None
    base = name.rpartition(":")[0] if ":" in name else name
    if served.names.find(name) is not None or served.names.find(base) is not None:
        return served if name not in ("default", "default:latest") else None
    return None


def _dtype(served: Any) -> str | None:
    identity = getattr(getattr(served, "engine", None), "model", None)
    return getattr(getattr(identity, "identity", None), "dtype", None)


def _on_cpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.cpu
