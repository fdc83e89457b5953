"""OpenAI-compatible HTTP server (Starlette + uvicorn) in front of the engine.

The app is imported when one of its names is first asked for, so the pure parts below
(protocol/: request bodies -> records, which the library and CLI read chat dicts with)
import without the server and everything it serves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app, serve
    from .settings import ServerSettings

__all__ = ["ServerSettings", "create_app", "serve"]


def __getattr__(name: str) -> Any:
    if name in ("create_app", "serve"):
        from . import app

        return getattr(app, name)
    if name == "ServerSettings":
        from .settings import ServerSettings

        return ServerSettings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
