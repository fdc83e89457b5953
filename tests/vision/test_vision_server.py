"""Images over HTTP with the official SDKs: OpenAI chat `image_url` parts, Responses
`input_image`, Anthropic `image` blocks (also inside a tool_result, as Claude Code's Read
tool sends a screenshot), streamed and not, on a tiny Qwen3.5 vision model; the first
request of each test runs cold (the cache flushed: the module's server is shared), and
the second reads the whole prompt, image included, from the cache and answers as the
cold one did, greedy. Refusals: a text-only model, URLs without the flag (nothing
fetched), bad base64, a bomb; each a 400 in the API's own shape, and the server goes on
serving."""

from __future__ import annotations

import base64
import io
import socket
import struct
import zlib

import httpx
import pytest
from PIL import Image
from support.live import live_server
from support.models import TEST_CACHE, loaded_test_model
from support.rss import PeakRss
from support.server_fakes import serving
from support.vision_models import encoded, picture, vision_engine, vision_model_folder

from mlx_prefix.engine.engine import Engine
from mlx_prefix.records import PromptInput
from mlx_prefix.server.protocol.messages import conversation_from_dicts

PNG = encoded(picture(96, 64, seed=11))
B64 = base64.b64encode(PNG).decode()
DATA_URL = f"data:image/png;base64,{B64}"
SYSTEM = "You read screenshots for a developer. " * 4
IMAGE_PART = {"type": "image_url", "image_url": {"url": DATA_URL}}
READ = {
    "name": "Read",
    "description": "Read a file.",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
}
# A hit that read the image: at most the generation prompt's few tokens left to compute
# (test_vision_urls.py's bound), where the system prompt alone leaves the image and more.
LEFT = 8


def flush(url: str) -> None:
    """Empty the shared server's cache: the test's next request runs cold."""
    assert httpx.delete(f"{url}/v1/cache", timeout=60).status_code == 200


def image_span(engine: Engine, messages: list[dict]) -> tuple[int, int]:
    """Where the one image of `messages` stands in its prompt's tokens."""
    [span] = engine.plan(PromptInput(messages=conversation_from_dicts(messages))).vision.spans
    return span.start, span.end


live = live_server(vision_engine)


@pytest.fixture(autouse=True)
def no_fetch(monkeypatch):
    """Any outbound connection but to the test server (loopback) fails the test."""
    original = socket.create_connection

    def guarded(address, *args, **kwargs):
        if address[0] not in ("127.0.0.1", "localhost", "::1"):
            raise AssertionError(f"network touched: {address}")
        return original(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", guarded)


def test_openai_chat_with_an_image_hits_the_second_time(url, engine, client):
    flush(url)
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [
            {"type": "text", "text": "What is on this screen?"},
            {"type": "image_url", "image_url": {"url": DATA_URL, "detail": "high"}},
        ]},
    ]  # fmt: skip
    plain = {"chat_template_kwargs": {"enable_thinking": False}}  # the reply as content
    first = client.chat.completions.create(
        model="m", messages=messages, max_tokens=6, temperature=0, extra_body=plain
    )
    chunks = list(
        client.chat.completions.create(
            model="m", messages=messages, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=plain,
        )
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # the cold run
    assert text == first.choices[0].message.content
    assert usage.prompt_tokens == first.usage.prompt_tokens
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached >= usage.prompt_tokens - LEFT
    assert cached >= image_span(engine, messages)[1]  # the image's span was read


def test_responses_input_image(url, client):
    flush(url)
    item = {"role": "user", "content": [
        {"type": "input_text", "text": "Describe:"},
        {"type": "input_image", "image_url": DATA_URL, "detail": "auto"},
    ]}  # fmt: skip
    a = client.responses.create(model="m", input=[item], max_output_tokens=6, temperature=0)
    b = client.responses.create(model="m", input=[item], max_output_tokens=6, temperature=0)
    assert a.usage.input_tokens_details.cached_tokens == 0  # the cold run
    assert b.output_text == a.output_text
    assert b.usage.input_tokens == a.usage.input_tokens
    assert b.usage.input_tokens_details.cached_tokens >= b.usage.input_tokens - LEFT


def test_a_stored_responses_turn_with_an_image_continues_by_its_id(client):
    """The store keeps the image encoded with its digest (never its pixels): a chained
    turn renders it again as the same image, so the first turn's whole prompt, image
    span included, is read from the cache."""
    png = base64.b64encode(encoded(picture(80, 48, seed=12))).decode()
    item = {"role": "user", "content": [
        {"type": "input_text", "text": "Keep this one in mind:"},
        {"type": "input_image", "image_url": f"data:image/png;base64,{png}"},
    ]}  # fmt: skip
    a = client.responses.create(model="m", input=[item], max_output_tokens=4, temperature=0)
    b = client.responses.create(
        model="m",
        previous_response_id=a.id,
        input=[{"role": "user", "content": "What was in it?"}],
        max_output_tokens=4,
        temperature=0,
    )
    assert b.status in ("completed", "incomplete") and b.previous_response_id == a.id
    assert b.usage.input_tokens > a.usage.input_tokens
    assert b.usage.input_tokens_details.cached_tokens >= a.usage.input_tokens - 8


def test_anthropic_image_in_a_tool_result_streamed_and_not(url, claude):
    flush(url)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}}
    tools = [READ]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Look at shot.png"}]},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "shot.png"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [image]},
            {"type": "text", "text": "What do you see?"},
        ]},
    ]  # fmt: skip
    first = claude.messages.create(
        model="m", max_tokens=6, system=SYSTEM, tools=tools, messages=messages,
        extra_body={"temperature": 0},
    )  # fmt: skip
    with claude.messages.stream(
        model="m", max_tokens=6, system=SYSTEM, tools=tools, messages=messages,
        extra_body={"temperature": 0},
    ) as stream:  # fmt: skip
        second = stream.get_final_message()
    assert first.usage.cache_read_input_tokens == 0  # the cold run
    assert [b.model_dump() for b in second.content] == [b.model_dump() for b in first.content]
    # Without cache_control breakpoints every token not read is plain input.
    assert second.usage.cache_read_input_tokens > 0 and second.usage.input_tokens <= LEFT
    # A user message's own image block reads the same way: cold, then from the cache.
    plain = [{"role": "user", "content": [image, {"type": "text", "text": "And this?"}]}]
    cold, warm = (
        claude.messages.create(
            model="m", max_tokens=4, messages=plain, extra_body={"temperature": 0}
        )
        for _ in range(2)
    )
    assert cold.usage.cache_read_input_tokens == 0 and warm.usage.input_tokens <= LEFT
    assert [b.model_dump() for b in warm.content] == [b.model_dump() for b in cold.content]


def test_refusals_are_400s_in_each_family_shape_and_serving_goes_on(http):
    bomb = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\x00" * 30).decode()
    cases = [
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]},
         "messages[0].content[0].image_url.url"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]}]},
         "messages[0].content[0].image_url.url"),
        ("/v1/responses", {"model": "m", "input": [{"role": "user", "content": [
            {"type": "input_image", "file_id": "file-1"}]}]}, "input[0].content[0].file_id"),
    ]  # fmt: skip
    for path, body, param in cases:
        r = http.post(path, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    r = http.post("/v1/messages", json={"model": "m", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": bomb}}]}]})  # fmt: skip
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "messages[0].content[0].source.data" in r.json()["error"]["message"]
    hi = [{"role": "user", "content": "hi"}]
    ok = http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2, "messages": hi})
    assert ok.status_code == 200


def _flat_png(side: int) -> str:
    """A flat grey side x side PNG, base64: ~16 KB at 4000 that decodes to 48 MB of RGB."""
    out = io.BytesIO()
    Image.new("L", (side, side), 128).save(out, format="PNG", compress_level=9)
    return base64.b64encode(out.getvalue()).decode()


def _header_only_png(side: int) -> str:
    """A PNG whose header says side x side over a few hundred bytes: a bomb's shape."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * (1 + 3 * 64))
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    return base64.b64encode(png).decode()


# Decoding any of them would take 48 MB of RGB (three: 144 MB), where reading their
# headers takes nothing: the margin sits far from both.
RSS_MARGIN = 64 * 1024 * 1024


@pytest.mark.parametrize("family", ["chat", "anthropic"])
def test_a_header_bomb_is_refused_unread_and_memory_stays_put(http, family):
    """Six flat 4000x4000 PNGs (16 Mpx each, 100 KB of body together) pass the request's
    pixels; a 30000x30000 header passes one image's: each a 400 in the family's shape
    naming the image, read from the headers alone (the process's RSS does not move),
    and the server goes on serving the same model with an image."""
    flat, bomb = _flat_png(4000), _header_only_png(30000)

    def body(images: list[str]) -> tuple[str, dict]:
        if family == "chat":
            url = "data:image/png;base64,{}"
            parts = [{"type": "image_url", "image_url": {"url": url.format(b)}} for b in images]
            path = "/v1/chat/completions"
        else:
            source = {"type": "base64", "media_type": "image/png"}
            parts = [{"type": "image", "source": {**source, "data": b}} for b in images]
            path = "/v1/messages"
        content = [*parts, {"type": "text", "text": "Read them."}]
        return path, {
            "model": "m",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": content}],
        }

    def message(r: httpx.Response) -> str:
        assert r.status_code == 400, r.text
        if family == "anthropic":
            assert r.json()["type"] == "error"
        return r.json()["error"]["message"]

    refused = [
        ([flat] * 6, "messages[0].content[2]", "pixels together"),
        ([flat, bomb], "messages[0].content[1]", "more pixels than"),
    ]
    for images, part, why in refused:
        path, sent = body(images)
        with PeakRss() as rss:
            r = http.post(path, json=sent)
        said = message(r)
        assert part in said and why in said
        if rss.grew is not None:
            assert rss.grew < RSS_MARGIN, f"RSS grew {rss.grew / 2**20:.0f} MiB"
    path, sent = body([B64])
    assert http.post(path, json=sent).status_code == 200


def test_a_text_only_model_answers_400_saying_so():
    engine = Engine(loaded_test_model("dense"), TEST_CACHE)
    with serving(engine) as (url, _), httpx.Client(base_url=url, timeout=60) as http:
        see = [{"role": "user", "content": [{"type": "text", "text": "See:"}, IMAGE_PART]}]
        r = http.post("/v1/chat/completions", json={"model": "m", "messages": see})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "text-only" in error["message"] and error["param"] == "messages[0].content[1]"


def test_the_dashboard_shows_an_entry_s_images_as_spans(url, engine, http):
    from mlx_prefix.server.monitor.dashboard import HEAD_TOKENS

    flush(url)  # the tree holds this request's entries only
    spans = [{"role": "user", "content": [{"type": "text", "text": "Spans:"}, IMAGE_PART]}]
    body = {"model": "m", "max_tokens": 1, "messages": spans}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    nodes = http.get("/v1/dashboard").json()["tree"]
    # The one node that adds the image shows its span where the prompt holds it, and,
    # the image being near its start, `[image]` in its head; no other node shows one.
    start, end = image_span(engine, spans)
    [node] = [n for n in nodes if n["images"]]
    assert node["images"] == [[start, end]]
    assert node["start"] <= start < node["start"] + HEAD_TOKENS and end <= node["tokens"]
    assert node["head"].count("[image]") == 1
    assert all("[image]" not in n["head"] for n in nodes if n is not node)


def test_a_request_with_another_image_is_explained_at_the_image(http):
    other = base64.b64encode(encoded(picture(96, 64, seed=12))).decode()  # PNG's size
    other_part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{other}"}}
    system = {"role": "system", "content": "You compare screens. " * 6}  # this test's own
    for part in (IMAGE_PART, other_part):
        look = [{"type": "text", "text": "Which screen is this?"}, part]
        body = {"model": "m", "max_tokens": 1, "messages": [system, user_turn(look)]}
        assert http.post("/v1/chat/completions", json=body).status_code == 200
    record = http.get("/v1/cache/requests", params={"limit": 1}).json()["data"][0]
    # It diverged where the images differ, and the texts either side show an image there
    # (the key's values written as such, never decoded as token ids).
    assert record["cached_tokens"] <= record["diverged_at"] < record["prompt_tokens"]
    assert record["before"].count("[image]") == 1 and record["after"].count("[image]") == 1
    assert "Which screen is this?" in record["before"]


def user_turn(content: list) -> dict:
    return {"role": "user", "content": content}


def test_metrics_count_image_tokens(engine, http):

    def counted():
        text = http.get("/metrics").text
        line = next(x for x in text.splitlines() if x.startswith("mlx_prefix_image_tokens_total"))
        return float(line.split()[-1])

    before = counted()
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": DATA_URL}}]}]}  # fmt: skip
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    tokens = engine.plan(
        PromptInput(messages=conversation_from_dicts(body["messages"]))
    ).vision.image_tokens
    assert counted() - before == tokens > 0


def test_generate_takes_images_from_files(tmp_path):
    import subprocess
    import sys

    shot = tmp_path / "shot.png"
    shot.write_bytes(PNG)
    model = str(vision_model_folder("qwen3_5"))
    base = [sys.executable, "-m", "mlx_prefix", "generate", "--model", model, "-n", "3"]
    run = subprocess.run(
        [*base, "--image", str(shot), "--image", str(shot), "--json", "What is this?"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    import json

    body = json.loads(run.stdout)
    assert body["usage"]["prompt_tokens"] > 2 * 6  # two images of 6 tokens each
    missing = subprocess.run(
        [*base, "--image", str(tmp_path / "none.png"), "hi"], capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert missing.returncode != 0 and "cannot read image" in missing.stderr
