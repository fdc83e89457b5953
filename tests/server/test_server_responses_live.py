"""The real engine behind /v1/responses, driven by the official openai client: a chained
conversation (previous_response_id) reads its history from the cache and answers
exactly as a cold run does."""

from __future__ import annotations

from support.engine_helpers import wait_for
from support.live import live_server
from support.models import TEST_CACHE, loaded_test_model

from mlx_prefix.config import EngineConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.records import PromptInput
from mlx_prefix.server.protocol.messages import conversation_from_dicts

SYSTEM = "You are the help desk of a public library. Answer in one short sentence. " * 4
LOGPROBS = ["message.output_text.logprobs"]
COLD = {"prefix_cache": {"enabled": False}}


live = live_server(
    lambda kind: Engine(loaded_test_model(kind), TEST_CACHE, EngineConfig(prefetch_delay_s=0)),
    params=["dense", "qwen3_5"],
)


def ask(client, text: str, previous: str | None = None, **extra):
    return client.responses.create(
        model="default",
        instructions=SYSTEM,
        input=text,
        previous_response_id=previous,
        max_output_tokens=8,
        include=LOGPROBS,
        **extra,
    )


def logprobs(response) -> list[float]:
    return [lp.logprob for lp in response.output[0].content[0].logprobs]


def test_a_chained_turn_reads_its_history_from_the_cache_and_answers_like_a_cold_run(
    engine, client
):
    first = ask(client, "Where are the atlases?")
    second = ask(client, "And the maps?", first.id)
    assert second.usage.input_tokens_details.cached_tokens > 0
    # The second turn had a reply in its history: its own reply is prefetched, so
    # the third restores everything before its new message.
    assert wait_for(lambda: engine.prefetch.completed == 1)
    third = ask(client, "Thanks!", second.id)
    conversation = PromptInput(messages=conversation_from_dicts([
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Where are the atlases?"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And the maps?"},
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Thanks!"},
    ]))  # fmt: skip
    plan = engine.plan(conversation)
    assert third.usage.input_tokens == len(plan.tokens)
    last_message = max(c.position for c in plan.checkpoints if c.kind.name == "LAST_MESSAGE")
    assert third.usage.input_tokens_details.cached_tokens >= last_message
    assert third.usage.input_tokens_details.cached_tokens > second.usage.input_tokens

    for warm, text, previous in ((second, "And the maps?", first.id),
                                 (third, "Thanks!", second.id)):  # fmt: skip
        cold = ask(client, text, previous, store=False, extra_body=COLD)
        assert cold.usage.input_tokens_details.cached_tokens == 0
        assert warm.output_text == cold.output_text
        assert logprobs(warm) == logprobs(cold) and len(logprobs(warm)) > 0
    engine.store.check_integrity()


def test_streaming_through_the_real_engine(client):
    whole = ask(client, "Can I renew online?")
    with ask(client, "Can I renew online?", stream=True) as stream:
        events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert text == whole.output_text == final.output_text
    assert final.usage.input_tokens_details.cached_tokens > 0
