"""ReasoningMarkers on the real templates: the markers mlx-lm's tokenizer wrapper names,
whether a generation prompt leaves the block open, the close the template writes
after a turn's reasoning (what a spent reasoning budget forces), and the edges it writes
around reasoning sent back (what a reply's reasoning drops, however the deltas cut it)."""

from __future__ import annotations

import pytest
from support.template_models import template_model

from mlx_prefix.prompt.reply.harmony import CLOSE as HARMONY_CLOSE
from mlx_prefix.prompt.reply.reader import ReplyFormat, reply_reader
from mlx_prefix.prompt.reply.reasoning import ReasoningMarkers
from mlx_prefix.prompt.reply.thinking import ReasoningEdges
from mlx_prefix.prompt.request.render import ChatRenderer
from mlx_prefix.server.protocol.messages import conversation_from_dicts

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


# family -> the edges its template writes around reasoning sent back (after the start
# marker, before the end marker), and the lead left to the model after a generation
# prompt that opens the block (Qwen3.5's, Nemotron's, MiniMax's `<think>\n` write it;
# Qwen3's and Gemma 4's default prompts open none).
EDGES = {
    "Gemma 4": ("\n", "\n", "\n"),
    "Qwen3": ("\n", "\n", "\n"),
    "Qwen3.5": ("\n", "\n", ""),
    "Nemotron 3 Nano": ("\n", "\n", ""),
    "MiniMax M2": ("\n", "\n", ""),
    "GLM-4.7": ("", "", ""),  # `<think>` + the reasoning, stripped, + `</think>`
    "DeepSeek V3.1": ("", "", ""),  # renders no reasoning back
}


@pytest.mark.parametrize("family", list(EDGES))
def test_the_edges_are_what_the_template_writes_around_reasoning(family):
    found, _ = markers(family)
    lead, trail, opened_lead = EDGES[family]
    assert found.reply_edges(opened=False) == ReasoningEdges(lead, trail)
    assert found.reply_edges(opened=True) == ReasoningEdges(opened_lead, trail)


def read(family: str, reply: str, cut: int) -> tuple[str, str]:
    """`reply` read in deltas of `cut` characters: (its reasoning, its text)."""
    found, _ = markers(family)
    edges = found.reply_edges(opened=False)
    reader = reply_reader(ReplyFormat.of(template_model(family).tokenizer), None, edges=edges)
    splits = [reader.feed(reply[i : i + cut]) for i in range(0, len(reply), cut)]
    splits.append(reader.finish())
    return "".join(s.reasoning for s in splits), "".join(s.text for s in splits)


@pytest.mark.parametrize("cut", [1, 2, 5, 1000])
def test_the_reasoning_drops_the_edges_only_where_the_model_wrote_them(cut):
    def thought(body: str) -> tuple[str, str]:
        return read("Gemma 4", f"<|channel>thought{body}<channel|>Reading it.", cut)

    assert thought("\nLet me see.\n") == ("Let me see.", "Reading it.")
    assert thought("Let me see.") == ("Let me see.", "Reading it.")
    assert thought("\n\nLet me\n\nsee.\n\n") == ("\nLet me\n\nsee.\n", "Reading it.")
    # Edges alone: the reasoning as written (an empty one would not render back).
    assert thought("\n\n") == ("\n\n", "Reading it.")
    assert read("Gemma 4", "<|channel>thought\nLet me\n", cut) == ("Let me\n", "")  # cut off
    assert read("Gemma 4", "No thought.\n", cut) == ("", "No thought.\n")
