"""Where a prompt stopped matching, in words: the message it lies in, and the texts
either side of it (what was stored, what was sent), each at most TEXT_CHARS characters.

The message is counted from the template's message-start tokens (the chunk grid's
segment tokens: `<|im_start|>` in ChatML, `<|end_header_id|>` in Llama 3): exact where
the template writes one per message, a close guess where it merges messages (tool
results in one turn) or adds its own (a default system prompt, which is discounted).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from mlx_prefix.cache.token_ids import WIDTH, ids, packed
from mlx_prefix.vision.key import readable

if TYPE_CHECKING:
    from mlx_prefix.prompt.request.grid import ChunkGrid

TEXT_CHARS = 120  # the most either text may hold
LEAD_CHARS = 40  # of which the text before the divergence (shared by both)
LEAD_TOKENS = 24  # decoded, then cut to LEAD_CHARS
TAIL_TOKENS = 32


@dataclass(frozen=True, slots=True)
class Location:
    message: int  # index into the request's messages; len(messages): the generation prompt
    role: str


def location(
    grid: ChunkGrid, tokens: Sequence[int], messages: Sequence[Any] | None, position: int
) -> Location | None:
    """The message of `messages` that token `position` of `tokens` (their render) lies in;
    None for a raw prompt or a template without message-start tokens."""
    if not messages or not grid.segment_tokens:
        return None
    array = np.frombuffer(packed(tokens), dtype=np.int64)
    marks = np.isin(array, np.fromiter(grid.segment_tokens, dtype=np.int64))
    total = int(marks.sum())
    # One start per message and one for the generation prompt; more: the template's own
    # messages ahead of the client's (a default system prompt).
    extra = max(0, total - len(messages) - 1)
    index = int(marks[: position + 1].sum()) - 1 - extra
    index = min(max(index, 0), len(messages))
    role = messages[index].role if index < len(messages) else "assistant"
    return Location(index, str(role))


def around(tokenizer: Any, sequence: Sequence[int], position: int) -> str:
    """The text of `sequence` around token `position`: a little of what comes before it
    (at most LEAD_CHARS characters), then what follows, TEXT_CHARS characters at most."""
    start = max(0, position - LEAD_TOKENS)
    lead = _decode(tokenizer, sequence[start:position])
    whole = _decode(tokenizer, sequence[start : position + TAIL_TOKENS])
    if not whole.startswith(lead):  # the pieces decode otherwise apart: the whole, cut
        return whole[:TEXT_CHARS]
    return (lead[-LEAD_CHARS:] + whole[len(lead) :])[:TEXT_CHARS]


def stored_ids(raw: bytes, start: int, end: int) -> tuple[int, ...]:
    """Tokens [start, end) of a packed sequence."""
    return ids(raw[start * WIDTH : end * WIDTH])


def window(raw: bytes, position: int) -> tuple[tuple[int, ...], int]:
    """The tokens of a packed sequence that `around` reads at `position`, and where
    `position` falls in them: the text needs no more of a long sequence."""
    start = max(0, position - LEAD_TOKENS)
    return stored_ids(raw, start, position + TAIL_TOKENS), position - start


def reply_came_back(tokenizer: Any, reply: Sequence[int], sent: Sequence[int]) -> bool:
    """Whether `sent` (the prompt from where a reply was generated on) starts with that
    reply's text, edges' whitespace aside: then a divergence inside it is only the
    tokenizer splitting the same text otherwise, not a changed turn."""
    text = _decode(tokenizer, reply).strip()
    got = _decode(tokenizer, sent[: len(reply) + 16]).lstrip()
    return got.startswith(text)


def _decode(tokenizer: Any, tokens: Sequence[int]) -> str:
    """The text of `tokens`, an image's span (its key values: vision/key.py) as `[image]`."""
    return readable(tokens, lambda text: _decode_ids(tokenizer, text))


def _decode_ids(tokenizer: Any, tokens: list[int]) -> str:
    try:
        return str(tokenizer.decode(tokens))
    except Exception:  # a tokenizer that cannot decode a bare slice: no text
        return ""
