"""Where checkpoints go: the chat boundaries of one prompt, placed on the chunk grid.

Checkpoint kinds (see cache.store.CheckpointKind for their eviction order):
- SYSTEM: the end of the system prompt, cut just after the next message's start token,
  the universal prefix of every request with that system prompt;
- LAST_MESSAGE: where the last message begins, found by sentinel substitution:
  render again with its content replaced by a short sentinel; the common token prefix
  of the two renders is where it begins (seed 003; rendering messages[:-1] is not
  always a prefix of the full render);
- HISTORY: the end of the history before the generation prompt, and the end of the
  prompt itself (the next turn's history starts with it);
- PERIODIC: every N tokens, so a divergence deep inside a long document still restores
  close to it.
Every position is aligned down onto the grid, so a checkpoint is always a point where a
cold prefill of the same tokens also ends a chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlx_prefix.cache.store import CheckpointKind
from mlx_prefix.config import CacheConfig
from mlx_prefix.engine.request import PromptInput
from mlx_prefix.errors import InvalidRequest
from mlx_prefix.prompt.grid import ChunkGrid
from mlx_prefix.prompt.render import ChatRenderer, normalize_messages

SENTINEL = "\u2063"  # invisible separator: short, and never merges across a message start


@dataclass(frozen=True, slots=True)
class Checkpoint:
    position: int  # tokens before the cut; a grid point
    kind: CheckpointKind


@dataclass(frozen=True)
class RenderedPrompt:
    tokens: tuple[int, ...]
    checkpoints: tuple[Checkpoint, ...]  # ascending positions, 0 < position <= len(tokens)
    is_chat: bool


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _special_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


def detect_grid(renderer: ChatRenderer, chunk_size: int) -> ChunkGrid:
    """Find the template's message-start token and generation prompt from two renders."""
    if not renderer.has_template:
        return ChunkGrid(chunk_size)
    base = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    longer = [*base, {"role": "user", "content": "c"}]
    try:
        t_base = renderer.encode_chat(renderer.render_text(base, add_generation_prompt=False))
        t_longer = renderer.encode_chat(renderer.render_text(longer, add_generation_prompt=False))
        t_gen = renderer.encode_chat(renderer.render_text(longer, add_generation_prompt=True))
    except InvalidRequest:
        return ChunkGrid(chunk_size)
    specials = _special_ids(renderer.tokenizer)
    added = t_longer[common_prefix_length(t_base, t_longer) :]
    segment = next((t for t in added if t in specials), None)
    suffix: tuple[int, ...] = ()
    if t_gen[: len(t_longer)] == t_longer and len(t_gen) > len(t_longer):
        suffix = tuple(t_gen[len(t_longer) :])
    return ChunkGrid(
        chunk_size,
        segment_tokens=frozenset([segment]) if segment is not None else frozenset(),
        generation_suffix=suffix,
    )


class PromptPlanner:
    """Renders prompts to tokens and plans their checkpoints. Thread-safe (no mutable state)."""

    def __init__(self, tokenizer: Any, config: CacheConfig):
        self.renderer = ChatRenderer(tokenizer)
        self.config = config
        self.grid = detect_grid(self.renderer, config.prefill_chunk)

    def plan(self, prompt: PromptInput) -> RenderedPrompt:
        if (prompt.messages is None) == (prompt.text is None):
            raise InvalidRequest("give exactly one of messages or prompt text")
        if prompt.text is not None:
            tokens = self.renderer.encode_completion(prompt.text)
            if not tokens:
                raise InvalidRequest("the prompt is empty", param="prompt")
            return RenderedPrompt(tuple(tokens), self._periodic(tokens), is_chat=False)
        messages = normalize_messages(prompt.messages or ())
        tokens = self.renderer.messages_tokens(prompt, messages)
        return RenderedPrompt(tuple(tokens), self._chat_checkpoints(prompt, messages, tokens), True)

    def _periodic(self, tokens: Sequence[int]) -> tuple[Checkpoint, ...]:
        step = self.config.checkpoint_interval
        return tuple(
            Checkpoint(p, CheckpointKind.PERIODIC) for p in range(step, len(tokens) + 1, step)
        )

    def _sentinel_start(
        self, prompt: PromptInput, messages: list[dict[str, Any]], index: int, tokens: list[int]
    ) -> int:
        """Token position where messages[index]'s content begins."""
        probe = [dict(m) for m in messages]
        probe[index]["content"] = SENTINEL
        return common_prefix_length(tokens, self.renderer.messages_tokens(prompt, probe))

    def _chat_checkpoints(
        self, prompt: PromptInput, messages: list[dict[str, Any]], tokens: list[int]
    ) -> tuple[Checkpoint, ...]:
        grid, n = self.grid, len(tokens)
        found: dict[int, CheckpointKind] = {}

        def add(position: int, kind: CheckpointKind) -> None:
            p = grid.align(tokens, position)
            if p > 0 and kind > found.get(p, -1):
                found[p] = kind

        for cp in self._periodic(tokens):
            add(cp.position, cp.kind)
        if grid.is_point(tokens, n):
            add(n, CheckpointKind.HISTORY)
        suffix = grid.generation_suffix
        if suffix and tuple(tokens[n - len(suffix) :]) == suffix:
            # Just after the generation prompt's first (special) token: survives a next
            # turn whose template renders this reply differently (e.g. strips <think>).
            add(n - len(suffix) + 1, CheckpointKind.HISTORY)
        else:
            add(n - 1, CheckpointKind.HISTORY)
        if len(messages) > 1:
            add(
                self._sentinel_start(prompt, messages, len(messages) - 1, tokens),
                CheckpointKind.LAST_MESSAGE,
            )
        if messages[0]["role"] in ("system", "developer") and len(messages) > 1:
            add(self._sentinel_start(prompt, messages, 1, tokens), CheckpointKind.SYSTEM)
        return tuple(Checkpoint(p, found[p]) for p in sorted(found))
