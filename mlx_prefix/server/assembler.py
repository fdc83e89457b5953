"""Engine token events -> text and tool-call deltas, for every API family: tool markup
never leaks as text, and whitespace-only text around calls is dropped (see
prompt/tool_calls.py, shared with the engine's next-turn prefetch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlx_prefix.records import DoneEvent, PromptInput, TokenEvent

from . import responses as R
from .protocol.request import GenerationRequest
from .tools import ReplySplitter, ToolCallFormatter, ToolSyntax


@dataclass(frozen=True)
class Delta:
    text: str
    tool_calls: list[dict[str, Any]]
    logprobs: list[R.TokenLogprob]

    def __bool__(self) -> bool:
        return bool(self.text or self.tool_calls or self.logprobs)


@dataclass
class Assembler:
    """Turns token events into text / tool-call deltas (tool markup never leaks as text)."""

    logprobs: bool
    splitter: ReplySplitter | None = None
    formatter: ToolCallFormatter | None = None
    made_tool_call: bool = False
    tokenizer: Any = None  # decodes the tokens of logprobs
    _texts: dict[int, str] = field(default_factory=dict)  # token id -> its text

    @classmethod
    def for_request(cls, req: GenerationRequest, tokenizer: Any, streaming: bool) -> Assembler:
        syntax = ToolSyntax.of(tokenizer) if req.parse_tools else None
        return cls.build(req.sampling.logprobs, syntax, req.prompt, streaming, tokenizer)

    @classmethod
    def build(
        cls,
        logprobs: bool,
        syntax: ToolSyntax | None,
        prompt: PromptInput,
        streaming: bool,
        tokenizer: Any = None,
    ) -> Assembler:
        """Tool calls are parsed when `syntax` is given (tools offered, the tokenizer
        knows their markup), named by the prompt's reply_tool_call_ids."""
        if syntax is None:
            return cls(logprobs=logprobs, tokenizer=tokenizer)
        ids = prompt.reply_tool_call_ids
        return cls(
            logprobs=logprobs,
            splitter=ReplySplitter(syntax),
            formatter=ToolCallFormatter(syntax, prompt.tools, streaming, ids),
            tokenizer=tokenizer,
        )

    def feed(self, event: TokenEvent) -> Delta:
        lps = []
        if self.logprobs and event.logprob is not None:
            # Each token as decoded on its own, the sampled one like its alternatives (the
            # text delta may hold back a stop string or an incomplete character).
            token = self._text(event.token) if event.token is not None else event.text
            top = tuple(R.Alternative(self._text(t.token), t.logprob) for t in event.top_logprobs)
            lps.append(R.TokenLogprob(token, event.logprob, top))
        if self.splitter is None:
            return Delta(event.text, [], lps)
        return self._split(self.splitter.feed(event.text), lps)

    def _text(self, token: int) -> str:
        if token not in self._texts:
            self._texts[token] = self.tokenizer.decode([token])
        return self._texts[token]

    def finish(self) -> Delta:
        if self.splitter is None:
            return Delta("", [], [])
        return self._split(self.splitter.finish(), [])

    def finish_reason(self, done: DoneEvent) -> str:
        if done.finish_reason == "stop" and self.made_tool_call:
            return "tool_calls"
        return done.finish_reason

    def _split(self, split: Any, lps: list[R.TokenLogprob]) -> Delta:
        assert self.formatter is not None
        calls, failed = self.formatter.format(split.calls) if split.calls else ([], "")
        self.made_tool_call |= bool(calls)
        return Delta(split.text + failed, calls, lps)
