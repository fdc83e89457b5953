"""Server-sent events as every API family writes them: one `data:` line of JSON per
event, named after its `type` where the family names events (Anthropic's Messages and
OpenAI's Responses), unnamed where it does not (chat and completion chunks, which end
with OpenAI's `[DONE]` marker). The routes stream these bytes through routes/flow.py,
which also watches for the client going away."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"  # OpenAI's chat/completion streams end with it


def event(payload: dict[str, Any], named: bool = True) -> bytes:
    """One event: `event: <payload type>` (when `named`) and its JSON data."""
    data = json.dumps(payload, ensure_ascii=False)
    return (f"event: {payload['type']}\n" if named else "").encode() + f"data: {data}\n\n".encode()


def chunk(payload: dict[str, Any]) -> bytes:
    """One unnamed event (an OpenAI chat or completion chunk)."""
    return event(payload, named=False)
