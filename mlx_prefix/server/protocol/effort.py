"""How long a reply may reason, from OpenAI-style fields -> the template's thinking
switch and a reasoning budget (SamplingParams.reasoning_budget: the server closes the
think block once the reply has reasoned that many tokens, as the template closes one).

- `reasoning_effort` (chat) and `reasoning.effort` (Responses), OpenAI's levels: "none"
  turns the template's thinking off (`enable_thinking: false`) and closes any block the
  prompt still opens at once (budget 0); "minimal", "low" and "medium" bound the
  reasoning at 256, 1024 and 4096 tokens; "high" and "xhigh" leave it unbounded (a
  local model reasons as long as it likes by default).
- `thinking_token_budget` (chat; vLLM's name): the budget itself, which wins over the
  effort's.
The client's own `chat_template_kwargs` win over the effort's switch. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_prefix.errors import InvalidRequest

EFFORT_BUDGETS: dict[str, int | None] = {
    "none": 0,
    "minimal": 256,
    "low": 1024,
    "medium": 4096,
    "high": None,
    "xhigh": None,
}


@dataclass(frozen=True)
class Thinking:
    """How a request bounds its reasoning, whichever family's fields said so (this
    module's efforts, Anthropic's `thinking`, Ollama's `think`)."""

    enable: bool | None = None  # the template's enable_thinking; None: the template's default
    budget: int | None = None  # reasoning tokens before the block is closed; None: unbounded
    show: bool = True  # the reasoning's text goes out (Anthropic's display "omitted": False)

    @property
    def template_kwargs(self) -> dict[str, Any]:
        return {} if self.enable is None else {"enable_thinking": self.enable}

    def kwargs_under(self, client: dict[str, Any]) -> dict[str, Any]:
        """The request's template arguments: the client's own over this switch."""
        return {**self.template_kwargs, **client}


def effort_bound(value: Any, param: str) -> Thinking:
    """An effort level (None: not sent) as a bound; InvalidRequest naming `param`."""
    if value is None:
        return Thinking()
    if value not in EFFORT_BUDGETS:
        raise InvalidRequest(f"{param} must be one of {', '.join(EFFORT_BUDGETS)}", param=param)
    return Thinking(enable=False if value == "none" else None, budget=EFFORT_BUDGETS[value])


def token_budget(value: Any, param: str) -> int | None:
    """A budget in tokens (None: not sent); InvalidRequest naming `param`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequest(f"{param} must be a non-negative integer", param=param)
    return value
