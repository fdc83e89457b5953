"""What SGLang's router (the SGLang Model Gateway, PyPI `sglang-router`) asks a worker,
answered with the truth, so that mlx-prefix replicas behind it are first-class workers.

The router (0.3.2) registers an HTTP worker by reading `GET /server_info` (the served
model's name becomes the worker's model id; its path, the tokenizer the router loads) and
`GET /model_info` (with `/get_model_info` and `/get_server_info`, the deprecated names it
falls back to); its health check is `GET /health` (routes/status.py); `power_of_two`
reads `GET /get_load` (the tokens in flight, summed over the array's entries); its own
`POST /flush_cache` fans out to every worker. All of them pass the same middleware as
every route (guards/middleware.py): the router sends the key given to its `--api-key`
as `Authorization: Bearer`. Its health check sends none, and /health needs none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_prefix import __version__

from .common import api, state

# Files a tokenizer folder holds (Hugging Face's layout, which the router's loader reads).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@api
async def server_info(request: Request) -> Response:
    """SGLang's /server_info fields that describe this server: its model (the router
    takes `served_model_name` as the worker's model id) and version."""
    st = state(request)
    spec = st.models.default_spec
    return JSONResponse(
        {
            "served_model_name": spec.id,
            "model_path": str(spec.folder),
            "context_length": st.engine.model.context_length,
            "version": __version__,
            "backend": "mlx-prefix",
        }
    )


@api
async def model_info(request: Request) -> Response:
    """SGLang's /model_info: the served model's path, its tokenizer's (None where the
    folder holds none the router could read, e.g. a GGUF file), and its config's type."""
    spec = state(request).models.default_spec
    config = await run_in_threadpool(_config, spec.folder)
    return JSONResponse(
        {
            "model_path": str(spec.folder),
            "tokenizer_path": _tokenizer_path(spec.folder),
            "is_generation": True,
            "model_type": config.get("model_type"),
            "architectures": config.get("architectures"),
            "served_model_name": spec.id,
        }
    )


@api
async def get_load(request: Request) -> Response:
    """SGLang's /get_load: one entry per data-parallel rank (here one), from what every
    resident model's engine last published (engine/activity.py): requests running
    (prefilling or decoding), requests waiting, and the tokens the running ones hold.
    Warm-ups and next-turn prefetches count: they occupy the engine as requests do."""
    st = state(request)
    engines = [served.engine for served in st.models.resident()] or [st.engine]
    jobs = [job for engine in engines for job in engine.views.activity().jobs]
    running = [j for j in jobs if j.state != "queued"]
    load = {
        "dp_rank": 0,
        "num_reqs": len(running),
        "num_waiting_reqs": len(jobs) - len(running),
        "num_tokens": sum(j.prompt_tokens + j.generated_tokens for j in running),
    }
    return JSONResponse([load])


def _tokenizer_path(folder: Path) -> str | None:
    if folder.is_dir() and any((folder / name).is_file() for name in TOKENIZER_FILES):
        return str(folder)
    return None


def _config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}
