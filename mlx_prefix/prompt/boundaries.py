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
  (prompt/grid.py: ChunkGrid.periodic), so a divergence anywhere restores within
  max(63, p/2) and N tokens before it; and one tail checkpoint at the last multiple of
  the chunk size inside the prompt, so "same document, new question at its end"
  restores next to the question;
- BREAKPOINT: where the client marked its stable prefix (`cache_control`), found by
  prompt/breakpoints.py; kept after the last message's start, before the system prompt.
Every position is aligned down onto the grid, so a checkpoint is always a point where a
cold prefill of the same tokens also ends a chunk.

How close a boundary lands depends on the template's special tokens (detect_grid):
ChatML, Llama 3, Phi-3 and DeepSeek put one before every message's content, so every
message start is a grid point. Templates with none there (Mistral v1: `[INST]` is plain
text) cut after the end-of-turn token `</s>` instead, one point per exchange. Templates
that merge the system prompt into the first user turn as plain text (Gemma) have no
special token at the system end: SYSTEM falls back to the turn's start or a multiple of
the chunk size. Without any, every boundary falls back to multiples of the chunk size.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from mlx_prefix.cache.store import CheckpointKind
from mlx_prefix.cache.token_ids import TokenIds
from mlx_prefix.config import CacheConfig
from mlx_prefix.conversation import Message, Role, ToolCall
from mlx_prefix.errors import InvalidRequest
from mlx_prefix.prompt.breakpoints import breakpoint_positions
from mlx_prefix.prompt.grid import ChunkGrid
from mlx_prefix.prompt.reasoning import ReasoningMarkers
from mlx_prefix.prompt.render import ChatRenderer
from mlx_prefix.prompt.thinking import NO_EDGES, ReasoningEdges
from mlx_prefix.records import PromptInput
from mlx_prefix.vision.key import ImageSpan
from mlx_prefix.vision.prompt import VisionPrompt

if TYPE_CHECKING:
    from mlx_prefix.vision.tower import VisionFamily

log = logging.getLogger("mlx_prefix.prompt")

SENTINEL = "\u2063"  # invisible separator: short, and never merges across a message start

# Checkpoints at the starts of this many of a prompt's last assistant turns (see
# _chat_checkpoints): each costs a hybrid model its recurrent state.
TURN_CHECKPOINTS = 4

# Conversations rendered once per model to find the template's segment tokens; the second
# is for templates that refuse a system message (Mistral, Gemma 1).
_PROBES: tuple[tuple[Role, ...], ...] = (
    ("system", "user", "assistant", "user"),
    ("user", "assistant", "user"),
)


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


def _marker(i: int) -> str:
    return f"zqprobe{i}content"  # plain text no template rewrites, unique in the render


def _tokens_before_content(
    renderer: ChatRenderer, text: str, messages: list[Message], specials: set[int]
) -> set[int]:
    """The last special token before each marked message's content in `text`, the render
    of `messages` (the message-start token: `<|im_start|>`, `<|user|>`,
    `<|end_header_id|>`; `</s>` where a turn starts with plain text)."""
    found: set[int] = set()
    previous_end = 0
    for message in messages:
        marker = message.content
        if not marker or text.count(marker) != 1:
            continue
        start = text.index(marker)
        if start >= previous_end:
            gap = renderer.encode_chat(text[previous_end:start])
            last = next((t for t in reversed(gap) if t in specials), None)
            if last is not None:
                found.add(last)
        previous_end = max(previous_end, start + len(marker))
    return found


def detect_grid(renderer: ChatRenderer, chunk_size: int) -> ChunkGrid:
    """The template's chunk grid, from renders of small probe conversations.

    Segment tokens: for each role, the last special token before a message's content,
    one per message start. Taking only that one keeps chunks few (a grid point is a chunk
    boundary in every cold prefill: ChatML's `<|im_end|>` too would double them) and
    still puts every message start on the grid. The generation suffix is what the
    generation prompt appends; if none of its special tokens is a segment token, its
    first special token becomes one, so the history-end checkpoint is a grid point.
    """
    if not renderer.has_template:
        return ChunkGrid(chunk_size)
    specials = _special_ids(renderer.tokenizer)
    segment: set[int] = set()
    suffix: tuple[int, ...] = ()
    for roles in _PROBES:
        messages = [Message(r, _marker(i)) for i, r in enumerate(roles)]
        try:
            history = renderer.render_text(messages, add_generation_prompt=False)
            generation = renderer.render_text(messages, add_generation_prompt=True)
        except InvalidRequest:
            continue
        segment = _tokens_before_content(renderer, history, messages, specials)
        t_history, t_gen = renderer.encode_chat(history), renderer.encode_chat(generation)
        suffix = tuple(t_gen[common_prefix_length(t_history, t_gen) :])
        break
    tool_probe = [
        Message("user", _marker(0)),
        Message("assistant", tool_calls=(_CALL,)),
        Message("tool", _marker(2), tool_call_id="call_0", name="f"),
    ]
    try:
        text = renderer.render_text(tool_probe, add_generation_prompt=False)
        segment |= _tokens_before_content(renderer, text, tool_probe, specials)
    except InvalidRequest:
        pass  # no tool role in this template
    suffix_specials = [t for t in suffix if t in specials]
    if suffix_specials and not segment.intersection(suffix_specials):
        segment.add(suffix_specials[0])
    turn = _turn_start(renderer, specials)
    if not segment:
        log.warning(
            "the chat template puts no special token before a message: chat boundaries "
            "fall back to multiples of %d tokens, so hybrid models reuse less of a prompt",
            chunk_size,
        )
    return ChunkGrid(
        chunk_size, segment_tokens=frozenset(segment), generation_suffix=suffix, turn_start=turn
    )


# What precedes an assistant turn in the probes: the previous message's last characters,
# varied so that plain-text markup merging into them (`?<|` is one BPE piece) falls off
# the turn start, which keeps only what every context tokenizes alike.
_ENDINGS = ("zqprobe", "zqprobe?", "zqprobe.", 'zqprobe"}', "zqprobe)\n", "zqprobe ")
_CALL = ToolCall("f", {}, "call_0")
# How an assistant turn may render: with and without reasoning, a call, and as an earlier
# turn once a new question follows (templates drop or move reasoning there).
_REPLIES = (
    Message("assistant", SENTINEL),
    Message("assistant", "zqanswer", reasoning="zqthought"),
    Message("assistant", "", tool_calls=(_CALL,), reasoning="zqthought"),
)
_LATER = Message("user", "zqnext")


def _turn_start(renderer: ChatRenderer, specials: set[int]) -> tuple[tuple[int, ...], ...]:
    """The token runs that open an assistant turn, one per message it may follow (a user
    message, a tool result): the end of what a generation prompt and every probed
    history turn share, common to every ending of the message before. A run of plain
    text must be distinctive, so that it rarely occurs elsewhere."""
    leads = (
        lambda e: [Message("user", e)],
        lambda e: [
            Message("user", "zqask"),
            Message("assistant", tool_calls=(_CALL,)),
            Message("tool", e, tool_call_id="call_0", name="f"),
        ],
    )
    runs: list[tuple[int, ...]] = []
    for lead in leads:
        heads = [_turn_head(renderer, lead(ending)) for ending in _ENDINGS]
        if None in heads:
            continue  # not a conversation this template accepts
        run = common_suffix(heads)
        if _distinctive(renderer, run, specials):
            runs.append(run)
    runs = list(dict.fromkeys(runs))
    # A run that ends another makes the longer one redundant.
    return tuple(r for r in runs if not any(o != r and r[len(r) - len(o) :] == o for o in runs))


def _distinctive(renderer: ChatRenderer, run: tuple[int, ...], specials: set[int]) -> bool:
    """Whether `run` rarely occurs but where a turn opens: it holds a special token, or
    at least 4 characters of plain text (Mistral's `INST`, whose `]` merges with what
    follows; GLM's `assistant|>`), never a `\n` alone that would cut at every line."""
    if any(t in specials for t in run):
        return True
    return len(renderer.tokenizer.decode(list(run)).strip()) >= 4


def _turn_head(renderer: ChatRenderer, before: list[Message]) -> tuple[int, ...] | None:
    """The tokens the generation prompt after `before` shares with every probed history
    turn there, or None if the template refuses `before`."""
    try:
        generation = renderer.encode_chat(renderer.render_text(before, add_generation_prompt=True))
    except InvalidRequest:
        return None
    shared = len(generation)
    for reply in _REPLIES:
        for after in ([], [_LATER]):
            try:
                text = renderer.render_text([*before, reply, *after], add_generation_prompt=False)
            except InvalidRequest:
                continue
            shared = min(shared, common_prefix_length(generation, renderer.encode_chat(text)))
    return tuple(generation[:shared])


def common_suffix(runs: Sequence[Sequence[int]]) -> tuple[int, ...]:
    n = min(len(r) for r in runs)
    k = 0
    while k < n and len({r[len(r) - 1 - k] for r in runs}) == 1:
        k += 1
    return tuple(runs[0][len(runs[0]) - k :])


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
        self.vision = vision
        self.renderer.vision = vision
        self.reasoning = ReasoningMarkers.of(self.renderer)
        self.renderer.reasoning = self.reasoning

    def plan(self, prompt: PromptInput) -> RenderedPrompt:
        if (prompt.messages is None) == (prompt.text is None):
            raise InvalidRequest("give exactly one of messages or prompt text")
        if prompt.text is not None:
            tokens = self.renderer.encode_completion(prompt.text)
            if not tokens:
                raise InvalidRequest("the prompt is empty", param="prompt")
            found = {cp.position: cp.kind for cp in self._periodic(tokens)}
            return RenderedPrompt(tuple(tokens), self._with_tail(tokens, found), False)
        key = self.renderer.messages_key(prompt)
        tokens = key.tokens
        checkpoints = self._chat_checkpoints(prompt, tokens, key.spans)
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

    def _sentinel_start(self, prompt: PromptInput, index: int, tokens: list[int]) -> int:
        """Token position where messages[index]'s content begins."""
        probe = self.renderer.messages_tokens(prompt, {index: SENTINEL})
        return common_prefix_length(tokens, probe)

    def _chat_checkpoints(
        self, prompt: PromptInput, tokens: list[int], spans: Sequence[ImageSpan] = ()
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
                starts[index] = self._sentinel_start(prompt, index, tokens)
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
