"""HTTP handlers, one module per API family, and the route table. A family has one name
used in protocol/ (its bodies), routes/ (its handlers) and replies/ (its writer): chat,
completions (whose reply is chat's shape), anthropic, responses, embeddings; the cache
admin routes are cache (routes/cache.py, protocol/cache.py). Every generation handler
runs one preamble and one reply (flow.py); engine calls that may block go through the
threadpool. To add a family: protocol/<family>.py, replies/<family>.py, and here
routes/<family>.py and its rows in API_ROUTES.

One table: every API route is served under /v1 and under its unprefixed path
(`/chat/completions` as well as `/v1/chat/completions`), as llama.cpp's server and
mlx_lm.server do, so a client configured with a base URL without `/v1` works. Both
paths reach the same handler behind the same middleware (CORS, API key, body limits),
and errors take the shape of the path's API family either way. To add an API route,
add one row to API_ROUTES.
"""

from __future__ import annotations

from starlette.routing import Route

from . import dashboard
from .anthropic import count_tokens, messages
from .cache import cache_flush, cache_info, cache_warm
from .chat import chat_completions
from .completions import completions
from .embeddings import embeddings
from .responses import create_response, delete_response, get_response
from .status import get_model, health, list_models, metrics, ps

API_PREFIXES = ("/v1", "")

# (path without the version prefix, handler, methods)
API_ROUTES = [
    ("/chat/completions", chat_completions, ["POST"]),
    ("/completions", completions, ["POST"]),
    ("/embeddings", embeddings, ["POST"]),
    ("/messages", messages, ["POST"]),
    ("/messages/count_tokens", count_tokens, ["POST"]),
    ("/responses", create_response, ["POST"]),
    ("/responses/{response_id}", get_response, ["GET"]),
    ("/responses/{response_id}", delete_response, ["DELETE"]),
    ("/models", list_models, ["GET"]),
    ("/models/{model_id:path}", get_model, ["GET"]),
]

ROUTES = [
    *(
        Route(prefix + path, handler, methods=methods)
        for path, handler, methods in API_ROUTES
        for prefix in API_PREFIXES
    ),
    # mlx-prefix's own endpoints and the dashboard: under /v1 (or their own paths) only.
    Route("/v1/ps", ps, methods=["GET"]),
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
