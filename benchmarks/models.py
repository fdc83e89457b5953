"""The models a run compares on, and client-side tokenization for reuse accounting.

- dense:  the bundled default, SmolLM2-135M-Instruct in float32.
- hybrid: no hybrid checkpoint is reachable offline, so a random-weight qwen3_5 (Gated
  DeltaNet linear attention + full attention every 4th layer) at a realistic small size,
  built once with mlx-lm's own classes and cached under the user cache dir. It gets the
  SmolLM2 tokenizer with `<think>` tokens and a Qwen3-style template (tools, tool calls,
  tool responses, reasoning kept only after the last user query). Its replies are noise,
  but its compute and cache structure are those of a real hybrid model.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HYBRID_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_5",
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_5_text",
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "full_attention_interval": 4,  # layers 3 and 7 are full attention
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "linear_num_value_heads": 8,
        "linear_num_key_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
        "vocab_size": 0,  # the tokenizer's
        "rope_parameters": {
            "type": "default",
            "rope_theta": 1000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
        },
    },
}


@dataclass(frozen=True)
class BenchModel:
    key: str  # "dense" | "hybrid" | a folder name for --model
    path: Path
    description: str


def dense_model() -> BenchModel:
    from mlx_prefix.models.default import ensure_default_model

    return BenchModel("dense", ensure_default_model(), "SmolLM2-135M-Instruct, float32")


def hybrid_model() -> BenchModel:
    from mlx_prefix.models.default import default_models_dir

    tag = hashlib.sha256(
        json.dumps([HYBRID_CONFIG, QWEN3_TOOLS_TEMPLATE], sort_keys=True).encode()
    ).hexdigest()[:10]
    dest = default_models_dir().parent / "bench-models" / f"qwen3_5-random-{tag}"
    if not (dest / "model.safetensors").is_file():
        _build_hybrid(dest)
    t = HYBRID_CONFIG["text_config"]
    desc = (
        f"random qwen3_5 (hybrid), hidden {t['hidden_size']}, {t['num_hidden_layers']} "
        f"layers ({t['num_hidden_layers'] // t['full_attention_interval']} full attention)"
    )
    return BenchModel("hybrid", dest, desc)


def _build_hybrid(dest: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    # The test-model helper copies the SmolLM2 tokenizer and adds <think> tokens.
    from mlx_prefix.models.testing import _write_tokenizer

    tmp = dest.with_name(dest.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    vocab = _write_tokenizer(tmp, think_template=True)
    tok_config = json.loads((tmp / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = QWEN3_TOOLS_TEMPLATE
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")

    config = json.loads(json.dumps(HYBRID_CONFIG))
    config["text_config"]["vocab_size"] = vocab
    config.update({"bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"})
    module = importlib.import_module("mlx_lm.models.qwen3_5")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tmp.replace(dest)


def resolve(key: str) -> BenchModel:
    if key == "dense":
        return dense_model()
    if key == "hybrid":
        return hybrid_model()
    path = Path(key).expanduser()
    if not path.is_dir():
        raise SystemExit(f"benchmarks: --model {key}: not a model folder (or 'dense'/'hybrid')")
    return BenchModel(path.name, path, str(path))


class Tokens:
    """The prompt token ids a server sees, rendered the way mlx-prefix renders them.

    Used only to count which tokens are new to a server (reuse accounting); both servers
    apply the same chat template, and each reply's prompt_tokens is checked against it.
    """

    def __init__(self, path: Path):
        from transformers import AutoTokenizer

        from mlx_prefix.prompt.render import ChatRenderer

        self._tok = AutoTokenizer.from_pretrained(str(path))
        self._renderer = ChatRenderer(self._tok)

    def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        from mlx_prefix.prompt.render import normalize_messages

        text = self._renderer.render_text(normalize_messages(messages), tools=tools)
        return self._renderer.encode_chat(text)

    def text(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def count(self, text: str) -> int:
        return len(self.text(text))


# Qwen3's chat template in short: tools in the system turn, tool calls as <tool_call>
# JSON, consecutive tool results grouped into one user turn, and <think> reasoning kept
# only for assistant turns after the last real user query.
QWEN3_TOOLS_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
        + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and '
        + 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": '
        + '<function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1, found=false) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if not ns.found and message.role == 'user' and message.content is string
        and not message.content.startswith('<tool_response>') %}
        {%- set ns.found = true %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n')
                .split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n')
                + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {%- set fn = call.function if call.function else call %}
            {%- if loop.first and content or not loop.first %}{{- '\\n' }}{%- endif %}
            {{- '<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
            {%- if fn.arguments is string %}{{- fn.arguments }}
            {%- else %}{{- fn.arguments | tojson }}{%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""
