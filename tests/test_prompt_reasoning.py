"""ReasoningMarkers on the real templates: the markers mlx-lm's tokenizer wrapper names,
whether a generation prompt leaves the block open, and the close the template writes
after a turn's reasoning (what a spent reasoning budget forces)."""

from __future__ import annotations

import pytest
from template_models import template_model

from mlx_prefix.conversation import conversation_from_dicts
from mlx_prefix.prompt.harmony import CLOSE as HARMONY_CLOSE
from mlx_prefix.prompt.reasoning import ReasoningMarkers
from mlx_prefix.prompt.render import ChatRenderer

QUESTION = conversation_from_dicts([{"role": "user", "content": "What does a.py print?"}])

# family -> the text its template writes between a turn's reasoning and what follows it
CLOSES = {
    "Qwen3.5": "\n</think>\n\n",
    "Nemotron 3 Nano": "\n</think>\n",
    "GLM-4.7": "</think>",
    # Reasoning only on a turn with calls, then the call itself: `\n<channel|><|tool_call>`.
    "Gemma 4": "\n<channel|>",
    "gpt-oss": HARMONY_CLOSE,
}


def markers(family: str) -> tuple[ReasoningMarkers, ChatRenderer]:
    renderer = ChatRenderer(template_model(family).tokenizer)
    found = ReasoningMarkers.of(renderer)
    assert found is not None
    return found, renderer


@pytest.mark.parametrize("family", list(CLOSES))
def test_the_close_is_the_templates_own(family):
    found, renderer = markers(family)
    assert found.close_text == CLOSES[family]
    assert list(found.close) == renderer.encode_chat(CLOSES[family])


def test_gemma4_reasons_in_its_thought_channel_which_thinking_opens_in_the_reply():
    found, renderer = markers("Gemma 4")
    assert (found.start_text, found.end_text) == ("<|channel>thought", "<channel|>")
    assert len(found.end) == 1  # `<channel|>` is one token, `<|channel>` one and `thought`
    thinking = renderer.render_text(QUESTION, template_kwargs={"enable_thinking": True})
    # `<|think|>` in the system turn; the model opens its thought channel itself.
    assert "<|think|>" in thinking and thinking.endswith("<|turn>model\n")
    assert not found.opens(renderer.encode_chat(thinking))
    # Thinking off: the generation prompt carries an empty, closed thought channel.
    plain = renderer.render_text(QUESTION, template_kwargs={"enable_thinking": False})
    assert plain.endswith("<|channel>thought\n<channel|>")
    assert not found.opens(renderer.encode_chat(plain))
    assert found.opens(renderer.encode_chat(plain.removesuffix("<channel|>")))
