"""One streamed, greedy request over HTTP, timed client-side."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx


class Endpoint(Protocol):
    """A running server, as a request needs it."""

    @property
    def url(self) -> str: ...

    @property
    def request_model(self) -> str | None: ...  # the `model` to name (None: leave it out)


@dataclass(slots=True)
class Reply:
    text: str  # content + reasoning + tool-call arguments, in stream order
    prompt_tokens: int | None
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens, if reported
    completion_tokens: int | None
    ttft_s: float | None  # request sent -> first chunk carrying output
    total_s: float  # request sent -> stream closed
    finish_reason: str | None = None
    # Seconds from request sent to each chunk carrying output, in arrival order: the
    # first is the TTFT, the gaps between them the inter-token latency (both servers
    # stream one chunk per token; a chunk the detokenizer held back joins the next).
    chunk_times: list[float] = field(default_factory=list)
    retries: int = 0  # connections that failed before any response (see send)

    @property
    def gaps_s(self) -> list[float]:
        """Inter-token latency: seconds between consecutive output-carrying chunks."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


@dataclass(frozen=True)
class Request:
    """A chat (messages) or raw-completion (prompt) request, server-independent."""

    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    tools: list[dict[str, Any]] | None = None
    max_tokens: int = 8
    extra: dict[str, Any] = field(default_factory=dict)

    def body(self, *, cold: bool = False, model: str | None = None) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.extra,
        }
        if model is not None:
            body["model"] = model
        if self.messages is not None:
            path, body["messages"] = "/v1/chat/completions", self.messages
            if self.tools:
                body["tools"] = self.tools
        else:
            path, body["prompt"] = "/v1/completions", self.prompt
        if cold:
            body["prefix_cache"] = {"enabled": False}  # mlx-prefix only
        return path, body


RETRIES = 2
# Failures of a connection before any response came back: the request was not served.
BEFORE_RESPONSE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


def _delta_text(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    if delta is None:  # /v1/completions chunks
        return choice.get("text") or ""
    parts = [delta.get(k) or "" for k in ("reasoning_content", "reasoning", "content")]
    for call in delta.get("tool_calls") or ():
        fn = call.get("function") or {}
        parts.append((fn.get("name") or "") + (fn.get("arguments") or ""))
    return "".join(p for p in parts if isinstance(p, str))


async def send(
    client: httpx.AsyncClient, to: Endpoint | str, request: Request, *, cold: bool = False
) -> Reply:
    """`request` streamed to a server (or a base URL: no `model` named), timed."""
    base_url, model = (to, None) if isinstance(to, str) else (to.url, to.request_model)
    path, body = request.body(cold=cold, model=model)
    start = time.perf_counter()  # a retried connection's time counts
    for retries in range(RETRIES + 1):
        responded = False
        try:
            async with client.stream("POST", base_url + path, json=body, timeout=None) as resp:
                responded = True
                return await _read(resp, f"{base_url}{path}", start, retries)
        except BEFORE_RESPONSE as e:
            # A kept-alive connection the server dropped under load (mlx_lm.server's
            # ThreadingHTTPServer listens with a backlog of 5): send the request again.
            if responded or retries == RETRIES:
                raise RuntimeError(f"{base_url}{path}: {e!r} (try {retries + 1})") from e
    raise AssertionError("unreachable")


async def _read(resp: httpx.Response, where: str, start: float, retries: int) -> Reply:
    if resp.status_code != 200:
        detail = (await resp.aread()).decode(errors="replace")[:500]
        raise RuntimeError(f"{where}: HTTP {resp.status_code}: {detail}")
    texts: list[str] = []
    usage: dict[str, Any] = {}
    finish = None
    times: list[float] = []
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators and ': keepalive' comments
        data = line[5:].strip()
        if data == "[DONE]":
            break
        arrived = time.perf_counter() - start
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"{where}: {chunk['error']}")
        carried = False
        for choice in chunk.get("choices") or ():
            text = _delta_text(choice)
            if text:
                carried = True
                texts.append(text)
            finish = choice.get("finish_reason") or finish
        if carried:
            times.append(arrived)
        if chunk.get("usage"):
            usage = chunk["usage"]
    total = time.perf_counter() - start
    details = usage.get("prompt_tokens_details") or {}
    return Reply(
        text="".join(texts),
        prompt_tokens=usage.get("prompt_tokens"),
        cached_tokens=details.get("cached_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        ttft_s=times[0] if times else None,
        total_s=total,
        finish_reason=finish,
        chunk_times=times,
        retries=retries,
    )
