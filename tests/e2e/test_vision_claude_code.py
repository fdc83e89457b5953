"""Claude Code itself (`claude -p`) reads a screenshot with its Read tool: the PNG comes
back as an image block inside a tool_result, the server decodes it, the vision model
(a tiny Qwen3.5 hybrid with a 32K context) computes it, and a second run of the same
task reads nearly all of its input from the cache, the image included.

The model's weights are random, so its replies are scripted (as engine_helpers'
scripted_engine scripts them, keyed here on what the prompt holds, since Claude Code
sends no seed): a prompt that names the screenshot and holds no image replies with a
call to Read on it, a prompt holding an image replies "All done.". Everything else runs
as served: Claude Code's real ~12.5K-token prompt, its tool run, the Anthropic parse,
the image key, the prefill with the tower's features, the cache. The model's template
is Qwen3.5's with one change: Claude Code 2.1.328 sends its environment as a system
message after the user's, which Qwen3.5's own template refuses (a 400 from the server);
this one renders it where it stands. `make test-deps` installs Claude Code (agents.py
finds it); without it the test skips.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import agents
from support.agent_e2e import DONE, Counted
from support.agents import find_claude, folders
from support.engine_helpers import ScriptedSampler, open_engine
from support.server_fakes import serving
from support.vision_models import encoded, picture, vision_model_folder

from mlx_prefix.config import CacheConfig, EngineConfig
from mlx_prefix.engine.decode import arrival
from mlx_prefix.engine.decode.sampling import TokenSampler
from mlx_prefix.models.load import load_model
from mlx_prefix.vision.testing import QWEN_IMAGE_PAD

CLAUDE, WHY = find_claude()
pytestmark = pytest.mark.skipif(CLAUDE is None, reason=WHY)

SHOT = "screen.png"
TASK = f"Look at {SHOT} in this folder and tell me what it shows."
# Claude Code's prompt is ~12.5K tokens: checkpoints every 2048, small chunks.
CACHE = CacheConfig(budget_bytes=2 << 30, prefill_chunk=256, checkpoint_interval=2048)


def run_claude(url: str, tmp: Path) -> dict:
    """One headless run of the task (agents.py's, with room for the scripted replies)."""
    assert CLAUDE is not None
    return agents.run_claude(CLAUDE, url, tmp, TASK, max_output_tokens=256)


def image_counters(url: str) -> tuple[float, float]:
    """The server's images and image tokens so far (/metrics)."""
    text = httpx.get(f"{url}/metrics").text
    images = re.search(r"^mlx_prefix_images_total (\S+)$", text, re.M)
    tokens = re.search(r"^mlx_prefix_image_tokens_total (\S+)$", text, re.M)
    assert images and tokens
    return float(images.group(1)), float(tokens.group(1))


@pytest.fixture
def scripted(monkeypatch, tmp_path) -> Iterator[tuple[str, list[str]]]:
    """A live server over the real vision engine whose replies follow the module's
    script, and the screenshot in Claude Code's working folder; yields the server's URL
    and the script's choices, one per request, in order."""
    model = load_model(str(vision_model_folder("qwen3_5", context=32768, system_anywhere=True)))
    tokenizer = model.tokenizer
    eos = min(tokenizer.eos_token_ids)
    _, work = folders(tmp_path)
    shot = work / SHOT
    shot.write_bytes(encoded(picture(96, 64, seed=5)))
    call = f"<function=Read>\n<parameter=file_path>\n{shot}\n</parameter>\n</function>"
    chosen: list[str] = []

    def sampler(params: Any, constraint: Any, history: Any = (), *rest: Any) -> Any:
        text = tokenizer.decode([t for t in history if t != QWEN_IMAGE_PAD])
        if QWEN_IMAGE_PAD in history:
            chosen.append("done")
            reply = DONE
        elif SHOT in text and chosen.count("read") <= chosen.count("done"):
            chosen.append("read")
            reply = f"<tool_call>\n{call}\n</tool_call>"
        elif SHOT in text:  # a Read that brought no image back: end the run, the test fails
            chosen.append("no image")
            reply = "No image came back."
        else:  # a request of Claude Code's own (none is expected): sampled as served
            chosen.append("sampled")
            return TokenSampler(params, constraint, history, *rest)
        if text.endswith("<think>\n"):  # the generation prompt opened the reasoning
            reply = "</think>\n\n" + reply
        ids = tokenizer.encode(reply, add_special_tokens=False)
        assert tokenizer.decode(ids) == reply
        return ScriptedSampler(ids, eos)

    monkeypatch.setattr(arrival, "TokenSampler", sampler)
    with (
        open_engine(model, CACHE, EngineConfig(prefetch_next_turn=False)) as engine,
        serving(engine) as (url, _),
    ):
        yield url, chosen


def test_claude_code_reads_a_screenshot_and_its_second_run_hits_through_the_image(
    scripted, tmp_path
):
    url, chosen = scripted
    first = run_claude(url, tmp_path)
    # Claude Code called Read, sent the PNG back as an image in the tool_result, and the
    # model's reply to the prompt holding it ended the run.
    assert first["api_error_status"] is None, first["result"]
    assert first["result"] == DONE
    assert chosen == ["read", "done"]
    images, image_tokens = image_counters(url)
    assert images == 1 and image_tokens > 0
    with Counted(url) as counted:
        second = run_claude(url, tmp_path)
    assert second["result"] == DONE and chosen[2:] == ["read", "done"]
    assert image_counters(url) == (2 * images, 2 * image_tokens)  # the same image again
    # Both of its requests restored from the first run's: the second one past the image
    # (a prompt's last token is always computed, and the reply's tool call id differs).
    assert counted.prompt > 2 * 8000  # Claude Code's real prompt, twice
    assert counted.cached >= 0.95 * counted.prompt, counted
