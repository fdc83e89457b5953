"""What every generation route shares, whatever its API family, written once.

`start` is the preamble, always in this order: who called (their cache namespace) and
the request's one log line; the body read (guards/body.py) and parsed by the family's
parser (images: their headers only), under the server's limits with the defaults the
settings file gives the model it names (ServerState.limits_named); the served model it
names, loaded if need be; the request as the engine takes it (its images checked whole,
the family's GenerationRequest, its reply's tool calls named after the request, in the
caller's namespace, its reply bounded by the model's context, a forced tool choice
opened); submitted. A failure on the way writes the log
line and is raised, to leave in the family's error shape (common.api).

`start` is `open_call` (caller to model) then `Opened.prepared` and `Opened.submit`; a
family with steps of its own before the engine (Ollama's) calls the three itself, and
one that may answer before its model is looked up (Ollama's unload) splits `open_call`
into `read_call` and `Read.open`.

`Started.respond` is the reply: SSE through the family's writer when streaming (or the
family's own framing: Ollama's NDJSON), else the collected reply as the writer's `whole`
body; the log line is written either way.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlx_prefix.errors import ContextLengthExceeded, InvalidRequest, MlxPrefixError
from mlx_prefix.records import PromptInput, ToolCallIds
from mlx_prefix.vision.intake import ImageLimits, check_request

from ..guards.body import read_json
from ..guards.namespaces import Caller, caller
from ..protocol.request import GenerationRequest, Limits, fit_to_model
from ..replies.assembler import Assembler
from ..replies.sse import SSEResponse
from ..replies.stream import ClientGone, ReplyWriter, RequestLog, collect, stream_events
from ..served.names import ServedModel
from .common import ServerState, model_for, state
from .tool_choice import with_tool_choice

if TYPE_CHECKING:
    from mlx_prefix.engine.interface import EngineAPI
    from mlx_prefix.engine.requests.handle import RequestHandle

# (the stream's bytes, what to run however it ends) -> the streaming response
StreamResponse = Callable[[AsyncIterator[bytes], Callable[[], None]], Response]


class NamesModel(Protocol):
    """A parsed body: the served model it asks for."""

    @property
    def model(self) -> str | None: ...  # as the client named it; None: the default

    @property
    def adapter(self) -> str | None: ...  # a LoRA adapter folder (mlx_lm.server's `adapters`)


P = TypeVar("P", bound=NamesModel)


@dataclass(frozen=True)
class Started(Generic[P]):
    """A generation request submitted to its served model's engine."""

    request: Request
    state: ServerState
    caller: Caller
    record: RequestLog  # the request's one log line, written once it ends
    parsed: P  # the body as the family's parser read it
    served: ServedModel
    req: GenerationRequest  # as the engine took it
    handle: RequestHandle

    @property
    def request_id(self) -> str:
        return self.record.request_id

    @property
    def tokenizer(self) -> Any:
        return self.served.engine.model.tokenizer

    def assembler(self, streaming: bool) -> Assembler:
        """The reply's deltas as the prompt left it; `streaming`: tool calls carry the
        `index` of OpenAI's chunks."""
        engine = self.served.engine
        return Assembler.for_request(
            self.req, engine.reply_format, self.tokenizer, streaming, self.handle
        )

    async def respond(
        self, assembler: Assembler, writer: ReplyWriter, stream: StreamResponse = SSEResponse
    ) -> Response:
        """`writer`'s bytes when streaming (SSE; `stream` frames another format: Ollama's
        NDJSON, replies/ndjson.py), else the collected reply as its `whole`."""
        st, handle, record = self.state, self.handle, self.record
        record.prompt_tokens = handle.prompt_tokens
        record.trace = handle.trace  # handed to the request explainer once it ends
        st.inflight.add(handle)
        if self.req.stream:

            def on_close() -> None:
                handle.cancel()
                st.inflight.discard(handle)
                record.write("client_disconnected")

            return stream(stream_events(handle, assembler, writer, record), on_close)
        try:
            result = await collect(handle, assembler, self.request)
        except MlxPrefixError as e:
            record.write(str(e.status), error=e.message)
            raise
        except ClientGone:
            record.write("client_disconnected")
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        except BaseException:
            record.write("client_disconnected")
            raise
        finally:
            handle.cancel()
            st.inflight.discard(handle)
        finish = assembler.finish_reason(result.done)
        record.write("200", result.done.usage, finish)
        return JSONResponse(writer.whole(result, finish))


def _as_is(parsed: Any, who: Caller) -> GenerationRequest:
    return parsed


def check_images(prompt: PromptInput, limits: ImageLimits, engine: Any) -> None:
    """The whole prompt's images, whatever family sent it (a Responses chain's earlier
    images included), from their headers alone, before the first is decoded (their
    digests, computed when the engine plans the prompt): --max-images,
    --max-request-pixels, and a model that takes none. Each refusal names the first
    image past the limit."""
    images = [image for m in prompt.messages or () for image in m.images]
    if not images:
        return
    params = [at.param or "messages" for at in images]
    check_request([at.image.image.pixel_count for at in images], params, limits)
    if getattr(engine.model, "vision", None) is None:
        raise InvalidRequest(
            f"{params[0]}: this model is text-only and cannot take images; serve a vision "
            "model (its folder has a vision_config) to send them",
            param=params[0],
            code="model_not_multimodal",
        )


@dataclass(frozen=True)
class Opened(Generic[P]):
    """The preamble's first half: the body parsed, its served model resident (a lease
    until the handler returns). A family with steps of its own between the model and
    the engine (Ollama's: a load without a prompt, options.num_ctx) takes them here,
    inside `logged`, then `prepared` and `submit`; the others call `start`."""

    request: Request
    state: ServerState
    caller: Caller
    record: RequestLog
    ids: ToolCallIds
    limits: Limits  # what the body was parsed under (ServerState.limits_named)
    parsed: P
    served: ServedModel

    def logged(self) -> contextlib.AbstractContextManager[None]:
        """A failure inside writes the request's log line, then leaves (common.api)."""
        return logged(self.record)

    def prepared(self, req: GenerationRequest) -> GenerationRequest:
        """`req` as the engine takes it: its images checked whole (`check_images`; none
        is decoded before the engine plans the prompt), its reply's tool calls named
        after the request, in the caller's namespace, its reply bounded by the model's
        context, a forced tool choice opened."""
        with self.logged():
            check_images(req.prompt, self.limits.images, self.served.engine)
            req = replace(
                req,
                prompt=replace(req.prompt, reply_tool_call_ids=self.ids),
                cache=replace(req.cache, namespace=self.caller.namespace),
            )
            engine = self.served.engine
            req = fit_to_model(req, self.state.limits_for(engine, self.limits))
            return with_tool_choice(req, engine.reply_format.tools)

    async def submit(self, req: GenerationRequest) -> Started[P]:
        """`req` (prepared) submitted to the served model's engine."""
        with self.logged():
            handle = await submit(self.served.engine, req, self.ids.seed)
        st, who, record = self.state, self.caller, self.record
        return Started(self.request, st, who, record, self.parsed, self.served, req, handle)


@dataclass(frozen=True)
class Read(Generic[P]):
    """The body read and parsed, its model not looked up yet: a family that may answer
    without the model (Ollama's unload of a model not loaded) decides here, else
    `open`s it."""

    request: Request
    state: ServerState
    caller: Caller
    record: RequestLog
    ids: ToolCallIds
    limits: Limits
    parsed: P

    def logged(self) -> contextlib.AbstractContextManager[None]:
        return logged(self.record)

    async def open(self) -> Opened[P]:
        """The parsed body's served model, loaded if need be (a lease until the handler
        returns)."""
        with self.logged():
            served = await model_for(self.request, self.parsed.model, self.parsed.adapter)
        st, who, record, ids = self.state, self.caller, self.record, self.ids
        return Opened(self.request, st, who, record, ids, self.limits, self.parsed, served)


async def read_call(
    request: Request,
    ids: ToolCallIds,
    parse: Callable[[dict[str, Any], Limits], P],
    model_name: Callable[[str], str] | None = None,
) -> Read[P]:
    """`open_call` without the model: caller, log line, body, parse."""
    st = state(request)
    who = caller(request)
    record = RequestLog(ids.seed, request.url.path, st.metrics, who.namespace_id)
    with logged(record):
        body = await read_json(request)
        if model_name is not None and isinstance(body.get("model"), str):
            body["model"] = model_name(body["model"])
        limits = st.limits_named(body)  # the named model's defaults from the settings file
        # Off the event loop: a body's image headers are read (and, with
        # --allow-image-urls, images fetched) while it is parsed, which must not hold up
        # other requests' streams. Nothing is decoded before `prepared` checked them all.
        parsed = await run_in_threadpool(parse, body, limits)
    return Read(request, st, who, record, ids, limits, parsed)


async def open_call(
    request: Request,
    ids: ToolCallIds,
    parse: Callable[[dict[str, Any], Limits], P],
    model_name: Callable[[str], str] | None = None,
) -> Opened[P]:
    """The preamble's first half (above): caller, log line, body, parse, model.
    `model_name`: how the family's clients spell a served model's name, to the server's
    (Ollama's `name:tag`), applied to the body's `model` before anything reads it."""
    read = await read_call(request, ids, parse, model_name)
    return await read.open()


async def start(
    request: Request,
    ids: ToolCallIds,
    parse: Callable[[dict[str, Any], Limits], P],
    generation: Callable[[P, Caller], GenerationRequest] = _as_is,
) -> Started[P]:
    """The preamble (above). `ids` names the request (its seed is the request id) and its
    reply's tool calls, as the engine's next-turn prefetch names them, so the client's
    next turn, which sends them back, finds its prefix cached. `generation` turns the
    parsed body into the engine's request once the model is known (as it is: the body
    was parsed into one)."""
    call = await open_call(request, ids, parse)
    with call.logged():
        req = generation(call.parsed, call.caller)
    return await call.submit(call.prepared(req))


@contextlib.contextmanager
def logged(record: RequestLog) -> Iterator[None]:
    try:
        yield
    except MlxPrefixError as e:
        record.write(str(e.status), error=e.message)
        raise


async def submit(engine: EngineAPI, req: GenerationRequest, request_id: str) -> RequestHandle:
    """engine.submit off the event loop. Shielded: a handle created while the caller was
    being cancelled must still be returned, or nobody would cancel it and the engine
    would decode for no one."""
    with anyio.CancelScope(shield=True):
        return await run_in_threadpool(_submit, engine, req, request_id)
    # A CancelScope swallows only its own cancellation: this one has no deadline and
    # nothing cancels it, so the body above returns or raises.
    raise AssertionError("unreachable")


def _submit(engine: EngineAPI, req: GenerationRequest, request_id: str) -> RequestHandle:
    """OpenAI's rule: a prompt and an explicit max_tokens that do not fit the context
    together are a 400 (the default max_tokens is clamped instead)."""
    try:
        return engine.submit(
            req.prompt,
            req.sampling,
            req.cache,
            request_id,
            fit_reply=req.fit_reply and req.max_tokens_param is not None,
            progress=req.return_progress,
        )
    except ContextLengthExceeded as e:
        if req.max_tokens_param is not None and req.max_tokens_param != "max_tokens":
            e.message = e.message.replace("max_tokens", req.max_tokens_param)
        raise
