"""Tiny random-weight model folders of real mlx-lm architectures, for tests.

No hybrid or sliding-window checkpoints are reachable offline, so tests build their own:
mlx-lm's own model classes at tiny sizes, random float32 weights from a fixed seed, the
default model's SmolLM2 tokenizer, saved as an ordinary model folder and loaded back
through `load_model` like any real checkpoint.

| kind         | mlx-lm model   | layers                             | prompt cache            |
|--------------|----------------|------------------------------------|-------------------------|
| `dense`      | llama          | 2 attention                        | KVCache x2              |
| `qwen3_5`    | qwen3_5        | linear, full, linear, full         | ArraysCache + KVCache   |
| `nemotron_h` | nemotron_h     | Mamba2, attention, MLP, Mamba2     | ArraysCache + KVCache   |
| `sliding`    | gemma3_text    | sliding, global, sliding, global   | RotatingKVCache + KVCache |

Every kind has a 4096-token context; `context=` gives a longer one (an agent's 25K-token
prompt needs 32K). `think_template` swaps in a Qwen3-style template with tools,
`<tool_call>` JSON calls (mlx-lm's `json_tools` parser) and `<think>` reasoning.
`head_dim=` widens the attention heads (quantized KV needs a head size that its group
size, at least 32, divides). `tokenizer=` takes a real model's tokenizer files instead
(a folder with `tokenizer.json`, or `tokenizer.json.gz`, and `tokenizer_config.json`, as
vendored under tests/data/tokenizers): its vocabulary, special tokens and chat template,
with a 128-wide model so that a 150K-entry vocabulary still builds in a second.
"""

from __future__ import annotations

import atexit
import gzip
import importlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
from tokenizers import AddedToken, Tokenizer

from mlx_prefix.arrays import named_arrays
from mlx_prefix.models.default import ensure_default_model

TEST_MODEL_KINDS: tuple[str, ...] = ("dense", "qwen3_5", "nemotron_h", "sliding")

SLIDING_WINDOW = 32  # small, so a few hundred prompt tokens wrap the rotating cache

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_BOS, _EOS = 1, 2  # <|im_start|>, <|im_end|>
_THINK_TOKENS = ("<think>", "</think>")
# A real tokenizer's vocabulary dwarfs the layers: wider layers cost little more.
_REAL_TOKENIZER_WIDTH = {"hidden_size": 128, "intermediate_size": 256}

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 0,  # set to the tokenizer's vocab size
    "max_position_embeddings": 4096,
}

# qwen3_5's tiny text layers (linear, full, linear, full), shared with vision/testing.py.
QWEN3_5_LAYERS: dict[str, Any] = {
    "num_hidden_layers": 4,
    "full_attention_interval": 2,  # layers 1 and 3 are full attention
    "rms_norm_eps": 1e-6,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "tie_word_embeddings": True,
}

_CONFIGS: dict[str, dict[str, Any]] = {
    "dense": {
        "model_type": "llama",
        **_COMMON,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    # VL-style: mlx-lm's qwen3_5 Model wraps a text model configured by text_config.
    "qwen3_5": {
        "model_type": "qwen3_5",
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "qwen3_5_text",
            **_COMMON,
            **QWEN3_5_LAYERS,
            "rope_parameters": {
                "type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [1, 1, 0],
            },
        },
    },
    "nemotron_h": {
        "model_type": "nemotron_h",
        **_COMMON,
        "hybrid_override_pattern": "M*-M",
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 1,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
    },
    "sliding": {
        "model_type": "gemma3_text",
        **_COMMON,
        "num_hidden_layers": 4,
        "sliding_window": SLIDING_WINDOW,
        "sliding_window_pattern": 2,  # every 2nd layer is global
        "query_pre_attn_scalar": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_local_base_freq": 10000.0,
    },
}


def make_test_model(
    kind: str,
    dest: Path,
    *,
    think_template: bool = False,
    seed: int = 0,
    context: int | None = None,
    head_dim: int | None = None,
    tokenizer: Path | None = None,
    config: dict[str, Any] | None = None,
) -> Path:
    """Write a loadable model folder of `kind` into `dest` (created if missing); return it.
    `config`: another mlx-lm config to build instead, `kind` naming it.

    The same `kind` and `seed` always give the same weights (whatever the context).
    """
    if kind not in _CONFIGS and config is None:
        raise ValueError(f"unknown test model kind {kind!r}; choose from {TEST_MODEL_KINDS}")
    if tokenizer is not None and think_template:
        raise ValueError("think_template rewrites the default tokenizer; a real one has its own")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    bos: int | None
    eos: int | list[int]
    if tokenizer is None:
        vocab_size = write_tokenizer(dest, think_template=think_template)
        bos, eos = _BOS, _EOS
    else:
        vocab_size, bos, eos = copy_tokenizer(Path(tokenizer), dest)

    config = json.loads(json.dumps(config or _CONFIGS[kind]))  # deep copy
    config.update({"bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "float32"})
    for cfg in (config, config.get("text_config", {})):
        if "vocab_size" in cfg:
            cfg["vocab_size"] = vocab_size
        if tokenizer is not None and "hidden_size" in cfg:
            cfg.update(_REAL_TOKENIZER_WIDTH)
        if context is not None and "max_position_embeddings" in cfg:
            cfg["max_position_embeddings"] = context
        if head_dim is not None and "head_dim" in cfg:
            cfg["head_dim"] = head_dim

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = dict(named_arrays(model.parameters()))
    if kind == "sliding":
        # gemma3_text ties lm_head to the embeddings when the checkpoint omits it.
        weights.pop("lm_head.weight")
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    # The index mlx_lm.convert writes: pipeline-sharded loading reads it to pick each
    # rank's files (engine/sharded/load.py).
    index = {"metadata": {}, "weight_map": dict.fromkeys(sorted(weights), "model.safetensors")}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dest


def write_tokenizer(dest: Path, *, think_template: bool) -> int:
    """Copy the SmolLM2 tokenizer into `dest`; return its vocab size (added tokens included).

    With `think_template`, `<think>` and `</think>` become single tokens (non-special, as in
    Qwen3) so mlx-lm's TokenizerWrapper sees a thinking model (`has_thinking`).
    """
    source = ensure_default_model()
    for name in _TOKENIZER_FILES:
        shutil.copyfile(source / name, dest / name)
    if not think_template:
        return Tokenizer.from_file(str(dest / "tokenizer.json")).get_vocab_size()

    tok = Tokenizer.from_file(str(dest / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in _THINK_TOKENS])
    tok.save(str(dest / "tokenizer.json"))
    tok_config_path = dest / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["chat_template"] = THINK_CHAT_TEMPLATE
    tok_config["tool_parser_type"] = "json_tools"  # what mlx-lm infers for Qwen3
    if "added_tokens_decoder" in tok_config:
        # transformers takes the added tokens from this list where there is one (the
        # converted default model writes it): the think tokens must be in it too.
        tok_config["added_tokens_decoder"] = {
            str(i): {
                "content": added.content,
                "lstrip": added.lstrip,
                "normalized": added.normalized,
                "rstrip": added.rstrip,
                "single_word": added.single_word,
                "special": added.special,
            }
            for i, added in sorted(tok.get_added_tokens_decoder().items())
        }
    tok_config_path.write_text(json.dumps(tok_config, indent=2) + "\n")
    return tok.get_vocab_size()


def copy_tokenizer(source: Path, dest: Path) -> tuple[int, int | None, list[int]]:
    """Copy a real tokenizer's files into `dest`, unpacking a gzipped tokenizer.json;
    return its vocab size (added tokens included), BOS id and EOS ids."""
    packed = source / "tokenizer.json.gz"
    if packed.is_file():
        (dest / "tokenizer.json").write_bytes(gzip.decompress(packed.read_bytes()))
    else:
        shutil.copyfile(source / "tokenizer.json", dest / "tokenizer.json")
    shutil.copyfile(source / "tokenizer_config.json", dest / "tokenizer_config.json")
    tok = Tokenizer.from_file(str(dest / "tokenizer.json"))
    tok_config = json.loads((dest / "tokenizer_config.json").read_text())

    def token_id(name: str) -> int | None:
        value = tok_config.get(name)
        content = value.get("content") if isinstance(value, dict) else value
        return tok.token_to_id(content) if content else None

    eos = [t for t in (token_id("eos_token"), token_id("pad_token")) if t is not None]
    return tok.get_vocab_size(), token_id("bos_token"), eos


_cache_root: Path | None = None
_cached: dict[tuple[str, bool, int | None, int | None, str | None], Path] = {}


def cached_test_model(
    kind: str,
    think_template: bool = False,
    context: int | None = None,
    head_dim: int | None = None,
    tokenizer: Path | None = None,
) -> Path:
    """`make_test_model(kind, ...)` written once per process under a temp dir (seed 0)."""
    global _cache_root
    key = (kind, think_template, context, head_dim, str(tokenizer) if tokenizer else None)
    if key not in _cached:
        if _cache_root is None:
            _cache_root = Path(tempfile.mkdtemp(prefix="mlx-prefix-test-models-"))
            atexit.register(shutil.rmtree, _cache_root, ignore_errors=True)
        name = f"tiny-{kind}" + ("-think" if think_template else "")
        name += f"-{context // 1024}k" if context else ""
        name += f"-hd{head_dim}" if head_dim else ""
        name += f"-{Path(tokenizer).name}" if tokenizer else ""
        _cached[key] = make_test_model(
            kind,
            _cache_root / name,
            think_template=think_template,
            context=context,
            head_dim=head_dim,
            tokenizer=tokenizer,
        )
    return _cached[key]


# Qwen3's chat template in short: tools in the system turn, tool calls as <tool_call>
# JSON (written `tool_call.name`, as Qwen3 does, so mlx-lm infers its json_tools parser),
# consecutive tool results grouped into one user turn, and <think> reasoning kept only
# for assistant turns after the last real user query: earlier turns are re-rendered
# without it, so a conversation's rendered prefix changes from one request to the next.
THINK_CHAT_TEMPLATE = """\
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
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
            {%- if loop.first and content or not loop.first %}{{- '\\n' }}{%- endif %}
            {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}{{- tool_call.arguments }}
            {%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
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
