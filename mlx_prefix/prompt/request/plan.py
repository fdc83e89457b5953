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
- PERIODIC: geometrically spaced near the start (64, 128, 256), then every N tokens
  (grid.py: ChunkGrid.periodic), so a divergence anywhere restores within
  max(63, p/2) and N tokens before it; and one tail checkpoint at the last multiple of
  the chunk size inside the prompt, so "same document, new question at its end"
  restores next to the question;
- BREAKPOINT: where the client marked its stable prefix (`cache_control`), found by
  breakpoints.py; kept after the last message's start, before the system prompt.
Every position is aligned down onto the grid, so a checkpoint is always a point where a
cold prefill of the same tokens also ends a chunk.
The grid itself comes from the template (template_grid.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from mlx_prefix.cache.store import CheckpointKind
from mlx_prefix.cache.token_ids import TokenIds
from mlx_prefix.config import CacheConfig
from mlx_prefix.conversation import rendered_images
from mlx_prefix.errors import InvalidRequest
from mlx_prefix.prompt.reply.reasoning import ReasoningMarkers
from mlx_prefix.prompt.reply.thinking import NO_EDGES, ReasoningEdges
from mlx_prefix.prompt.request.breakpoints import breakpoint_positions
from mlx_prefix.prompt.request.render import SENTINEL, ChatRenderer, common_prefix_length
from mlx_prefix.prompt.request.template_grid import detect_grid
from mlx_prefix.records import PromptInput
from mlx_prefix.vision.key import ImageSpan, salt
from mlx_prefix.vision.prompt import VisionPrompt

if TYPE_CHECKING:
    from mlx_prefix.vision.family import PreparedImage, VisionFamily

# Checkpoints at the starts of this many of a prompt's last assistant turns (see
# _chat_checkpoints): each costs a hybrid model its recurrent state.
TURN_CHECKPOINTS = 4


@dataclass(frozen=True, slots=True)
class Checkpoint:
    position: int  # tokens before the cut; a grid point
    kind: CheckpointKind
    marked: bool = False  # a client breakpoint landed here (whatever kind won)


@dataclass(frozen=True)
class RenderedPrompt:
    tokens: tuple[int, ...]  # a TokenIds: packed once here, for every cache lookup
    checkpoints: tuple[Checkpoint, ...]  # ascending positions, 0 < position <= len(tokens)
    is_chat: bool
    # The prompt leaves a think block open: the reply starts as reasoning.
    opens_reasoning: bool = False
    # What the reply's reasoning drops where written: the template writes it itself when
    # the reasoning comes back (ReasoningMarkers.reply_edges; Gemma 4's `\n`s).
    reasoning_edges: ReasoningEdges = NO_EDGES
    # The prompt's images (tokens is then the cache key: their spans salted); None: none.
    vision: VisionPrompt | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, TokenIds):
            object.__setattr__(self, "tokens", TokenIds(self.tokens))


class PromptPlanner:
    """Renders prompts to tokens and plans their checkpoints. Thread-safe (no mutable state)."""

    def __init__(
        self,
        tokenizer: Any,
        config: CacheConfig,
        template_args: dict[str, Any] | None = None,
        vision: VisionFamily | None = None,
    ):
        self.renderer = ChatRenderer(tokenizer, template_args)
        self.config = config
        self.grid = detect_grid(self.renderer, config.prefill_chunk)
        if vision is not None:
            # An image's start is a grid point: right after the token that opens it.
            segment = self.grid.segment_tokens | {vision.opener}
            self.grid = replace(self.grid, segment_tokens=segment)
        self.vision = vision  # the model's vision part (vision/tower.py); None: text only
        self.reasoning = ReasoningMarkers.of(self.renderer)  # the model's think markers

    def prompt_tokens(self, prompt: PromptInput) -> list[int]:
        """The tokens `prompt` renders to (no checkpoint planning, no context check)."""
        if prompt.text is not None:
            return self.renderer.encode_completion(prompt.text)
        return self.tokens(prompt)

    def tokens(self, prompt: PromptInput, contents: Mapping[int, str] | None = None) -> list[int]:
        """The tokens of `prompt`'s conversation and its assistant prefix, with `contents`
        replacing some messages' content (a probe). With images: the cache key, each
        image's placeholder run salted with its key (vision/key.py)."""
        return self.key(prompt, contents).tokens

    def key(
        self,
        prompt: PromptInput,
        contents: Mapping[int, str] | None = None,
        prepared: dict[str, PreparedImage] | None = None,
    ) -> RenderedKey:
        """tokens() with the image spans it salted. A plan's probes render the same images
        again: `prepared` (the plan's own, by identity) prepares each once whatever the
        family's byte-capped cache across requests still holds."""
        images = rendered_images(prompt.messages or (), contents)
        if not images:
            return RenderedKey(self._ids(prompt, contents), (), ())
        if self.vision is None:
            raise InvalidRequest(
                f"{images[0].param or 'messages'}: this model is text-only and cannot take "
                "images; serve a vision model (its folder has a vision_config) to send them",
                param=images[0].param or "messages",
                code="model_not_multimodal",
            )
        ids = self._ids(prompt, contents)
        vision, memo = self.vision, {} if prepared is None else prepared
        for at in images:
            if at.image.identity not in memo:
                memo[at.image.identity] = vision.prepare_input(at.image)
        items = [memo[at.image.identity] for at in images]
        expanded, spans = vision.expand(ids, items)
        return RenderedKey(salt(expanded, spans), tuple(spans), tuple(items))

    def _ids(self, prompt: PromptInput, contents: Mapping[int, str] | None) -> list[int]:
        """The template's token ids, images still one placeholder each."""
        text = self.renderer.messages_text(prompt, contents)
        prefix = prompt.assistant_prefix
        if prefix and self.reasoning is not None and self.reasoning.opens_text(text):
            # A forced tool call is never reasoning: the think block the generation
            # prompt opened is closed first, as the template closes one.
            prefix = self.reasoning.close_text + prefix
        return self.renderer.encode_chat(text + prefix)

    def plan(self, prompt: PromptInput) -> RenderedPrompt:
        if (prompt.messages is None) == (prompt.text is None):
            raise InvalidRequest("give exactly one of messages or prompt text")
        if prompt.text is not None:
            tokens = self.renderer.encode_completion(prompt.text)
            if not tokens:
                raise InvalidRequest("the prompt is empty", param="prompt")
            found = {cp.position: cp.kind for cp in self._periodic(tokens)}
            return RenderedPrompt(tuple(tokens), self._with_tail(tokens, found), False)
        prepared: dict[str, PreparedImage] = {}
        key = self.key(prompt, prepared=prepared)
        tokens = key.tokens
        checkpoints = self._chat_checkpoints(prompt, tokens, key.spans, prepared)
        opens = self.reasoning is not None and self.reasoning.opens(tokens)
        vision = None
        if key.spans:
            assert self.vision is not None
            vision = VisionPrompt(
                self.vision,
                key.spans,
                self.vision.table(len(tokens), key.spans),
                {s.key: image for s, image in zip(key.spans, key.images, strict=True)},
            )
        edges = self.reply_edges(opens)
        return RenderedPrompt(tuple(tokens), checkpoints, True, opens, edges, vision)

    def reply_edges(self, opened: bool) -> ReasoningEdges:
        """What a reply's reasoning drops where its model wrote them (`opened`: its
        prompt left the think block open; ReasoningMarkers.reply_edges)."""
        return self.reasoning.reply_edges(opened) if self.reasoning is not None else NO_EDGES

    def _periodic(self, tokens: Sequence[int]) -> tuple[Checkpoint, ...]:
        positions = self.grid.periodic(len(tokens), self.config.checkpoint_interval)
        return tuple(Checkpoint(p, CheckpointKind.PERIODIC) for p in positions)

    def _with_tail(
        self, tokens: Sequence[int], found: dict[int, CheckpointKind]
    ) -> tuple[Checkpoint, ...]:
        """`found` as checkpoints, plus the tail: the last multiple of the chunk size before
        the prompt's end (a grid point, or the one before it where it falls inside an
        image), when it lies after every checkpoint inside the prompt and before the
        history-end ones (a new question after the same long text then restores next to
        it, not at the text's start)."""
        n = len(tokens)
        tail = self.grid.align(tokens, (n - 1) // self.grid.chunk_size * self.grid.chunk_size)
        history = CheckpointKind.HISTORY
        inside = max((p for p, k in found.items() if k != history), default=0)
        end = min((p for p, k in found.items() if k == history), default=n)
        if inside < tail < end:
            found = {**found, tail: CheckpointKind.PERIODIC}
        return tuple(Checkpoint(p, found[p]) for p in sorted(found))

    def _sentinel_start(
        self,
        prompt: PromptInput,
        index: int,
        tokens: list[int],
        prepared: dict[str, PreparedImage] | None = None,
    ) -> int:
        """Token position where messages[index]'s content begins."""
        probe = self.key(prompt, {index: SENTINEL}, prepared).tokens
        return common_prefix_length(tokens, probe)

    def _chat_checkpoints(
        self,
        prompt: PromptInput,
        tokens: list[int],
        spans: Sequence[ImageSpan] = (),
        prepared: dict[str, PreparedImage] | None = None,
    ) -> tuple[Checkpoint, ...]:
        grid, n = self.grid, len(tokens)
        messages = prompt.messages or ()
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
            # Just after the generation prompt's last segment token: survives a next turn
            # whose template renders this reply differently (e.g. strips <think>).
            cuts = [i + 1 for i, t in enumerate(suffix) if t in grid.segment_tokens]
            add(n - len(suffix) + (cuts[-1] if cuts else 0), CheckpointKind.HISTORY)
        else:
            add(n - 1, CheckpointKind.HISTORY)
        starts: dict[int, int] = {}  # message index -> content start; one render each

        def start(index: int) -> int:
            if index not in starts:
                starts[index] = self._sentinel_start(prompt, index, tokens, prepared)
            return starts[index]

        if len(messages) > 1:
            add(start(len(messages) - 1), CheckpointKind.LAST_MESSAGE)
            if messages[0].role == "system":
                add(start(1), CheckpointKind.SYSTEM)
        marked = set()
        for position in breakpoint_positions(self.renderer, prompt, tokens, start):
            add(position, CheckpointKind.BREAKPOINT)
            marked.add(grid.align(tokens, position))
        planned = {c.position: c.kind for c in self._with_tail(tokens, found)}
        # Where the last assistant turns open: a template that re-renders an earlier reply
        # once the conversation grows (GLM-4.7, DeepSeek V3.1 and MiniMax M2 drop its
        # reasoning) makes the next request diverge at the first of them, and a client
        # that sends back other replies than the server's at the last (the generation
        # prompt's). Each was the last once, so a conversation built turn by turn has one
        # at every turn; a long history arriving cold gets the recent ones.
        for position in grid.turn_starts(tokens)[-TURN_CHECKPOINTS:]:
            planned.setdefault(position, CheckpointKind.HISTORY)
        # Where each image begins and ends (grid points): a request that sends another
        # image there, or none, diverges exactly at its start, one that asks something
        # else of the same image past its end; a hybrid model restores only at
        # checkpoints, so the next screenshot starts from the text before it.
        for span in spans:
            planned.setdefault(span.start, CheckpointKind.HISTORY)
            if span.end < n:
                planned.setdefault(span.end, CheckpointKind.HISTORY)
        return tuple(Checkpoint(p, planned[p], p in marked) for p in sorted(planned))


@dataclass(frozen=True, slots=True)
class RenderedKey:
    """A conversation's key tokens and the image spans salted in them."""

    tokens: list[int]
    spans: tuple[ImageSpan, ...]
    images: tuple[PreparedImage, ...]  # the spans' images, in order
