"""Responses API routes: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request's prompt is its instructions (a system message), the conversation of its
`previous_response_id` (from the store), then its own input. Its tool calls are named
after its id, as the engine's next-turn prefetch names them, so an agent's next turn
(sent back as items, or chained by id) restores the whole history from the cache.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import Any

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_prefix.errors import ContextLengthExceeded, InvalidRequest, MlxPrefixError
from mlx_prefix.prompt.tool_calls import ToolSyntax
from mlx_prefix.records import DoneEvent, ErrorEvent, PromptInput, TokenEvent, ToolCallIds

from ..assembler import Assembler
from ..errors import CancelledByServer, GenerationFailed
from ..generation import CANCELLED, ClientGone, RequestLog, as_error, until_disconnect
from ..namespaces import caller
from ..protocol.response_items import reply_messages
from ..protocol.responses import ResponsesRequest, parse_responses
from ..response_objects import OutputEvents, ResponseHead, new_id, sse
from ..response_store import ResponseNotFound, StoredResponse
from .common import api, read_json, resolve_model, state
from .generate import SSEResponse

log = logging.getLogger("mlx_prefix.server")


@api
async def create_response(request: Request) -> Response:
    st = state(request)
    response_id = new_id("resp")
    who = caller(request)
    record = RequestLog(response_id, request.url.path, st.metrics, who.namespace_id)
    try:
        req = parse_responses(await read_json(request), st.limits)
        req = replace(req, cache=replace(req.cache, namespace=who.namespace))
        model = resolve_model(st.engine, req.model)
        history = _history(st.responses, req)
        ids = ToolCallIds(response_id)
        prompt = req.prompt(history, ids)
        syntax = ToolSyntax.of(st.engine.model.tokenizer) if req.tools else None
        sampling = req.sampling
        if syntax is not None and syntax.end and not req.parallel_tool_calls:
            sampling = replace(sampling, stop=(syntax.end,))  # one call, then stop
        with anyio.CancelScope(shield=True):  # see routes/generate.py
            handle = await run_in_threadpool(_submit, st.engine, prompt, sampling, req, response_id)
    except MlxPrefixError as e:
        record.write(str(e.status), error=e.message)
        raise
    record.prompt_tokens = handle.prompt_tokens
    st.inflight.add(handle)
    assembler = Assembler.build(
        req.sampling.logprobs, syntax, prompt, streaming=False, tokenizer=st.engine.model.tokenizer
    )
    head = ResponseHead(
        id=response_id,
        model=model,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        previous_response_id=req.previous_response_id,
        store=req.store,
        temperature=req.sampling.temperature,
        top_p=req.sampling.top_p,
        echo=req.echo,
    )
    output = OutputEvents(head, req.sampling.logprobs, single_call=not req.parallel_tool_calls)

    def save(body: dict[str, Any]) -> None:
        if req.store:
            turn = (*history, *req.input, *reply_messages(body["output"]))
            st.responses.put(response_id, StoredResponse(body, turn))

    if req.stream:

        def on_close() -> None:
            handle.cancel()
            st.inflight.discard(handle)
            record.write("client_disconnected")

        return SSEResponse(_stream(handle, assembler, output, record, save), on_close)
    try:
        done = await _collect(handle, assembler, output, request)
    except MlxPrefixError as e:
        record.write(str(e.status), error=e.message)
        raise
    except ClientGone:
        record.write("client_disconnected")
        return Response(status_code=499)
    except BaseException:
        record.write("client_disconnected")
        raise
    finally:
        handle.cancel()
        st.inflight.discard(handle)
    body = output.finish(done)[-1]["response"]
    save(body)
    record.write("200", done.usage, done.finish_reason)
    return JSONResponse(body)


@api
async def get_response(request: Request) -> Response:
    _no_query(request)
    stored = state(request).responses.get(request.path_params["response_id"])
    if stored is None:
        raise _not_found(request.path_params["response_id"])
    return JSONResponse(stored.body)


@api
async def delete_response(request: Request) -> Response:
    _no_query(request)
    response_id = request.path_params["response_id"]
    if not state(request).responses.delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _history(store: Any, req: ResponsesRequest) -> tuple[dict[str, Any], ...]:
    if req.previous_response_id is None:
        return ()
    stored = store.get(req.previous_response_id)
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


def _submit(
    engine: Any, prompt: PromptInput, sampling: Any, req: ResponsesRequest, request_id: str
) -> Any:
    """engine.submit; an explicit max_output_tokens that does not fit is a 400 naming it."""
    explicit = req.max_output_tokens is not None
    try:
        return engine.submit(prompt, sampling, req.cache, request_id, fit_reply=explicit)
    except ContextLengthExceeded as e:
        e.message = e.message.replace("max_tokens", "max_output_tokens")
        raise


async def _collect(
    handle: Any, assembler: Assembler, output: OutputEvents, request: Request
) -> DoneEvent:
    async def events() -> DoneEvent | ErrorEvent | None:
        async with aclosing(handle.aevents()) as stream:
            async for event in stream:
                if not isinstance(event, TokenEvent):
                    return event
                output.add(assembler.feed(event))
        return None

    result = await until_disconnect(request, events, on_gone=handle.cancel)
    if isinstance(result, ErrorEvent):
        raise as_error(result)
    if result is None:
        raise GenerationFailed("the engine ended the request without a result")
    if result.finish_reason == "cancelled":
        raise CancelledByServer(CANCELLED)
    output.add(assembler.finish())
    return result


async def _stream(
    handle: Any,
    assembler: Assembler,
    output: OutputEvents,
    record: RequestLog,
    save: Callable[[dict[str, Any]], None],
) -> AsyncIterator[bytes]:
    status = "client_disconnected"  # stays so if the response task is cancelled mid-stream
    usage = finish = None
    try:
        for event in output.start():
            yield sse(event)
        try:
            async with aclosing(handle.aevents()) as events:
                async for event in events:
                    if isinstance(event, TokenEvent):
                        for e in output.add(assembler.feed(event)):
                            yield sse(e)
                    elif isinstance(event, DoneEvent):
                        if event.finish_reason == "cancelled":
                            status = "cancelled"
                            yield sse(output.fail(CANCELLED))
                            return
                        last = [*output.add(assembler.finish()), *output.finish(event)]
                        save(last[-1]["response"])  # before the client can chain on it
                        for e in last:
                            yield sse(e)
                        status, usage, finish = "200", event.usage, event.finish_reason
                        return
                    else:
                        status = "error"
                        log.error("%s generation failed: %s", record.request_id, event.message)
                        yield sse(output.fail(as_error(event).message))
                        return
            status = "error"
            yield sse(output.fail("the engine ended the stream without a result"))
        except Exception as e:  # the stream is the edge: report, never cut the connection
            status = "error"
            log.exception("%s generation failed", record.request_id)
            yield sse(output.fail(as_error(e).message))
    finally:
        handle.cancel()
        record.write(status, usage, finish)
