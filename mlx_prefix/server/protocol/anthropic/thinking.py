"""Anthropic's `thinking`, `output_config.effort` and `context_management` -> the
template's `enable_thinking` switch, whether the reasoning's text is shown, the reasoning
budget, and how many turns keep their thinking.

enabled / disabled / adaptive: the switch on / off / the template's default;
`budget_tokens` (any non-negative count below max_tokens: Anthropic's 1024 floor is a
billing rule) bounds the reasoning (engine/decode/reasoning_budget.py closes the block once
spent); disabled is a budget of 0, so a prompt that opens a think block anyway has it
closed at once. Effort "low" turns thinking off unless `thinking` enables it.
"""

from __future__ import annotations

from typing import Any

from mlx_prefix.errors import InvalidRequest, json_type

from ..effort import Thinking
from ..fields import field

EFFORTS = ("low", "medium", "high", "xhigh", "max")


def read_thinking(body: dict[str, Any], max_tokens: int | None) -> Thinking:
    """Off (disabled, or effort "low" without thinking enabled) is the template's switch
    off and a budget of 0, so a template without the switch is held to it too."""
    effort = (field(body, "output_config", dict, None) or {}).get("effort", "high")
    if effort not in EFFORTS:
        raise InvalidRequest(
            f"output_config.effort must be one of {', '.join(EFFORTS)}",
            param="output_config.effort",
        )
    thinking = field(body, "thinking", dict, None)
    if thinking is None or (effort == "low" and thinking.get("type") != "enabled"):
        return Thinking(enable=False, budget=0) if effort == "low" else Thinking()
    kind = thinking.get("type")
    display = thinking.get("display", "summarized")
    if display not in ("summarized", "omitted"):
        raise InvalidRequest(
            "thinking.display must be 'summarized' or 'omitted'", param="thinking.display"
        )
    if kind == "disabled":
        return Thinking(enable=False, budget=0)
    if kind == "adaptive":
        return Thinking(show=display != "omitted")
    if kind != "enabled":
        raise InvalidRequest(
            "thinking.type must be 'enabled', 'disabled' or 'adaptive'", param="thinking.type"
        )
    budget = thinking.get("budget_tokens")
    # Anthropic's floor of 1024 is a billing rule; a local model may think less.
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise InvalidRequest(
            "thinking.budget_tokens must be a non-negative integer",
            param="thinking.budget_tokens",
        )
    if max_tokens is not None and budget >= max_tokens:
        raise InvalidRequest(
            f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})",
            param="thinking.budget_tokens",
        )
    return Thinking(enable=True, budget=budget, show=display != "omitted")


def keep_thinking_turns(body: dict[str, Any]) -> int | None:
    """context_management's clear_thinking edit: None keeps every turn's thinking."""
    management = field(body, "context_management", dict, None)
    if management is None:
        return None
    edits = management.get("edits", [])
    if not isinstance(edits, list):
        raise InvalidRequest(
            "context_management.edits must be an array", param="context_management.edits"
        )
    keep: int | None = None
    for i, edit in enumerate(edits):
        param = f"context_management.edits[{i}]"
        kind = edit.get("type") if isinstance(edit, dict) else json_type(edit)
        if kind != "clear_thinking_20251015":
            raise InvalidRequest(
                f"{param}: context edits of type {kind!r} are not supported "
                "(clear_thinking_20251015 is)",
                param=param,
            )
        value = edit.get("keep", "all")
        if value == "all":
            continue
        turns = value.get("value") if isinstance(value, dict) else None
        if not (
            isinstance(value, dict)
            and value.get("type") == "thinking_turns"
            and isinstance(turns, int)
            and not isinstance(turns, bool)
            and turns >= 0
        ):
            raise InvalidRequest(
                f'{param}.keep must be \'all\' or {{"type": "thinking_turns", "value": N}}',
                param=f"{param}.keep",
            )
        keep = turns if keep is None else min(keep, turns)
    return keep
