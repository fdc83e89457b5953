"""The chat template a model is served with, and the arguments every request renders it
with: mlx_lm.server's --chat-template, --use-default-chat-template and
--chat-template-args.

The template is part of the model's cache identity (models/identity.py hashes the one
the tokenizer ends up with), so entries rendered under another template never match.
The default arguments change the rendered tokens themselves, so they need no key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlx_prefix.errors import InvalidRequest

# The template transformers applied to tokenizers without one until it dropped
# `default_chat_template` (4.43): ChatML. mlx_lm.server's --use-default-chat-template
# still reads that attribute, which no longer exists.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def template_text(value: str) -> str:
    """`value` is a template, or the path of a file holding one."""
    path = Path(value).expanduser()
    if "{" not in value and path.is_file():
        return path.read_text(encoding="utf-8")
    if "{" not in value:
        raise InvalidRequest(
            f"--chat-template {value!r} is neither a Jinja template nor a file",
            param="chat_template",
        )
    return value


def template_args(value: str | None) -> dict[str, Any]:
    """--chat-template-args: a JSON object, or nothing."""
    if value is None or not value.strip():
        return {}
    try:
        args = json.loads(value)
    except json.JSONDecodeError as e:
        raise InvalidRequest(
            f"--chat-template-args is not JSON: {e}", param="chat_template_args"
        ) from None
    if not isinstance(args, dict):
        raise InvalidRequest(
            "--chat-template-args must be a JSON object, e.g. '{\"enable_thinking\": false}'",
            param="chat_template_args",
        )
    return args


def ensure_template(tokenizer: Any, use_default: bool) -> None:
    """Give a tokenizer without a chat template ChatML when asked to."""
    if use_default and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML
