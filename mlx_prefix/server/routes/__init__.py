"""HTTP handlers, one module per family, and the route table. Handlers parse (protocol),
call the engine off the event loop, and shape the answer (responses / generation).
Engine calls that may block go through the threadpool."""

from __future__ import annotations

from starlette.routing import Route

from . import dashboard
from .cache import cache_flush, cache_info, cache_warm
from .generate import chat_completions, completions
from .responses import create_response, delete_response, get_response
from .status import get_model, health, list_models, metrics

ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
    Route("/v1/cache", cache_info, methods=["GET"]),
    Route("/v1/cache", cache_flush, methods=["DELETE"]),
    Route("/v1/cache/warm", cache_warm, methods=["POST"]),
    Route("/v1/cache/entries/{entry_id:int}/pin", dashboard.pin, methods=["POST"]),
    Route("/v1/cache/entries/{entry_id:int}", dashboard.evict, methods=["DELETE"]),
    Route("/v1/dashboard", dashboard.data, methods=["GET"]),
    Route("/", dashboard.root, methods=["GET"]),
    Route("/dashboard", dashboard.page, methods=["GET"]),
    Route("/dashboard/static/{name:path}", dashboard.static, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]
