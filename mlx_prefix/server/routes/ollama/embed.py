"""The Ollama family's embedding routes over the server's --embedding-model: POST
/api/embed (`input`: a string or an array of strings; `truncate`, true by default, cuts
each input to the model's context, false makes a longer one a 400; `dimensions`) and the
legacy POST /api/embeddings (`prompt`: one string; `{"embedding": [...]}`). The body is read by
the OpenAI route's parser and the vectors computed by the same worker
(routes/embeddings.py), so both APIs give the same vectors. The embedding model stays
loaded for the server's life: a keep_alive that would unload it is a 400; `options`
change nothing in a vector and are ignored, listed at debug level, as Ollama ignores
what it does not use."""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_prefix.config import FOREVER
from mlx_prefix.errors import InvalidRequest, MlxPrefixError, json_type

from ...guards.body import read_json
from ...guards.namespaces import caller
from ...monitor.metrics import RequestLog
from ...protocol.embeddings import parse_embeddings
from ...protocol.fields import field
from ...protocol.ollama.options import parse_keep_alive
from ...protocol.spec import refuse_unknown
from ...replies.ids import new_id
from ...replies.ollama import ns
from ...served.embeddings import ServedEmbeddings, require
from ...served.ollama import listed_name
from ..common import api, state
from ..embeddings import embed as embed_inputs

log = logging.getLogger("mlx_prefix.server")

EMBED_FIELDS = frozenset({"model", "input", "truncate", "dimensions", "options", "keep_alive"})
EMBEDDINGS_FIELDS = frozenset({"model", "prompt", "options", "keep_alive"})
EMBEDDING_STAYS = (
    "keep_alive: the embedding model stays loaded for the server's life; send a negative "
    "keep_alive or none"
)


@api
async def embed(request: Request) -> Response:
    body = await read_json(request)
    refuse_unknown(body, EMBED_FIELDS, what="/api/embed")
    texts = body.get("input")
    if texts is None or texts == []:
        texts = []
    elif not isinstance(texts, (str, list)):
        raise InvalidRequest(
            f"'input' must be a string or an array of strings, not {json_type(texts)}",
            param="input",
        )
    truncate = bool(field(body, "truncate", bool, True))
    model, vectors, tokens, began = await _vectors(
        request, body, texts, body.get("dimensions"), truncate
    )
    return JSONResponse(
        {
            "model": model,
            "embeddings": vectors,
            "total_duration": ns(time.perf_counter() - began),
            "load_duration": 0,  # the embedding model is loaded with the server
            "prompt_eval_count": tokens,
        }
    )


@api
async def embeddings(request: Request) -> Response:
    body = await read_json(request)
    refuse_unknown(body, EMBEDDINGS_FIELDS, what="/api/embeddings")
    prompt = field(body, "prompt", str, "")
    _, vectors, _, _ = await _vectors(request, body, [prompt] if prompt else [], None, True)
    return JSONResponse({"embedding": vectors[0] if vectors else []})


async def _vectors(
    request: Request, body: dict[str, Any], texts: Any, dimensions: Any, truncate: bool
) -> tuple[str, list[list[float]], int, float]:
    """The served name, the vectors, the tokens embedded, and when the request began."""
    st = state(request)
    began = time.perf_counter()
    record = RequestLog(
        new_id("embd-"), request.url.path, st.metrics, namespace=caller(request).namespace_id
    )
    try:
        served = require(st.embeddings)
        name = field(body, "model", str, None)
        if not name:
            raise InvalidRequest("model is required", param="model")
        served.select(_untagged(served, name), st.models.names)
        if parse_keep_alive(body.get("keep_alive")) not in (None, FOREVER):
            raise InvalidRequest(EMBEDDING_STAYS, param="keep_alive")
        options = field(body, "options", dict, None)
        if options:
            log.debug("%s options ignored: %s", record.request_id, ", ".join(sorted(options)))
        if not texts:
            record.write("200")
            return listed_name(served.id), [], 0, began
        req = parse_embeddings(
            {"input": texts, "dimensions": dimensions}, st.settings.embedding_max_inputs
        )
        vectors = await embed_inputs(st, served, req, record, truncate)
    except MlxPrefixError as e:
        record.write(str(e.status), error=e.message)
        raise
    record.write("200")
    return listed_name(served.id), [v.tolist() for v in vectors], record.prompt_tokens, began


def _untagged(served: ServedEmbeddings, name: str) -> str:
    """`name` without an Ollama tag when only the bare name selects the model."""
    base, sep, _ = name.rpartition(":")
    if sep and base and served.names.find(name) is None and served.names.find(base) is not None:
        return base
    return name
