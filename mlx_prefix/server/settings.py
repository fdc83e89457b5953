"""HTTP server settings: one frozen record, filled by the CLI or by tests."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    # Origins allowed besides the defaults (loopback pages, browser extensions):
    # exact origins such as "https://app.example.com", or "*" for any.
    allowed_origins: tuple[str, ...] = ()
    api_key: str | None = None  # when set, /v1/* requires `Authorization: Bearer <key>`
    max_body_bytes: int = 4 * 1024 * 1024
    log_level: str = "info"
    default_max_tokens: int = 512  # when a request names neither max_tokens form
    max_tokens_limit: int = 1_000_000  # hard cap when the model's context length is unknown
    shutdown_grace_s: float = 10.0  # in-flight requests get this long, then are cancelled
