"""The tokens that end a reply, made EOS tokens where a model is loaded (models/load.py).

gpt-oss's harmony format (prompt/reply/harmony.py reads its replies): a reply ends at
<|return|> (its answer) or <|call|> (a tool call). Its generation_config.json lists them
as EOS; a folder converted without that file does not, and its replies would run on.
Pure: no MLX.
"""

from __future__ import annotations

from typing import Any

# Harmony's control tokens; a harmony tokenizer holds each as one token.
START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
CONTROL = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)


def harmony_stops(tokenizer: Any) -> tuple[int, int] | None:
    """<|return|> and <|call|>'s ids when the template writes channels and the tokenizer
    holds every control token as one token; None otherwise."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or CHANNEL not in template:
        return None
    ids = [tokenizer.encode(token, add_special_tokens=False) for token in CONTROL]
    if not all(len(i) == 1 for i in ids):
        return None
    by_token = dict(zip(CONTROL, (i[0] for i in ids), strict=True))
    return by_token[RETURN], by_token[CALL]


def add_reply_stops(tokenizer: Any) -> None:
    """Add the template's reply-ending tokens to the tokenizer's EOS tokens (mutates
    the tokenizer wrapper, once, as its model is loaded)."""
    if (stops := harmony_stops(tokenizer)) is not None:
        tokenizer.eos_token_ids = set(tokenizer.eos_token_ids) | set(stops)
