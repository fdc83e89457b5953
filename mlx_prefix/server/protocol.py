"""OpenAI request bodies -> engine records. Pure: validates, never touches the engine.

Unknown fields are ignored (clients send many we have no use for); known fields with
the wrong type or range raise InvalidRequest naming the field in `param`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from mlx_prefix.errors import InvalidRequest
from mlx_prefix.records import CachePreference, PromptInput, SamplingParams

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_STOP_SEQUENCES = 16
_SCOPE = re.compile(r"off|full|auto(:\d+)?|\d+")
# A lone surrogate can only enter through a \uD800-\uDFFF escape: raw UTF-8 cannot
# encode one. (An escaped backslash before "uD8.." matches too; the walk then finds none.)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
SEED_LIMIT = 2**64  # mx.random.key takes an unsigned 64-bit seed
_MISSING = object()


@dataclass(frozen=True)
class Limits:
    default_max_tokens: int
    max_tokens: int  # largest max_tokens accepted (context length or the server's cap)


@dataclass(frozen=True)
class GenerationRequest:
    kind: Literal["chat", "completion"]
    model: str | None  # as the client named it; None when absent
    prompt: PromptInput
    sampling: SamplingParams
    cache: CachePreference
    stream: bool
    # The body field that set sampling.max_tokens; None: the server's default, which the
    # engine clamps to the context left after the prompt (never an error).
    max_tokens_param: str | None
    include_usage: bool  # stream_options.include_usage: a final chunk carrying usage
    parse_tools: bool  # tools were offered and tool_choice is not "none"


@dataclass(frozen=True)
class WarmRequest:
    prompt: PromptInput
    pin: bool


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise InvalidRequest("request body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # bad JSON or UTF-8, or an integer past Python's digit limit
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, not {_json_type(body)}")
    if _SURROGATE_ESCAPE.search(raw) and (where := _lone_surrogate(body)) is not None:
        raise InvalidRequest(
            f"{where or 'a key'} contains a lone UTF-16 surrogate escape (\\ud800-\\udfff "
            "without its pair), which is not valid Unicode text",
            param=where or None,
        )
    return body


def _lone_surrogate(body: dict[str, Any]) -> str | None:
    """The path of the first string (or key: "") not encodable as UTF-8; None if none.
    Iterative: the body may be nested as deep as the JSON parser allows."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                try:
                    key.encode("utf-8")
                except UnicodeEncodeError:
                    return ""
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
    return None


def parse_chat(body: dict[str, Any], limits: Limits) -> GenerationRequest:
    tools = _tools(body)
    tool_choice = _field(body, "tool_choice", (str, dict), None)
    if isinstance(tool_choice, str) and tool_choice not in ("none", "auto", "required"):
        raise InvalidRequest(
            "tool_choice must be 'none', 'auto', 'required' or an object", param="tool_choice"
        )
    offer_tools = tools is not None and tool_choice != "none"
    prompt = PromptInput(
        messages=parse_messages(body.get("messages", _MISSING)),
        tools=tools if offer_tools else None,
        chat_template_kwargs=_field(body, "chat_template_kwargs", dict, None) or {},
    )
    # The engine reports the sampled token's logprob only, not its alternatives.
    if _int(body, "top_logprobs", 0, lo=0, hi=20):
        raise InvalidRequest(
            "top_logprobs is not supported: only the sampled tokens' logprobs are returned "
            "(send logprobs: true without top_logprobs, or top_logprobs: 0)",
            param="top_logprobs",
        )
    logprobs = bool(_field(body, "logprobs", bool, False))
    return _generation("chat", body, prompt, limits, logprobs, parse_tools=offer_tools)


def parse_completion(body: dict[str, Any], limits: Limits) -> GenerationRequest:
    prompt = PromptInput(text=_prompt_text(body.get("prompt", _MISSING)))
    if _field(body, "echo", bool, False):
        raise InvalidRequest("echo is not supported", param="echo")
    if _field(body, "suffix", str, ""):
        raise InvalidRequest("suffix is not supported", param="suffix")
    if _int(body, "best_of", 1, lo=1, hi=None) != 1:
        raise InvalidRequest("only best_of=1 is supported", param="best_of")
    logprobs = _field(body, "logprobs", (bool, int), None)
    if isinstance(logprobs, int) and not isinstance(logprobs, bool) and not 0 <= logprobs <= 5:
        raise InvalidRequest("logprobs must be between 0 and 5", param="logprobs")
    return _generation("completion", body, prompt, limits, bool(logprobs), parse_tools=False)


def parse_warm(body: dict[str, Any]) -> WarmRequest:
    if ("messages" in body) == ("prompt" in body):
        raise InvalidRequest("give exactly one of 'messages' or 'prompt'")
    if "messages" in body:
        prompt = PromptInput(
            messages=parse_messages(body["messages"]),
            tools=_tools(body),
            chat_template_kwargs=_field(body, "chat_template_kwargs", dict, None) or {},
        )
    else:
        prompt = PromptInput(text=_prompt_text(body["prompt"]))
    return WarmRequest(prompt=prompt, pin=bool(_field(body, "pin", bool, False)))


def parse_messages(messages: Any) -> tuple[dict[str, Any], ...]:
    if messages is _MISSING:
        raise InvalidRequest("'messages' is required", param="messages")
    if not isinstance(messages, list):
        raise InvalidRequest(
            f"'messages' must be an array, not {_json_type(messages)}", param="messages"
        )
    if not messages:
        raise InvalidRequest("'messages' must not be empty", param="messages")
    return tuple(_message(m, i) for i, m in enumerate(messages))


def _message(message: Any, i: int) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(message, dict):
        raise InvalidRequest(f"{param} must be an object", param=param)
    role = message.get("role")
    if not isinstance(role, str):
        raise InvalidRequest(
            f"{param}.role is required and must be a string", param=f"{param}.role"
        )
    if role not in ROLES:
        raise InvalidRequest(
            f"{param}.role {role!r} is not one of {', '.join(sorted(ROLES))}", param=f"{param}.role"
        )
    out = dict(message)
    if role == "developer":
        # OpenAI's newer name for the system role; chat templates only know "system".
        out["role"] = "system"
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant" or not isinstance(tool_calls, list):
            raise InvalidRequest(
                f"{param}.tool_calls must be an array on an assistant message",
                param=f"{param}.tool_calls",
            )
        out["tool_calls"] = [
            _tool_call(tc, f"{param}.tool_calls[{j}]") for j, tc in enumerate(tool_calls)
        ]
    content = message.get("content", _MISSING)
    if content is _MISSING or content is None:
        if role != "assistant":
            raise InvalidRequest(f"{param}.content is required", param=f"{param}.content")
        out["content"] = ""
    else:
        out["content"] = _content_text(content, f"{param}.content")
    return out


def _content_text(content: Any, param: str) -> str:
    # Parts are joined so that ["a", "b"] as parts renders exactly like the string "ab":
    # both must produce the same tokens, or the prefix cache would miss.
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{param} must be a string or an array of text parts", param=param)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else _json_type(part)
            raise InvalidRequest(
                f"{param}[{j}]: only text content parts are supported, got {kind!r}",
                param=f"{param}[{j}]",
            )
        if not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{param}[{j}].text must be a string", param=f"{param}[{j}].text")
        texts.append(part["text"])
    return "".join(texts)


def _tool_call(tool_call: Any, param: str) -> Any:
    # Chat templates iterate over arguments as a mapping, while OpenAI clients send the
    # JSON-encoded string they received; mlx_lm.server decodes it the same way.
    if not isinstance(tool_call, dict):
        raise InvalidRequest(f"{param} must be an object", param=param)
    function = tool_call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"] or "{}")
        except (ValueError, RecursionError):
            return tool_call
        return {**tool_call, "function": {**function, "arguments": arguments}}
    return tool_call


def _tools(body: dict[str, Any]) -> tuple[dict[str, Any], ...] | None:
    tools = _field(body, "tools", list, None)
    if not tools:
        return None
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise InvalidRequest(f"tools[{i}] must be an object", param=f"tools[{i}]")
    return tuple(tools)


def _prompt_text(prompt: Any) -> str:
    if prompt is _MISSING:
        raise InvalidRequest("'prompt' is required", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if isinstance(prompt, str):
        return prompt
    raise InvalidRequest("'prompt' must be a string or an array of one string", param="prompt")


def _generation(
    kind: Literal["chat", "completion"],
    body: dict[str, Any],
    prompt: PromptInput,
    limits: Limits,
    logprobs: bool,
    *,
    parse_tools: bool,
) -> GenerationRequest:
    n = _int(body, "n", 1, lo=1, hi=None)
    if n != 1:
        raise InvalidRequest("only n=1 is supported", param="n")
    stream = bool(_field(body, "stream", bool, False))
    stream_options = _field(body, "stream_options", dict, None) or {}
    include_usage = stream_options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise InvalidRequest(
            "stream_options.include_usage must be a boolean", param="stream_options.include_usage"
        )
    max_tokens, max_tokens_param = _max_tokens(body, limits)
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, lo=0.0, hi=2.0),
        top_p=_number(body, "top_p", 1.0, lo=0.0, hi=1.0),
        seed=_int(body, "seed", None, lo=0, hi=SEED_LIMIT - 1),
        stop=_stop(body),
        logprobs=logprobs,
    )
    return GenerationRequest(
        kind=kind,
        model=_field(body, "model", str, None),
        prompt=prompt,
        sampling=sampling,
        cache=_cache_preference(body),
        stream=stream,
        max_tokens_param=max_tokens_param,
        include_usage=stream and include_usage,
        parse_tools=parse_tools,
    )


def _max_tokens(body: dict[str, Any], limits: Limits) -> tuple[int, str | None]:
    # max_completion_tokens is the newer name; when both are sent it wins.
    for name in ("max_completion_tokens", "max_tokens"):
        value = _int(body, name, None, lo=1, hi=None)
        if value is None:
            continue
        if value > limits.max_tokens:
            raise InvalidRequest(
                f"{name} is {value}, more than this model allows ({limits.max_tokens})", param=name
            )
        return value, name
    return min(limits.default_max_tokens, limits.max_tokens), None


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = _field(body, "stop", (str, list), None)
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOP_SEQUENCES or not all(isinstance(s, str) for s in stops):
        raise InvalidRequest(
            f"'stop' must be a string or an array of at most {MAX_STOP_SEQUENCES} strings",
            param="stop",
        )
    return tuple(s for s in stops if s)


def _cache_preference(body: dict[str, Any]) -> CachePreference:
    pref = _field(body, "prefix_cache", dict, None)
    if pref is None:
        return CachePreference()
    enabled = pref.get("enabled", True)
    if not isinstance(enabled, bool):
        raise InvalidRequest("prefix_cache.enabled must be a boolean", param="prefix_cache.enabled")
    scope = pref.get("scope")
    if scope is not None and not (isinstance(scope, str) and _SCOPE.fullmatch(scope)):
        raise InvalidRequest(
            "prefix_cache.scope must be one of off, full, auto, auto:N or N",
            param="prefix_cache.scope",
        )
    return CachePreference(enabled=enabled, scope=scope)


def _field(body: dict[str, Any], name: str, types: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, types):
        names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        names = names.replace("dict", "object").replace("list", "array").replace("str", "string")
        raise InvalidRequest(
            f"'{name}' must be {names}, not {_json_type(value)} ({json.dumps(value)[:40]})",
            param=name,
        )
    return value


def _int(body: dict[str, Any], name: str, default: Any, *, lo: int | None, hi: int | None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"'{name}' must be an integer, not {_json_type(value)}", param=name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise InvalidRequest(f"'{name}' must be {bounds}, got {value}", param=name)
    return value


def _number(body: dict[str, Any], name: str, default: float, *, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"'{name}' must be a number, not {_json_type(value)}", param=name)
    if not math.isfinite(value):  # NaN and Infinity: Python's JSON parser accepts them
        raise InvalidRequest(f"'{name}' must be a finite number, got {value}", param=name)
    if not lo <= value <= hi:
        raise InvalidRequest(f"'{name}' must be between {lo:g} and {hi:g}, got {value}", param=name)
    return float(value)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"
