"""POST /v1/embeddings (and /embeddings): OpenAI's embeddings API over the server's
--embedding-model. Parse the body, check the model name, tokenize in the threadpool
(bounded: inputs, tokens per input and per request), queue the ids on the embedding
worker's thread (embeddings/worker.py), then shape the vectors: floats or base64
(replies/embeddings.py).

Embeddings keep no cache, so there is nothing for a namespace to keep apart; the
caller's namespace goes into the log line as on the other routes."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_prefix.embeddings.model import EmbeddingModel, truncate
from mlx_prefix.errors import InvalidRequest, MlxPrefixError

from ..guards.body import read_json
from ..guards.namespaces import caller
from ..monitor.metrics import RequestLog
from ..protocol.embeddings import EmbeddingRequest, parse_embeddings
from ..replies.embeddings import embeddings_body
from ..replies.ids import new_id
from ..served.embeddings import ServedEmbeddings, require
from .common import ServerState, api, state

log = logging.getLogger("mlx_prefix.server")

DEFAULT_MAX_INPUT_TOKENS = 8192  # OpenAI's, for a model whose config names no context


@api
async def embeddings(request: Request) -> Response:
    st = state(request)
    record = RequestLog(
        new_id("embd-"), request.url.path, st.metrics, namespace=caller(request).namespace_id
    )
    try:
        body = await read_json(request)
        req = parse_embeddings(body, st.settings.embedding_max_inputs)
        served = require(st.embeddings)
        served.select(req.model, st.models.names)
        vectors = await embed(st, served, req, record)
    except MlxPrefixError as e:
        record.write(str(e.status), error=e.message)
        raise
    record.write("200")
    if req.user is not None:  # OpenAI's end-user id, for the operator's monitoring
        log.debug("%s user=%r", record.request_id, req.user[:256])
    body = embeddings_body(vectors, req.encoding_format, served.id, record.prompt_tokens)
    return JSONResponse(body)


async def embed(
    st: ServerState,
    served: ServedEmbeddings,
    req: EmbeddingRequest,
    record: RequestLog,
    cut: bool = False,
) -> np.ndarray:
    """`req`'s vectors from the embedding worker (each input cut to the model's context
    when `cut`), in the asked dimensions; the tokens counted on `record` and in the
    metrics. Shared by /v1/embeddings and Ollama's /api/embed. float32 [len(inputs), dims]."""
    model = served.worker.model
    dims = dimensions_for(model, req.dimensions)
    limit = st.settings.embedding_max_tokens
    rows = await run_in_threadpool(token_rows, model, req, limit, cut)
    record.prompt_tokens = sum(map(len, rows))
    vectors = await asyncio.wrap_future(served.worker.submit(rows))
    if dims != model.dimensions:
        vectors = truncate(vectors, dims, model.pooling.normalize)
    st.metrics.observe_embeddings(len(rows), record.prompt_tokens)
    return vectors


def dimensions_for(model: EmbeddingModel, asked: int | None) -> int:
    if asked is None or model.allowed_dimensions(asked):
        return asked or model.dimensions
    if not model.pooling.matryoshka:
        reason = (
            f"model '{model.name}' gives {model.dimensions}-dimensional vectors and was not "
            "trained for shorter ones (Matryoshka); start the server with "
            "--embedding-matryoshka if it was"
        )
    elif model.pooling.matryoshka_dimensions:
        sizes = ", ".join(map(str, (*model.pooling.matryoshka_dimensions, model.dimensions)))
        reason = f"model '{model.name}' gives vectors of {sizes} dimensions"
    else:
        reason = f"model '{model.name}' gives vectors of 1 to {model.dimensions} dimensions"
    raise InvalidRequest(f"'dimensions' {asked} is not supported: {reason}", param="dimensions")


def token_rows(
    model: EmbeddingModel, req: EmbeddingRequest, max_tokens: int, truncate: bool = False
) -> list[list[int]]:
    """Every input as token ids, checked: non-empty, in the vocabulary, within the model's
    context (`truncate`: cut to it, as Ollama's /api/embed does by default), and within
    `max_tokens` over the request."""
    if req.texts is not None:
        rows = model.tokenize(list(req.texts))
    else:
        rows = [list(ids) for ids in req.token_ids or ()]
        for i, ids in enumerate(rows):
            bad = next((t for t in ids if not 0 <= t < model.vocab_size), None)
            if bad is not None:
                raise InvalidRequest(
                    f"input[{i}] holds token id {bad}, outside the model's vocabulary "
                    f"(0 to {model.vocab_size - 1})",
                    param="input",
                )
    limit = model.context_length or DEFAULT_MAX_INPUT_TOKENS
    if truncate:
        rows = [ids[:limit] for ids in rows]
    for i, ids in enumerate(rows):
        if not ids:
            raise InvalidRequest(f"input[{i}] has no tokens", param="input")
        if len(ids) > limit:
            raise InvalidRequest(
                f"input[{i}] is {len(ids)} tokens; model '{model.name}' takes at most {limit} "
                "per input",
                param="input",
                code="context_length_exceeded",
            )
    total = sum(map(len, rows))
    if total > max_tokens:
        raise InvalidRequest(
            f"the inputs hold {total} tokens together; at most {max_tokens} per request",
            param="input",
        )
    return rows
