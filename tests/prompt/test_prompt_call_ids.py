"""Tool-call ids mapped to what the template accepts (Mistral's 9 alphanumerics, Kimi
K2's own call names), deterministically and without collisions, with the real templates."""

from __future__ import annotations

import re

import pytest
from support.template_models import FIRST_ID, SECOND_ID, TOOLS, chat_messages, template_model

from mlx_prefix.conversation import Message, ToolCall
from mlx_prefix.prompt.reply.reader import client_reply
from mlx_prefix.prompt.reply.tool_calls import ToolSyntax
from mlx_prefix.prompt.request.call_ids import CallIdForm, map_call_ids, nine_alnum
from mlx_prefix.prompt.request.render import ChatRenderer
from mlx_prefix.records import ToolCallIds
from mlx_prefix.server.protocol.messages import conversation_from_dicts


def renderer(family: str) -> ChatRenderer:
    return ChatRenderer(template_model(family).tokenizer)


def render(family: str, turn: int) -> str:
    return renderer(family).render_text(conversation_from_dicts(chat_messages(turn)), tools=TOOLS)


@pytest.mark.parametrize(
    ("family", "form"),
    [
        ("Mistral Small 3.2", CallIdForm.NINE_ALNUM),
        ("Kimi K2", CallIdForm.TEMPLATE_NAMED),
        ("Qwen3", CallIdForm.AS_SENT),
        ("Gemma 4", CallIdForm.AS_SENT),
    ],
)
def test_each_template_gets_its_form_of_id(family, form):
    assert renderer(family).call_ids is form


def test_mistral_renders_a_conversation_with_the_clients_ids():
    text = render("Mistral Small 3.2", 3)  # a 400 before: "should be alphanumeric ... 9"
    calls = re.findall(r"\[CALL_ID\]([^\[]*)\[ARGS\]", text)
    results = re.findall(r"\[TOOL_RESULTS\]([^\[]*)\[TOOL_CONTENT\]", text)
    assert calls == results == [nine_alnum(FIRST_ID), nine_alnum(SECOND_ID)]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in calls)
    assert FIRST_ID not in text and SECOND_ID not in text


def test_the_same_call_renders_the_same_tokens_every_turn():
    r = renderer("Mistral Small 3.2")
    earlier = r.encode_chat(r.render_text(conversation_from_dicts(chat_messages(1)), tools=TOOLS))
    again = r.encode_chat(r.render_text(conversation_from_dicts(chat_messages(1)), tools=TOOLS))
    assert earlier == again
    # Turn 3 adds a call: the first call's id is the one turn 1 rendered.
    assert nine_alnum(FIRST_ID) in render("Mistral Small 3.2", 3)
    longer = map_call_ids(conversation_from_dicts(chat_messages(3)), CallIdForm.NINE_ALNUM)
    shorter = map_call_ids(conversation_from_dicts(chat_messages(1)), CallIdForm.NINE_ALNUM)
    assert longer[: len(shorter)] == shorter


def _conversation(*ids: str) -> list[Message]:
    messages = [Message("user", "go")]
    for i in ids:
        messages += [
            Message("assistant", tool_calls=(ToolCall("f", {}, i),)),
            Message("tool", "done", tool_call_id=i),
        ]
    return messages


def _ids(messages: list[Message]) -> list[str | None]:
    return [m.tool_call_id for m in messages if m.role == "tool"]


def test_an_accepted_id_stays_and_a_collision_is_redrawn():
    first = "toolu_01"
    taken = nine_alnum(first)
    mapped = _ids(map_call_ids(_conversation(first, taken, "Abc123xyZ"), CallIdForm.NINE_ALNUM))
    assert mapped[0] == taken
    assert mapped[1] != taken and re.fullmatch(r"[A-Za-z0-9]{9}", mapped[1])
    assert mapped[2] == "Abc123xyZ"  # already 9 alphanumerics: as the client sent it


def test_the_callers_messages_are_left_as_they_were():
    messages = _conversation("toolu_01")
    map_call_ids(messages, CallIdForm.NINE_ALNUM)
    assert _ids(messages) == ["toolu_01"]


def test_kimi_results_answer_the_call_the_template_named():
    text = render("Kimi K2", 3)
    assert "## Return of functions.read_file:0" in text
    assert FIRST_ID not in text and SECOND_ID not in text


def test_a_reply_is_named_in_the_clients_form_and_renders_back_in_the_templates():
    model = template_model("Mistral Small 3.2")
    ids = ToolCallIds(seed="req-1", prefix="toolu_")  # an Anthropic client's reply
    written = '[TOOL_CALLS]read_file[ARGS]{"path": "a.py"}'
    reply = client_reply(ToolSyntax.of(model.tokenizer), written, TOOLS, ids)
    assert reply.call_ids == (ids.id(0),)  # the client's own form, never the template's
    result = Message("tool", "x = 1", tool_call_id=ids.id(0))
    # What the next-turn prefetch renders, and the client's next request alike.
    messages = [*conversation_from_dicts(chat_messages(0)), reply.message, result]
    text = ChatRenderer(model.tokenizer).render_text(messages, tools=TOOLS)
    mapped = nine_alnum(ids.id(0))
    assert f"[CALL_ID]{mapped}[ARGS]" in text and f"[TOOL_RESULTS]{mapped}[" in text
