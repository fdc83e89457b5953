"""Reply ids: one maker for every family, its prefix and a random hex (OpenAI's
`chatcmpl-` / `cmpl-`, Anthropic's `msg_`, the Responses API's `resp_`, `msg_`, `rs_`,
`fc_`, embeddings' `embd-`). The reply's tool calls are named from it (records.ToolCallIds)."""

from __future__ import annotations

import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"
