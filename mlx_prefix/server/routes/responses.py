"""Responses API routes: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request's prompt is its instructions (a system message), the conversation of its
`previous_response_id` (from the store), then its own input. Stored responses belong to
the caller's cache namespace (server/namespaces.py, before any cache_salt): another
namespace's id is a 404 for GET, DELETE and previous_response_id alike. Its tool calls are named
after its id, as the engine's next-turn prefetch names them, so an agent's next turn
(sent back as items, or chained by id) restores the whole history from the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_prefix.conversation import Conversation
from mlx_prefix.errors import InvalidRequest, MlxPrefixError
from mlx_prefix.records import DoneEvent, ToolCallIds

from ..assembler import Assembler, Delta
from ..generation import Collected, RequestLog
from ..namespaces import caller
from ..protocol.request import fit_to_model
from ..protocol.response_items import reply_messages
from ..protocol.responses import ResponsesRequest, parse_responses
from ..response_store import ResponseNotFound, StoredResponse
from ..responses_api_objects import OutputEvents, ResponseHead, new_id
from ..sse import event as sse
from ..tool_choice import with_tool_choice
from .common import api, model_for, read_json, state
from .flow import respond, submit


@api
async def create_response(request: Request) -> Response:
    st = state(request)
    response_id = new_id("resp")
    who = caller(request)
    record = RequestLog(response_id, request.url.path, st.metrics, who.namespace_id)
    try:
        body = await read_json(request)
        limits = st.limits_named(body)
        parsed = parse_responses(body, limits)
        served = await model_for(request, parsed.model)
        tokenizer = served.engine.model.tokenizer
        history = _history(st.responses, who.namespace, parsed)
        req = parsed.generation(history, ToolCallIds(response_id))
        req = with_tool_choice(fit_to_model(req, st.limits_for(served.engine, limits)), tokenizer)
        req = replace(req, cache=replace(req.cache, namespace=who.namespace))
        handle = await submit(served.engine, req, response_id)
    except MlxPrefixError as e:
        record.write(str(e.status), error=e.message)
        raise
    head = ResponseHead(
        id=response_id,
        model=served.id,
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
            turn = (*history, *parsed.input, *reply_messages(body["output"]))
            st.responses.put(who.namespace, response_id, StoredResponse(body, turn))

    assembler = Assembler.for_request(req, tokenizer, streaming=False, handle=handle)

    def whole(result: Collected, finish: str) -> dict[str, Any]:
        for delta in result.deltas:
            output.add(delta)
        output.reasoning_tokens = assembler.reasoning_tokens
        body = output.finish(result.done)[-1]["response"]
        save(body)
        return body

    shaper = ResponsesStream(output, save, assembler)
    return await respond(request, st, handle, req, record, assembler, shaper, whole)


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


def _history(store: Any, namespace: str, req: ResponsesRequest) -> Conversation:
    if req.previous_response_id is None:
        return ()
    stored = store.get(namespace, req.previous_response_id)
    if stored is None:
        raise ResponseNotFound(
            f"Previous response with id '{req.previous_response_id}' not found (never "
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


@dataclass
class ResponsesStream:
    """The Responses SSE stream of one request (a generation.StreamShaper); the finished
    response is stored before its last event goes out, so the client can chain on it."""

    output: OutputEvents
    save: Callable[[dict[str, Any]], None]
    assembler: Assembler  # counts the reply's reasoning tokens

    def opening(self) -> list[bytes]:
        return [sse(e) for e in self.output.start()]

    def delta(self, delta: Delta) -> list[bytes]:
        return [sse(e) for e in self.output.add(delta)]

    def closing(self, done: DoneEvent, finish: str) -> list[bytes]:
        self.output.reasoning_tokens = self.assembler.reasoning_tokens
        events = self.output.finish(done)
        self.save(events[-1]["response"])
        return [sse(e) for e in events]

    def failure(self, error: MlxPrefixError) -> list[bytes]:
        return [sse(self.output.fail(error.message))]
