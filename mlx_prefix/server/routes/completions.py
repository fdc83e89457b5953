"""The completions family's route: POST /v1/completions (and its unprefixed twin). The
body is protocol/completions.py's (one raw text prompt); the preamble, the reply and its
shape are chat's (routes/chat.py, replies/chat.py with `kind` "completion": a choice's
text, no message)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from ..protocol.completions import parse_completion
from .chat import chat_shaped
from .common import api


@api
async def completions(request: Request) -> Response:
    return await chat_shaped(request, "completion", parse_completion)
