"""Rendering is canonical: equivalent requests give identical tokens, whoever sends them."""

from __future__ import annotations

import base64
import threading
import time
from functools import cache

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from support.vision_models import encoded, picture
from transformers import AutoTokenizer

from mlx_prefix.config import CacheConfig
from mlx_prefix.errors import InvalidRequest
from mlx_prefix.models.testing import cached_test_model
from mlx_prefix.prompt.request.plan import PromptPlanner
from mlx_prefix.prompt.request.render import ChatRenderer
from mlx_prefix.records import PromptInput
from mlx_prefix.server.protocol.messages import conversation_from_dicts


@cache
def renderer() -> ChatRenderer:
    """SmolLM2's tokenizer with the Qwen3-style test template: renders tools, tool calls
    (arguments as given: a string verbatim, a dict through tojson) and enable_thinking."""
    path = cached_test_model("dense", think_template=True)
    return ChatRenderer(TokenizerWrapper(AutoTokenizer.from_pretrained(str(path))))


def tokens(*messages: dict, tools=None, template_kwargs: dict | None = None) -> list[int]:
    prompt = PromptInput(
        messages=conversation_from_dicts(list(messages)),
        tools=tools,
        chat_template_kwargs=template_kwargs or {},
    )
    r = renderer()
    return r.encode_chat(r.messages_text(prompt) + prompt.assistant_prefix)


def text(token_ids: list[int]) -> str:
    return renderer().tokenizer.decode(token_ids)


SYSTEM = {"role": "system", "content": "You check the weather."}


def test_content_as_a_string_or_as_text_parts_renders_the_same_tokens():
    as_string = tokens(SYSTEM, {"role": "user", "content": "Is it raining in Paris?"})
    parts = [{"type": "text", "text": "Is it raining "}, {"type": "text", "text": "in Paris?"}]
    as_parts = tokens(SYSTEM, {"role": "user", "content": parts})
    assert as_parts == as_string
    assert "<|im_start|>user\nIs it raining in Paris?<|im_end|>" in text(as_string)


def test_a_content_part_of_no_known_type_is_refused_by_name():
    audio = [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]
    with pytest.raises(InvalidRequest, match="input_audio") as e:
        tokens({"role": "user", "content": audio})
    assert e.value.param == "messages[0].content[0]"


def test_an_image_for_a_text_only_model_is_refused_naming_its_part():
    png = base64.b64encode(encoded(picture(8, 8))).decode()
    url = f"data:image/png;base64,{png}"
    parts = [{"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": url}}]
    messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": parts}]
    prompt = PromptInput(messages=conversation_from_dicts(messages))
    planner = PromptPlanner(renderer().tokenizer, CacheConfig())  # the planner keys images
    with pytest.raises(InvalidRequest, match="text-only") as e:
        planner.plan(prompt)
    assert e.value.param == "messages[1].content[1]" and e.value.code == "model_not_multimodal"


def _call(function: dict) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "id": "c1", "function": function}],
    }


ASK = {"role": "user", "content": "Weather in Paris, in celsius?"}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "12 degrees"}


def test_tool_calls_render_the_same_whatever_the_key_order_or_argument_form():
    variants = [
        {"name": "weather", "arguments": {"city": "Paris", "unit": "celsius"}},
        {"arguments": {"unit": "celsius", "city": "Paris"}, "name": "weather"},
        {"name": "weather", "arguments": '{"unit": "celsius", "city": "Paris"}'},
        {"name": "weather", "arguments": '{"city":"Paris","unit":"celsius"}'},
    ]
    rendered = [tokens(SYSTEM, ASK, _call(f), RESULT) for f in variants]
    assert all(r == rendered[0] for r in rendered[1:])
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in text(rendered[0])


def test_tool_definitions_render_the_same_whatever_the_key_order():
    a = {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    b = {
        "function": {
            "parameters": {"properties": {"city": {"type": "string"}}, "type": "object"},
            "name": "weather",
        },
        "type": "function",
    }
    assert tokens(SYSTEM, ASK, tools=[a]) == tokens(SYSTEM, ASK, tools=[b])
    assert '"name": "weather"' in text(tokens(SYSTEM, ASK, tools=[a]))


def test_chat_template_kwargs_reach_the_template():
    default = text(tokens(SYSTEM, ASK))
    no_thinking = text(tokens(SYSTEM, ASK, template_kwargs={"enable_thinking": False}))
    assert no_thinking == default + "<think>\n\n</think>\n\n"


@pytest.mark.parametrize("key", ["tools", "add_generation_prompt"])
def test_chat_template_kwargs_may_not_set_what_the_renderer_sets(key):
    with pytest.raises(InvalidRequest) as e:
        tokens(SYSTEM, ASK, template_kwargs={key: []})
    assert e.value.param == f"chat_template_kwargs.{key}"
    assert repr(key) in e.value.message
    assert "chat template failed" not in e.value.message


# -- what a request may not change, and how long rendering may take -------------------

SPIN = (  # ChatML, looping for hours when a request sets the template variable `spin`
    "{% if spin %}{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}"
    "{% endfor %}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HI = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    "key",
    [
        "chat_template",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "tools",
        "documents",
        "messages",
        "conversation",
        "return_dict",
        "tokenizer_kwargs",
    ],
)
def test_template_and_tokenisation_keys_are_refused_by_name(key):
    with pytest.raises(InvalidRequest, match=repr(key)) as e:
        tokens(HI, template_kwargs={key: "PWNED {{ messages[0].content }}"})
    assert e.value.status == 400 and e.value.param == f"chat_template_kwargs.{key}"


def spinning_renderer(timeout_s: float) -> ChatRenderer:
    path = cached_test_model("dense")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = SPIN
    return ChatRenderer(TokenizerWrapper(tokenizer), timeout_s=timeout_s)


def test_a_template_loop_ends_with_an_error_and_the_renderer_keeps_rendering():
    spinning = spinning_renderer(0.5)
    started = time.monotonic()
    with pytest.raises(InvalidRequest, match="did not finish rendering within 0.5s") as e:
        spinning.render_text(conversation_from_dicts([HI]), template_kwargs={"spin": True})
    assert e.value.code == "template_timeout" and e.value.status == 400
    assert time.monotonic() - started < 30  # not hours: bounded (generously, any machine)
    # The loop was interrupted, not left running: its thread is gone.
    assert wait_for(
        lambda: not any(t.name == "mlx-prefix-chat-template" for t in threading.enumerate())
    )
    assert spinning.render_text(conversation_from_dicts([HI])).endswith("<|im_start|>assistant\n")


def test_a_render_error_still_reaches_the_caller_through_the_bound():
    broken = spinning_renderer(5.0)
    broken.tokenizer.chat_template = "{{ raise_exception('no system role here') }}"
    with pytest.raises(InvalidRequest, match="no system role here"):
        broken.render_text(conversation_from_dicts([HI]))


def wait_for(predicate, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()
