"""The agent session of `messages_agent` with the billing header Claude Code sends in
interactive sessions since 2.1.29: its `cch=` changes on every request. A server that
renders the header first (mlx_lm.server behind a translating proxy) loses the whole
prefix on every turn; mlx-prefix leaves the header out of the prompt. Another reference
text than `messages_agent`'s, so neither server starts with the other session's cache.
"""

from __future__ import annotations

import httpx

from ..harness import Context, ServerResult
from ..profiles import Sizes
from ..servers import Server
from . import messages_agent

NAME = "messages_agent_cch"
TITLE = "Agent session over /v1/messages, rotating billing header"
ASKED = "as messages_agent, with Claude Code's per-request `cch=` billing header"
_OFFSET = 20000


def describe(s: Sizes) -> str:
    return messages_agent.describe(s) + "; a new `cch=` in the billing header every request"


async def run(ctx: Context, server: Server, client: httpx.AsyncClient) -> ServerResult:
    return await messages_agent.run_session(
        ctx, server, client, rotating_header=True, offset=_OFFSET
    )
