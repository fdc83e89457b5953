"""The dashboard: GET / (redirect), GET /dashboard (the page) and its static files,
GET /v1/dashboard (its data), and the single-entry actions
POST /v1/cache/entries/{id}/pin and DELETE /v1/cache/entries/{id}. Flush and warm are
the API's own DELETE /v1/cache and POST /v1/cache/warm.

Who may read and act (the API's own rules, server/guards/middleware.py):
- a page from a refused origin gets a 403 before anything runs, and the page's data
  and actions are under /v1/, so they need the API key when one is set (the page asks
  for it and keeps it in sessionStorage);
- actions are POST (with a JSON body, which a page can only send after a CORS
  preflight) or DELETE (always preflighted): no form or image tag can trigger one;
- a Host header naming neither this machine nor an allowed host is refused before
  any route runs (server/guards/hosts.py): a browser sends no Origin with a same-origin GET,
  so without it a page on a hostile name re-pointed at 127.0.0.1 (DNS rebinding) would
  be "same origin" and could read the text heads of cached prompts;
- the page and its files are served with a Content-Security-Policy that allows only
  its own scripts and connections and forbids framing it (no clickjacking).
"""

from __future__ import annotations

import functools
import importlib.resources

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from mlx_prefix.errors import InvalidRequest

from ..guards.body import read_json
from ..guards.namespaces import caller
from ..monitor import dashboard as D
from .common import api, state

_STATIC = {  # name -> media type: the only files served
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "uplot/uPlot.iife.min.js": "text/javascript; charset=utf-8",  # uPlot 1.6.32, MIT
    "uplot/uPlot.min.css": "text/css; charset=utf-8",
}
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@functools.cache
def _static(name: str) -> bytes:
    # One step per joinpath: Python 3.10's Traversable takes a single child.
    static = importlib.resources.files("mlx_prefix.server.monitor").joinpath("static")
    return static.joinpath(name).read_bytes()


async def root(request: Request) -> Response:
    return RedirectResponse("/dashboard", status_code=307)


async def page(request: Request) -> Response:
    return _file("dashboard.html")


async def static(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in _STATIC:
        return Response("not found", status_code=404, media_type="text/plain")
    return _file(name)


def _file(name: str) -> Response:
    return Response(_static(name), media_type=_STATIC[name], headers=_HEADERS)


@api
async def data(request: Request) -> Response:
    st = state(request)
    body = await run_in_threadpool(
        D.snapshot,
        st.engine,
        recent=st.metrics.recent,
        shapes=st.tree_shapes,
        caller=caller(request),
        explainer=st.metrics.explainer,
    )
    return JSONResponse(body, headers={"Cache-Control": "no-store"})


@api
async def pin(request: Request) -> Response:
    body = await read_json(request)
    pinned = body.get("pinned")
    if set(body) != {"pinned"} or not isinstance(pinned, bool):
        raise InvalidRequest('send {"pinned": true} or {"pinned": false}', param="pinned")
    entry_id = request.path_params["entry_id"]
    await run_in_threadpool(D.set_pinned, state(request).engine, caller(request), entry_id, pinned)
    return JSONResponse({"entry_id": entry_id, "pinned": pinned})


@api
async def evict(request: Request) -> Response:
    entry_id = request.path_params["entry_id"]
    await run_in_threadpool(D.evict, state(request).engine, caller(request), entry_id)
    return JSONResponse({"entry_id": entry_id, "evicted": True})
