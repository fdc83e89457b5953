"""Talking to a running server from the CLI (`ps`, `rm`, `launch`): its address, its
key, and GET of its JSON, with the standard library only."""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from typing import Any

from mlx_prefix.errors import MlxPrefixError

URL_ENV = "MLX_PREFIX_URL"


def url_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        default=None,
        help=f"the server's address (default ${URL_ENV}, else http://HOST:PORT from "
        "MLX_PREFIX_SERVER_HOST / _PORT, else http://127.0.0.1:8080)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="the server's --api-key (default $MLX_PREFIX_SERVER_API_KEY)",
    )


def server_url(url: str | None) -> str:
    if url or (url := os.environ.get(URL_ENV)):
        return url.rstrip("/")
    host = os.environ.get("MLX_PREFIX_SERVER_HOST", "127.0.0.1")
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    port = os.environ.get("MLX_PREFIX_SERVER_PORT", "8080")
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def api_key(key: str | None) -> str | None:
    return key or os.environ.get("MLX_PREFIX_SERVER_API_KEY") or None


def get_json(url: str, path: str, key: str | None = None, timeout: float = 10.0) -> Any:
    """GET `url + path` as JSON; None when nothing listens there. MlxPrefixError for an
    answer that is an error (a wrong key, another program on the port)."""
    request = urllib.request.Request(url + path, headers={"Accept": "application/json"})
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            body = response.read()
    except urllib.error.HTTPError as e:
        detail = _error_message(e.read())
        hint = " (pass --api-key)" if e.code == 401 else ""
        raise MlxPrefixError(f"{url}{path} answered HTTP {e.code}: {detail}{hint}") from None
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None
    try:
        return json.loads(body)
    except ValueError:
        raise MlxPrefixError(f"{url}{path} did not answer JSON: is it mlx-prefix?") from None


def _error_message(body: bytes) -> str:
    try:
        error = json.loads(body).get("error")
        return error.get("message", "") if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")
