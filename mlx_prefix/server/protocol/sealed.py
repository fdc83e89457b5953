"""Reasoning carried in a reply's opaque field, for clients that send that field back but
not the reasoning's text: Anthropic's `signature` of a thinking block sent with
`display: "omitted"`, the Responses API's `encrypted_content` of a reasoning item
(Codex sends its reasoning items back without their text). The next turn then renders
the reasoning the model wrote, as the next-turn prefetch did, and its prefix stays
cached. Not encrypted: a local server signs nothing, and a client could send the text
itself as well. Pure."""

from __future__ import annotations

import base64
import binascii

_PREFIX = "mlx-prefix-reasoning."


def seal(reasoning: str) -> str:
    return _PREFIX + base64.urlsafe_b64encode(reasoning.encode()).decode()


def unseal(value: str) -> str | None:
    """The reasoning `seal` put in `value`; None for anything else (another server's)."""
    if not value.startswith(_PREFIX):
        return None
    try:
        return base64.urlsafe_b64decode(value[len(_PREFIX) :]).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
