"""Images over Ollama's API with its official Python client (`images` on a chat message,
beside /api/generate's prompt) on the tiny Qwen3.5 vision model: they stand before the
message's text, as Ollama puts them, so an OpenAI request with the same image before the
same text reads the Ollama one's prompt from the cache. A text-only model refuses naming
the field; raw mode refuses images; --max-images holds for every API family."""

from __future__ import annotations

import base64
import json
import re
import shutil

import httpx
import mlx.core as mx
import ollama
import pytest
from support.live import live_server
from support.models import TEST_CACHE, loaded_test_model
from support.server_fakes import FakeEngine, FakeModel, serving
from support.vision_models import encoded, picture, vision_engine, vision_model_folder

from mlx_prefix.engine.engine import Engine
from mlx_prefix.models.load import load_model
from mlx_prefix.vision.tower import carries_tower

PNG = encoded(picture(96, 64, seed=31))
B64 = base64.b64encode(PNG).decode()
SYSTEM = "You read screenshots for a developer. " * 4
ASK = "What is on this screen?"


live = live_server(vision_engine)


def images_total(url: str) -> float:
    found = re.search(r"^mlx_prefix_images_total (\S+)$", httpx.get(f"{url}/metrics").text, re.M)
    assert found
    return float(found.group(1))


def test_a_chat_image_stands_before_its_text_and_an_openai_twin_reads_it_from_the_cache(
    url, ollama_client
):
    before = images_total(url)
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": ASK, "images": [PNG]},
    ]
    reply = ollama_client.chat(model="m", messages=messages, options={"num_predict": 4})
    assert reply.done and images_total(url) == before + 1
    look = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{B64}"}},
            {"type": "text", "text": ASK}]  # fmt: skip
    twin = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": look}]
    body = {"model": "m", "max_tokens": 4, "temperature": 0, "messages": twin}
    usage = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 8


def test_generate_takes_images_beside_its_prompt_and_raw_mode_refuses_them(url, ollama_client):
    before = images_total(url)
    options = {"num_predict": 2}
    reply = ollama_client.generate(model="m", prompt=ASK, images=[PNG], options=options)
    assert reply.done and images_total(url) == before + 1
    with pytest.raises(ollama.ResponseError) as e:
        ollama_client.generate(model="m", prompt=ASK, images=[PNG], raw=True)
    assert e.value.status_code == 400 and "raw mode does not support images" in e.value.error


def test_a_text_only_model_refuses_an_ollama_image_naming_it():
    engine = Engine(loaded_test_model("dense"), TEST_CACHE)
    with serving(engine) as (url, _), ollama.Client(host=url) as client:
        with pytest.raises(ollama.ResponseError) as e:
            client.chat(model="m", messages=[{"role": "user", "content": ASK, "images": [PNG]}])
    assert e.value.status_code == 400
    assert "messages[0].images[0]" in e.value.error and "text-only" in e.value.error


def test_max_images_holds_for_every_family_naming_the_first_image_past_it():
    part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{B64}"}}
    chat = {"model": "m", "max_tokens": 2,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "a"}]},
                         {"role": "user", "content": [part]}]}  # fmt: skip
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}}
    messages = {"model": "m", "max_tokens": 2,
                "messages": [{"role": "user", "content": [block, block]}]}  # fmt: skip
    asked = {"model": "m", "stream": False,
             "messages": [{"role": "user", "content": ASK, "images": [B64, B64]}]}  # fmt: skip
    seeing = FakeEngine(FakeModel(vision=object()))
    with serving(seeing, max_images=1) as (url, engine), httpx.Client(base_url=url) as http:
        r = http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_images"
        assert r.json()["error"]["param"] == "messages[1].content[0]"
        r = http.post("/v1/messages", json=messages)
        assert r.status_code == 400 and "messages[0].content[1]" in r.json()["error"]["message"]
        r = http.post("/api/chat", json=asked)
        assert r.status_code == 400 and "messages[0].images[1]" in r.json()["error"]
        one = {**chat, "messages": chat["messages"][:1]}
        assert http.post("/v1/chat/completions", json=one).status_code == 200
    assert len(engine.submissions) == 1


def test_show_says_vision_where_the_model_takes_images(ollama_client):
    assert "vision" in ollama_client.show("m").capabilities


def test_a_conversion_without_its_tower_serves_text_and_refuses_images_as_text_only(tmp_path):
    """mlx-lm's convert keeps a vision checkpoint's vision_config but drops its tower (many
    published Qwen3.5 conversions): the folder loads as the text model it is."""
    folder = tmp_path / "converted"
    shutil.copytree(vision_model_folder("qwen3_5"), folder)
    weights = mx.load(str(folder / "model.safetensors"))
    text = {k: v for k, v in weights.items() if not k.startswith("vision_tower.")}
    assert len(text) < len(weights)
    mx.save_safetensors(str(folder / "model.safetensors"), text, metadata={"format": "mlx"})
    index = {"metadata": {}, "weight_map": dict.fromkeys(sorted(text), "model.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert carries_tower(vision_model_folder("qwen3_5")) and not carries_tower(folder)

    model = load_model(str(folder))
    assert model.vision is None
    with serving(Engine(model, TEST_CACHE)) as (url, _), ollama.Client(host=url) as client:
        assert "vision" not in client.show("m").capabilities
        said = client.chat(model="m", messages=[{"role": "user", "content": ASK}],
                           options={"num_predict": 2})  # fmt: skip
        assert said.done
        with pytest.raises(ollama.ResponseError) as e:
            client.chat(model="m", messages=[{"role": "user", "content": ASK, "images": [PNG]}])
    assert e.value.status_code == 400 and "text-only" in e.value.error
