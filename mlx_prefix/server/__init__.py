"""OpenAI-compatible HTTP server (Starlette + uvicorn) in front of the engine."""

from __future__ import annotations

from .app import create_app, serve
from .settings import ServerSettings

__all__ = ["ServerSettings", "create_app", "serve"]
