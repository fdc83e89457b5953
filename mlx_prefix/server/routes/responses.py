"""The Responses family's routes: POST /v1/responses, GET and DELETE /v1/responses/{id}.
The body is protocol/responses/bodies.py's, the preamble and the reply every generation route's
(routes/flow.py), the response object and its events replies/responses.py's.

A request's prompt is its instructions (a system message), the conversation of its
`previous_response_id` (from the store), then its own input. Stored responses belong to
the caller's cache namespace (server/guards/namespaces.py, before any cache_salt):
another namespace's id is a 404 for GET, DELETE and previous_response_id alike. Its tool
calls are named after its id, as the engine's next-turn prefetch names them, so an
agent's next turn (sent back as items, or chained by id) restores the whole history from
the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_prefix.conversation import Conversation
from mlx_prefix.errors import InvalidRequest
from mlx_prefix.records import ToolCallIds

from ..guards.namespaces import Caller, caller
from ..protocol.request import GenerationRequest
from ..protocol.responses.bodies import ResponsesRequest, parse_responses
from ..protocol.responses.items import reply_messages
from ..replies.ids import new_id
from ..replies.responses import OutputEvents, ReplyMeta, ResponsesWriter
from ..responses_store import ResponseNotFound, ResponseStore, StoredResponse
from .common import api, state
from .flow import start


@api
async def create_response(request: Request) -> Response:
    st = state(request)
    ids = ToolCallIds(new_id("resp_"))
    chain = _Chain(st.responses, ids)
    call = await start(request, ids, parse_responses, chain.into)
    parsed = call.parsed
    head = ReplyMeta(
        id=call.request_id,
        model=call.served.id,
        instructions=parsed.instructions,
        max_output_tokens=parsed.max_output_tokens,
        previous_response_id=parsed.previous_response_id,
        store=parsed.store,
        temperature=parsed.sampling.temperature,
        top_p=parsed.sampling.top_p,
        echo=parsed.echo,
    )
    single_call = not parsed.parallel_tool_calls
    output = OutputEvents(head, parsed.sampling.logprobs, single_call=single_call)

    def save(body: dict[str, Any]) -> None:
        if parsed.store:
            turn = (*chain.history, *parsed.input, *reply_messages(body["output"]))
            st.responses.put(call.caller.namespace, call.request_id, StoredResponse(body, turn))

    assembler = call.assembler(streaming=False)
    return await call.respond(assembler, ResponsesWriter(output, save, assembler))


@api
async def get_response(request: Request) -> Response:
    _no_query(request)
    stored = state(request).responses.get(
        caller(request).namespace, request.path_params["response_id"]
    )
    if stored is None:
        raise _not_found(request.path_params["response_id"])
    return JSONResponse(stored.body)


@api
async def delete_response(request: Request) -> Response:
    _no_query(request)
    response_id = request.path_params["response_id"]
    if not state(request).responses.delete(caller(request).namespace, response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@dataclass
class _Chain:
    """The conversation a request continues: its previous_response_id's, read from the
    store once the model is known (in the caller's namespace), kept to store the new
    turn after it."""

    store: ResponseStore
    ids: ToolCallIds
    history: Conversation = ()

    def into(self, parsed: ResponsesRequest, who: Caller) -> GenerationRequest:
        """`parsed` as the engine's request (start's `generation`)."""
        self.history = self._read(who.namespace, parsed.previous_response_id)
        return parsed.generation(self.history, self.ids)

    def _read(self, namespace: str, previous: str | None) -> Conversation:
        if previous is None:
            return ()
        stored = self.store.get(namespace, previous)
        if stored is None:
            raise ResponseNotFound(
                f"Previous response with id '{previous}' not found (never "
                "stored with store: true, or since evicted or deleted).",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return stored.history


def _not_found(response_id: str) -> ResponseNotFound:
    return ResponseNotFound(f"Response with id '{response_id}' not found.")


def _no_query(request: Request) -> None:
    for name in request.query_params:
        raise InvalidRequest(f"query parameter {name!r} is not supported", param=name)
