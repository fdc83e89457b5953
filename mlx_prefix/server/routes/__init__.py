"""HTTP handlers, one module per API family, and the route table. A family has one name
used in protocol/ (its bodies), routes/ (its handlers) and replies/ (its writer): chat,
completions (whose reply is chat's shape), anthropic, responses, embeddings, ollama
(routes/ollama/: chat.py, its model routes info.py and embeddings embed.py); the
cache admin routes are cache (routes/cache.py, protocol/cache.py); what SGLang's router
asks a worker is worker.py. Every generation handler
runs one preamble and one reply (flow.py); engine calls that may block go through the
threadpool. To add a family: protocol/<family>.py, replies/<family>.py, and here
routes/<family>.py and its rows in API_ROUTES.

One table: every API route is served under /v1 and under its unprefixed path
(`/chat/completions` as well as `/v1/chat/completions`), as llama.cpp's server and
mlx_lm.server do, so a client configured with a base URL without `/v1` works. Both
paths reach the same handler behind the same middleware (CORS, API key, body limits),
and errors take the shape of the path's API family either way. To add an API route,
add one row to API_ROUTES. Ollama's API has its own paths (/api/..., and / as its
liveness probe), OLLAMA_ROUTES, behind the same middleware (guards/: Host, Origin, API
key, namespace) and in Ollama's error shape.
"""

from __future__ import annotations

from starlette.routing import Route

from . import dashboard
from .anthropic import count_tokens, messages
from .cache import cache_flush, cache_info, cache_requests, cache_warm
from .chat import chat_completions
from .completions import completions
from .embeddings import embeddings
from .ollama import chat as ollama_chat
from .ollama import embed as ollama_embed
from .ollama import info as ollama_info
from .ollama.info import store_route
from .responses import create_response, delete_response, get_response
from .status import get_model, health, list_models, metrics, ps
from .worker import get_load, model_info, server_info

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

# Ollama's API (GET routes answer HEAD too, as Ollama's do).
OLLAMA_ROUTES = [
    Route("/api/chat", ollama_chat.chat, methods=["POST"]),
    Route("/api/generate", ollama_chat.generate, methods=["POST"]),
    Route("/api/embed", ollama_embed.embed, methods=["POST"]),
    Route("/api/embeddings", ollama_embed.embeddings, methods=["POST"]),
    Route("/api/tags", ollama_info.tags, methods=["GET"]),
    Route("/api/show", ollama_info.show, methods=["POST"]),
    Route("/api/ps", ollama_info.ps, methods=["GET"]),
    Route("/api/version", ollama_info.version, methods=["GET"]),
    Route("/api/pull", ollama_info.pull, methods=["POST"]),
    Route("/api/push", store_route("push"), methods=["POST"]),
    Route("/api/create", store_route("create"), methods=["POST"]),
    Route("/api/copy", store_route("copy"), methods=["POST"]),
    Route("/api/delete", store_route("delete"), methods=["DELETE"]),
    Route("/api/blobs/{digest}", store_route("blob upload"), methods=["POST", "HEAD"]),
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
    Route("/v1/cache/requests", cache_requests, methods=["GET"]),
    Route("/v1/cache/entries/{entry_id:int}/pin", dashboard.pin, methods=["POST"]),
    Route("/v1/cache/entries/{entry_id:int}", dashboard.evict, methods=["DELETE"]),
    Route("/v1/dashboard", dashboard.data, methods=["GET"]),
    *OLLAMA_ROUTES,
    Route("/", ollama_info.root, methods=["GET"]),  # Ollama's probe; browsers: the dashboard
    Route("/dashboard", dashboard.page, methods=["GET"]),
    Route("/dashboard/static/{name:path}", dashboard.static, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    # What SGLang's router asks a worker (worker.py), with its deprecated `/get_` names.
    Route("/server_info", server_info, methods=["GET"]),
    Route("/get_server_info", server_info, methods=["GET"]),
    Route("/model_info", model_info, methods=["GET"]),
    Route("/get_model_info", model_info, methods=["GET"]),
    Route("/get_load", get_load, methods=["GET"]),
    Route("/flush_cache", cache_flush, methods=["POST"]),
]
