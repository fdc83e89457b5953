"""Checkpoint plans: where the chat boundaries land, and that they land on the grid.

Template styles are exercised with the default model's SmolLM2 tokenizer given other
chat templates (and the special tokens those templates use).
"""

from __future__ import annotations

import logging
from functools import cache

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from support.engine_helpers import warm_equals_cold
from transformers import AutoTokenizer

from mlx_prefix.cache.store import CheckpointKind
from mlx_prefix.config import CacheConfig
from mlx_prefix.conversation import Message
from mlx_prefix.models.default import ensure_default_model
from mlx_prefix.models.testing import cached_test_model
from mlx_prefix.prompt.request.plan import PromptPlanner, RenderedPrompt
from mlx_prefix.prompt.request.render import ChatRenderer, common_prefix_length
from mlx_prefix.prompt.request.template_grid import _special_ids
from mlx_prefix.records import PromptInput

SYSTEM, LAST, HISTORY, PERIODIC = (
    CheckpointKind.SYSTEM,
    CheckpointKind.LAST_MESSAGE,
    CheckpointKind.HISTORY,
    CheckpointKind.PERIODIC,
)

PHI3 = (
    "{% for message in messages %}{% if message['role'] in ['system', 'user', 'assistant'] %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    "{% else %}{{ eos_token }}{% endif %}"
)
LLAMA3 = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}{{ '<|start_header_id|>' "
    "+ message['role'] + '<|end_header_id|>\\n\\n' + (message['content'] | trim) + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
MISTRAL = (  # v1: [INST] is plain text; only <s> and </s> are special
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)
PLAIN = (  # no special token anywhere
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)

STYLES: dict[str, tuple[str | None, dict]] = {
    "chatml": (None, {}),  # SmolLM2's own template
    "phi3": (
        PHI3,
        {"additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]},
    ),
    "llama3": (
        LLAMA3,
        {
            "additional_special_tokens": [
                "<|begin_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
            ]
        },
    ),
    "mistral": (MISTRAL, {"bos_token": "<s>", "eos_token": "</s>"}),
    "plain": (PLAIN, {}),
}


@cache
def tokenizer(style: str) -> TokenizerWrapper:
    template, specials = STYLES[style]
    tok = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    if specials:
        tok.add_special_tokens(specials)
    if template is not None:
        tok.chat_template = template
    return TokenizerWrapper(tok)


def planner(style: str, chunk: int = 1024, interval: int = 4096) -> PromptPlanner:
    config = CacheConfig(prefill_chunk=chunk, checkpoint_interval=interval)
    return PromptPlanner(tokenizer(style), config)


def ids(style: str, *tokens: str) -> set[int]:
    return {tokenizer(style).convert_tokens_to_ids(t) for t in tokens}


def encode(style: str, text: str) -> tuple[int, ...]:
    return tuple(tokenizer(style).encode(text, add_special_tokens=False))


def chat(*messages: tuple[str, str]) -> PromptInput:
    return PromptInput(messages=tuple(Message(r, c) for r, c in messages))


def kinds(rendered: RenderedPrompt) -> dict[int, CheckpointKind]:
    return {c.position: c.kind for c in rendered.checkpoints}


CONVERSATION = (
    ("system", "You answer questions about a small bookshop."),
    ("user", "Do you sell maps?"),
    ("assistant", "Yes, road maps and city maps."),
    ("user", "How much is a city map?"),
)
NO_SYSTEM = CONVERSATION[1:]
DOCUMENT = " ".join(
    f"Paragraph {i}: the shop opens at nine, closes at six, and keeps maps on shelf {i}."
    for i in range(14)  # the tail lands 15 tokens before the question
)


def content_start(p: PromptPlanner, prompt: PromptInput, index: int) -> int:
    return p._sentinel_start(prompt, index, list(p.plan(prompt).tokens))


# -- sentinel substitution ------------------------------------------------------------


def test_the_sentinel_lands_where_the_last_message_content_begins():
    p, prompt = planner("chatml"), chat(*CONVERSATION)
    tokens = list(p.plan(prompt).tokens)
    start = content_start(p, prompt, 3)
    tok = tokenizer("chatml")
    assert tok.decode(tokens[:start]).endswith("<|im_start|>user\n")
    assert tok.decode(tokens[start:]).startswith("How much is a city map?<|im_end|>")


@pytest.mark.parametrize("last", ["How much?", "\n\nHow much?", " spaced", "x"])
def test_the_sentinel_start_is_shared_with_any_other_last_message(last):
    # Content that merges with the header's "\n" moves the start back, never past a token
    # that another last message would render differently.
    p = planner("chatml")
    prompt = chat(*CONVERSATION[:-1], ("user", last))
    start = content_start(p, prompt, 3)
    other = p.plan(chat(*CONVERSATION)).tokens
    assert p.plan(prompt).tokens[:start] == other[:start]
    assert start > content_start(p, chat(*CONVERSATION), 1)


# -- chat boundaries --------------------------------------------------------------------


def test_chatml_boundaries_sit_just_after_each_message_start_token():
    p = planner("chatml")
    rendered = p.plan(chat(*CONVERSATION))
    tokens, n = rendered.tokens, len(rendered.tokens)
    (im_start,) = ids("chatml", "<|im_start|>")
    after_start = [i + 1 for i, t in enumerate(tokens) if t == im_start]
    assert len(after_start) == 5  # system, user, assistant, user, generation prompt
    assert tokens[after_start[4] - 1 :] == p.grid.generation_suffix
    reply, generation = p.grid.turn_starts(tokens)
    assert after_start[2] < reply < after_start[3] and generation == n
    assert kinds(rendered) == {
        after_start[1]: SYSTEM,  # the system prompt and the next message's start token
        reply: HISTORY,  # where the assistant's turn opens: a re-rendered reply differs here
        after_start[3]: LAST,
        after_start[4]: HISTORY,  # the generation prompt's special token
        n: HISTORY,  # the whole prompt: the next turn starts with it
    }


def test_two_messages_render_the_sentinel_once(monkeypatch):
    calls = []
    original = ChatRenderer.render_text

    def counting(self, messages, **kwargs):
        calls.append(kwargs.get("contents"))
        return original(self, messages, **kwargs)

    p = planner("chatml")
    monkeypatch.setattr(ChatRenderer, "render_text", counting)
    rendered = p.plan(chat(*CONVERSATION[:2]))
    assert len(calls) == 2  # the prompt, then one sentinel render for message 1
    assert SYSTEM in kinds(rendered).values()


def test_a_long_last_message_gets_a_tail_checkpoint_next_to_its_end():
    p = planner("chatml", chunk=32)
    first = p.plan(chat(CONVERSATION[0], ("user", DOCUMENT + "\n\nWho keeps the maps?")))
    second = p.plan(chat(CONVERSATION[0], ("user", DOCUMENT + "\n\nWhen does it open?")))
    n = len(first.tokens)
    tail = (n - 1) // 32 * 32
    found = kinds(first)
    assert found.get(tail) == PERIODIC
    message_start = max(pos for pos, kind in found.items() if kind in (SYSTEM, LAST))
    assert tail - message_start > 3 * 32, "the tail should sit far past the message start"
    assert tail < min(pos for pos, kind in found.items() if kind == HISTORY)
    # The second question restores there: the tail is shared and on its grid too.
    assert tail <= common_prefix_length(first.tokens, second.tokens)
    assert p.grid.is_point(second.tokens, tail)


@pytest.mark.parametrize(
    "reply",
    [
        "Yes.",  # the tail falls inside the generation prompt, after the history cut
        "Yes, it is all noted, and I will keep it at hand for your next questions.",  # before
    ],
)
def test_no_tail_outside_the_last_message(reply):
    p = planner("chatml", chunk=32)
    rendered = p.plan(
        chat(CONVERSATION[0], ("user", DOCUMENT), ("assistant", reply), ("user", "Ok"))
    )
    found = kinds(rendered)
    tail = (len(rendered.tokens) - 1) // 32 * 32
    last = max(pos for pos, kind in found.items() if kind == LAST)
    history_cut = min(pos for pos, kind in found.items() if kind == HISTORY)
    assert not last < tail < history_cut  # precondition
    # Only the periodic series (the early points, then powers of two below the
    # interval: prompt/request/grid.py), no tail.
    periodic = {pos for pos, kind in found.items() if kind == PERIODIC}
    assert periodic <= set(p.grid.periodic(len(rendered.tokens), 4096))


def test_text_completions_get_periodic_checkpoints_and_a_tail():
    p = planner("chatml", chunk=32, interval=64)
    text = "word" + " word" * 199
    rendered = p.plan(PromptInput(text=text))
    assert len(rendered.tokens) == 200
    assert not rendered.is_chat
    # The series (one chunk, then every interval: prompt/request/grid.py) and the tail: 192.
    assert kinds(rendered) == {32: PERIODIC, 64: PERIODIC, 128: PERIODIC, 192: PERIODIC}
    shorter = p.plan(PromptInput(text="word" + " word" * 179))  # 180 tokens: tail at 160
    assert kinds(shorter) == {32: PERIODIC, 64: PERIODIC, 128: PERIODIC, 160: PERIODIC}


CASES = [
    ("chatml", CONVERSATION),
    ("chatml", (CONVERSATION[0], ("user", DOCUMENT + " What is on shelf 3?"))),
    ("phi3", CONVERSATION),
    ("llama3", CONVERSATION),
    ("mistral", NO_SYSTEM),
    ("mistral", (("user", DOCUMENT), ("assistant", "Noted."), ("user", "Shelf 3?"))),
    ("plain", CONVERSATION),
]


@pytest.mark.parametrize(("style", "messages"), CASES)
@pytest.mark.parametrize("chunk", [32, 1024])
def test_every_checkpoint_is_a_grid_point(style, messages, chunk):
    p = planner(style, chunk=chunk, interval=max(chunk, 64))
    rendered = p.plan(chat(*messages))
    positions = [c.position for c in rendered.checkpoints]
    assert positions == sorted(set(positions)) and positions
    assert 0 < positions[0] and positions[-1] <= len(rendered.tokens)
    assert all(p.grid.is_point(rendered.tokens, pos) for pos in positions)


# -- grid detection ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("style", "segment", "suffix"),
    [
        ("chatml", ["<|im_start|>"], "<|im_start|>assistant\n"),
        # one start token per role; <|end|> would add a second point per message
        ("phi3", ["<|system|>", "<|user|>", "<|assistant|>"], "<|assistant|>\n"),
        ("llama3", ["<|end_header_id|>"], "<|start_header_id|>assistant<|end_header_id|>\n\n"),
        # no start token at all: the end-of-turn token </s> (and the BOS, never a point)
        ("mistral", ["<s>", "</s>"], ""),
    ],
)
def test_grid_detection_finds_each_roles_message_start_token(style, segment, suffix):
    grid = planner(style).grid
    assert grid.segment_tokens == ids(style, *segment)
    assert grid.generation_suffix == encode(style, suffix)


@pytest.mark.parametrize("style", ["chatml", "phi3", "llama3", "mistral"])
def test_every_message_start_and_the_generation_prompt_are_on_the_grid(style):
    # On the grid right after the last special token before each message's content (and
    # before the reply): only plain-text headers such as "user\n" lie between.
    p = planner(style)
    messages = NO_SYSTEM if style == "mistral" else CONVERSATION
    prompt = chat(*messages)
    tokens = p.plan(prompt).tokens
    specials = _special_ids(tokenizer(style))
    for index in range(1, len(messages)):
        start = content_start(p, prompt, index)
        aligned = p.grid.align(tokens, start)
        between = tokens[max(aligned, 1) : start]  # a BOS at 0 is never a point
        assert not specials & set(between), (style, index)
    before_end = max(c.position for c in p.plan(prompt).checkpoints if c.position < len(tokens))
    assert not specials & set(tokens[before_end:])


def test_thinking_template_cuts_the_history_after_the_generation_prompts_start_token():
    tok = TokenizerWrapper(AutoTokenizer.from_pretrained(str(cached_test_model("dense", True))))
    p = PromptPlanner(tok, CacheConfig(prefill_chunk=1024, checkpoint_interval=4096))
    rendered = p.plan(chat(*CONVERSATION))
    n, suffix = len(rendered.tokens), p.grid.generation_suffix
    assert tok.decode(list(suffix)) == "<|im_start|>assistant\n"
    history = sorted(pos for pos, kind in kinds(rendered).items() if kind == HISTORY)
    reply = p.grid.turn_starts(rendered.tokens)[0]  # the assistant message's turn opens
    assert reply < n - len(suffix)
    assert history == [reply, n - len(suffix) + 1, n]


def test_a_template_without_special_tokens_warns_and_falls_back_to_multiples(caplog):
    with caplog.at_level(logging.WARNING, logger="mlx_prefix.prompt"):
        p = planner("plain", chunk=32)
    assert "no special token" in caplog.text
    assert not p.grid.segment_tokens
    rendered = p.plan(chat(*CONVERSATION))
    suffix = p.grid.generation_suffix
    assert rendered.tokens[-len(suffix) :] == suffix == encode("plain", "assistant:")
    turns = p.grid.turn_starts(rendered.tokens)  # "assistant:" opens a turn here too
    for c in rendered.checkpoints:
        assert (
            c.position % 32 == 0
            or rendered.tokens[c.position - len(suffix) : c.position] == suffix
            or c.position in turns
        )


# -- on a hybrid model --------------------------------------------------------------------


def test_a_new_question_after_the_same_document_restores_at_the_tail(make_engine):
    # No periodic checkpoint inside the document: only the tail can serve the second question.
    engine = make_engine(
        "qwen3_5", cache_config=CacheConfig(prefill_chunk=32, checkpoint_interval=4096)
    )
    first = chat(CONVERSATION[0], ("user", DOCUMENT + "\n\nWho keeps the maps?"))
    second = chat(CONVERSATION[0], ("user", DOCUMENT + "\n\nWhen does it open?"))
    warm_equals_cold(engine, first)
    n = len(engine.plan(first).tokens)
    tail = (n - 1) // 32 * 32
    assert tail < common_prefix_length(engine.plan(first).tokens, engine.plan(second).tokens)
    result = warm_equals_cold(engine, second)
    assert result.usage.cached_tokens == tail
    message_start = max(c.position for c in engine.plan(second).checkpoints if c.kind == SYSTEM)
    assert tail > message_start + 3 * 32
