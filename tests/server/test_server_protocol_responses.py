"""Pure pieces of the Responses API: items -> chat messages, tools, the store."""

from __future__ import annotations

import base64

import pytest
from support.vision_models import encoded, picture

from mlx_prefix.conversation import Message
from mlx_prefix.errors import InvalidRequest
from mlx_prefix.records import ToolCallIds
from mlx_prefix.server.protocol.chat import parse_chat
from mlx_prefix.server.protocol.request import Limits
from mlx_prefix.server.protocol.responses.bodies import parse_responses
from mlx_prefix.server.protocol.responses.items import chat_tools, input_messages
from mlx_prefix.server.responses_store import ResponseStore, StoredResponse

LIMITS = Limits(default_max_tokens=64, max_tokens=1000)


def call(call_id: str, city: str) -> dict:
    arguments = f'{{"city": "{city}"}}'
    return {"type": "function_call", "call_id": call_id, "name": "w", "arguments": arguments}


def test_a_run_of_assistant_items_is_one_assistant_message_in_any_order():
    # Codex records items as their output_item.done events arrive: calls may come first.
    text = {"type": "output_text", "text": "Checking.", "annotations": []}
    said = {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
            "content": [text]}  # fmt: skip
    for run in ([said, call("c1", "Paris"), call("c2", "Oslo")],
                [call("c1", "Paris"), call("c2", "Oslo"), said]):  # fmt: skip
        messages = input_messages(
            [{"role": "user", "content": "Weather?"}, *run,
             {"type": "function_call_output", "call_id": "c1", "output": "18C"},
             {"type": "function_call_output", "call_id": "c2",
              "output": [{"type": "input_text", "text": "9C"}]}]
        )  # fmt: skip
        assert [m.role for m in messages] == ["user", "assistant", "tool", "tool"]
        assert messages[1].content == "Checking."
        assert [c.id for c in messages[1].tool_calls] == ["c1", "c2"]
        assert messages[3] == Message("tool", "9C", tool_call_id="c2")


def test_the_same_conversation_parses_like_chat_completions():
    chat = parse_chat(
        {
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "w", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "18C"},
            ],
            "tools": [{"type": "function", "function": {"name": "w", "parameters": {}}}],
        },
        LIMITS,
    )  # fmt: skip
    responses = parse_responses(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "Weather?"},
                call("c1", "Paris"),
                {"type": "function_call_output", "call_id": "c1", "output": "18C"},
            ],
            "tools": [{"type": "function", "name": "w", "parameters": {}, "strict": False}],
        },
        LIMITS,
    )
    prompt = responses.prompt((), ToolCallIds("resp_1"))
    assert chat.prompt.messages is not None and prompt.messages is not None
    assert prompt.messages == chat.prompt.messages
    assert prompt.tools == chat.prompt.tools


def test_function_tools_flat_to_chat_shape():
    found = chat_tools([{"type": "function", "name": "f", "description": "d", "strict": None}])
    assert found is not None
    nested, flat = found
    params = {"type": "object", "properties": {}}
    function = {"name": "f", "description": "d", "parameters": params}
    assert nested == ({"type": "function", "function": function},)
    assert flat == [{"type": "function", "name": "f", "description": "d", "parameters": params,
                     "strict": False}]  # fmt: skip
    assert chat_tools([]) is None
    with pytest.raises(InvalidRequest) as info:
        chat_tools([{"type": "function", "name": "f", "defer_loading": True}])
    assert info.value.param == "tools[0].defer_loading"


def test_bad_items_name_the_field():
    cases = {
        "input[0].role": [{"type": "message", "role": "tool", "content": "x"}],
        "input[0].arguments": [{"type": "function_call", "call_id": "c", "name": "f"}],
        "input[1].call_id": [{"role": "user", "content": "x"}, {"type": "function_call_output"}],
        "input[0].type": [{"type": "item_reference", "id": "msg_1"}],
        "input": [],
    }
    for param, items in cases.items():
        with pytest.raises(InvalidRequest) as info:
            input_messages(items)
        assert info.value.param == param


def test_store_is_lru_by_count():
    store = ResponseStore(2)
    for name in "abc":
        store.put("", name, StoredResponse({"id": name}, ()))
    assert store.get("", "a") is None and len(store) == 2
    assert store.get("", "b") is not None  # b is now the most recent
    store.put("", "d", StoredResponse({"id": "d"}, ()))
    assert store.get("", "c") is None and store.get("", "b") is not None
    assert store.delete("", "b") and not store.delete("", "b")
    off = ResponseStore(0)
    off.put("", "x", StoredResponse({}, ()))
    assert off.get("", "x") is None
    with pytest.raises(ValueError):
        ResponseStore(-1)


def test_store_keeps_namespaces_apart():
    store = ResponseStore(10)
    store.put("origin=a", "resp_1", StoredResponse({"id": "resp_1"}, ()))
    assert store.get("origin=b", "resp_1") is None and store.get("", "resp_1") is None
    assert not store.delete("origin=b", "resp_1")
    assert store.get("origin=a", "resp_1") is not None  # still there for its owner


def test_one_namespace_filling_the_store_evicts_only_its_own():
    store = ResponseStore(6)
    for i in range(2):
        store.put("origin=a", f"a{i}", StoredResponse({}, ()))
        store.put("origin=b", f"b{i}", StoredResponse({}, ()))
    for i in range(50):
        store.put("origin=flood", f"f{i}", StoredResponse({}, ()))
    assert len(store) == 6 and store.held("origin=flood") == 2
    assert all(store.get("origin=a", f"a{i}") and store.get("origin=b", f"b{i}") for i in range(2))
    assert store.get("origin=flood", "f49") is not None  # its most recent ones
    # A newcomer takes from the largest share, never from its own one response.
    store.put("origin=c", "c0", StoredResponse({}, ()))
    assert store.held("origin=c") == 1 and len(store) == 6


def _with_image(seed: int) -> Message:
    """A user message holding a ~200 KB PNG (noise does not compress), as parsed."""
    png = base64.b64encode(encoded(picture(256, 256, seed=seed))).decode()
    item = {"role": "user", "content": [
        {"type": "input_text", "text": f"image {seed}"},
        {"type": "input_image", "image_url": f"data:image/png;base64,{png}"},
    ]}  # fmt: skip
    (message,) = input_messages([item])
    return message


def test_store_is_bounded_in_bytes_and_keeps_images_encoded():
    cap = 1024 * 1024
    store = ResponseStore(1000, max_bytes=cap)
    sizes = []
    for i in range(12):
        message = _with_image(i)
        image = message.images[0].image.image
        assert image.digest  # decoded once, for the cache key
        assert not any(hasattr(v, "tobytes") for v in vars(image).values())  # no pixels kept
        sizes.append(image.encoded_bytes)
        store.put("", f"r{i}", StoredResponse({"id": f"r{i}"}, (message,)))
        assert store.nbytes <= cap
    assert sum(sizes) > 2 * cap and min(sizes) > 150_000
    kept = [i for i in range(12) if store.get("", f"r{i}") is not None]
    assert kept == list(range(12 - len(kept), 12)) and 3 <= len(kept) < 12  # the newest
    for i in kept:
        store.delete("", f"r{i}")
    assert store.nbytes == 0 and len(store) == 0


def test_a_chain_s_shared_history_is_counted_once():
    store = ResponseStore(1000, max_bytes=1024 * 1024)
    history: tuple[Message, ...] = (_with_image(1),)
    size = history[0].images[0].image.image.encoded_bytes
    for turn in range(8):  # each response's history holds its predecessor's messages
        history = (*history, Message("assistant", f"reply {turn}"), Message("user", "more"))
        store.put("", f"r{turn}", StoredResponse({"id": f"r{turn}"}, history))
    assert len(store) == 8 and size < store.nbytes < size + 20_000


# What sglang-router 0.3.2 writes into every Responses body it forwards (its
# ResponsesRequest's defaults, src/protocols/responses.rs): SGLang's priority and sampling
# extensions at "none"/"off", temperature and top_p at OpenAI's defaults, store on.
ROUTER_FILLED = {"priority": 0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                 "temperature": 1.0, "top_p": 1.0, "store": True, "stream": None}  # fmt: skip


def test_the_fields_sglangs_router_adds_are_honoured():
    req = parse_responses({"model": "m", "input": "Hi", **ROUTER_FILLED}, LIMITS)
    s = req.sampling
    assert (s.top_k, s.min_p, s.repetition_penalty, s.temperature) == (0, 0.0, 1.0, 1.0)
    set_ = parse_responses(
        {"input": "Hi", "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2}, LIMITS
    ).sampling
    assert (set_.top_k, set_.min_p, set_.repetition_penalty) == (5, 0.1, 1.2)


@pytest.mark.parametrize(
    ("body", "param"),
    [({"priority": 1}, "priority"), ({"priority": -3}, "priority"),
     ({"priority": "high"}, "priority"), ({"top_k": -2}, "top_k"),
     ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": -1}, "repetition_penalty")],
)  # fmt: skip
def test_a_priority_or_an_sglang_field_out_of_range_is_refused(body, param):
    with pytest.raises(InvalidRequest) as e:
        parse_responses({"input": "Hi", **body}, LIMITS)
    assert e.value.param == param
    if param == "priority":
        assert "not scheduled by priority" in str(e.value) or "integer" in str(e.value)
