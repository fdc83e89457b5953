"""The dashboard's data: one JSON snapshot of the cache tree, memory and disk use, the
engine's activity, the last requests and why the recent misses missed (explain/); and
its single-entry actions.

Who sees what: every listing and every action goes through `visible` with the
`Caller` (server/guards/namespaces.py): a page or extension sees its own namespace's entries,
jobs and requests; the admin key's holder and local clients without an Origin (this
page included) see all.

Cost per poll: the engine's read-only views copy references under the store's and the
disk index's locks (no MLX array is touched); the tree is built outside any lock. Its
shape and the entries' text heads are kept between polls while the set of stored
sequences stays the same, so a steady cache costs one listing per poll, not a rebuild
and a detokenization.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from mlx_prefix.cache.trie import TokenTrie
from mlx_prefix.cache.types import EvictOutcome
from mlx_prefix.engine.keys import namespace_of
from mlx_prefix.errors import MlxPrefixError
from mlx_prefix.vision.key import ends_span, is_image_value, readable

from ..guards.namespaces import Caller, visible
from .recent import RecentRequests

if TYPE_CHECKING:
    from mlx_prefix.engine.interface import EngineAPI
    from mlx_prefix.explain.explainer import Explainer

HEAD_TOKENS = 24  # tokens detokenized to show the start of what an entry adds


@dataclass(frozen=True, slots=True)
class TreeNode:
    """One stored sequence: in memory, on disk, or both (same token ids)."""

    node_id: str  # "m<entry id>" for a memory entry, else "d<file name>"
    parent: str | None  # the node of the longest stored strict prefix
    start: int  # the parent's length: this node adds tokens [start, length)
    length: int
    head: str  # the first HEAD_TOKENS tokens it adds, detokenized ([image] for an image)
    images: tuple[tuple[int, int], ...] = ()  # [start, end) of each image span it adds


def nest(sequences: dict[str, tuple[Any, ...]]) -> dict[str, str | None]:
    """Each node's parent: the node of its longest strict prefix among `sequences` (node
    id -> distinct token ids), or None. In tree pre-order: a parent before its
    children, siblings in the order of the tokens they add. Pure.

    Through a token trie: each sequence is walked once along the edges it shares with
    the others, so the cost grows with the number of sequences times their length
    (about 0.1-0.4 ms per 5K-token entry measured here), not with a sort's n log n
    comparisons of whole sequences."""
    trie: TokenTrie[str] = TokenTrie()
    for node_id, tokens in sequences.items():
        trie.insert(tokens, node_id)
    parents: dict[str, str | None] = {}
    children: dict[str | None, list[str]] = {}
    for node_id, tokens in sequences.items():
        prefixes = [a for a in trie.match(tokens).ancestors if a.length < len(tokens)]
        parent = prefixes[-1].value if prefixes else None
        parents[node_id] = parent
        children.setdefault(parent, []).append(node_id)
    ordered: dict[str, str | None] = {}
    stack: list[str] = _siblings(children.get(None, []), sequences, 0)
    while stack:
        node_id = stack.pop()
        ordered[node_id] = parents[node_id]
        stack += _siblings(children.get(node_id, []), sequences, len(sequences[node_id]))
    return ordered


def _siblings(nodes: list[str], sequences: dict[str, tuple[Any, ...]], start: int) -> list[str]:
    """`nodes` in reverse order of the tokens they add after `start` (a stack pops
    them in order)."""
    return sorted(nodes, key=lambda n: (sequences[n][start : start + 64], n), reverse=True)


class TreeShapes:
    """The last tree's shape and heads, rebuilt only when the stored sequences change."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # two pages polling at once
        self._key: tuple[str, ...] | None = None
        self._nodes: list[TreeNode] = []

    def nodes(
        self,
        sequences: dict[str, tuple[Any, ...]],
        tokenizer: Any,
        groups: dict[str, str] | None = None,
    ) -> list[TreeNode]:
        """The tree of `sequences`; with `groups` (node id -> its entry key), one tree
        per key: an entry never nests under another namespace's. A node's group never
        changes (an entry id or a file name implies its key)."""
        key = tuple(sorted(sequences))
        with self._lock:
            if key != self._key:
                trees: dict[str, dict[str, tuple[Any, ...]]] = {}
                for node_id, tokens in sequences.items():
                    group = groups.get(node_id, "") if groups is not None else ""
                    trees.setdefault(group, {})[node_id] = tokens
                self._nodes = [
                    _tree_node(node_id, parent, sequences, tokenizer)
                    for group in sorted(trees)
                    for node_id, parent in nest(trees[group]).items()
                ]
                self._key = key
            return self._nodes


def _tree_node(
    node_id: str, parent: str | None, sequences: dict[str, tuple[Any, ...]], tokenizer: Any
) -> TreeNode:
    tokens = sequences[node_id]
    start = len(sequences[parent]) if parent is not None else 0
    head = _decode(tokenizer, tokens[start : start + HEAD_TOKENS])
    return TreeNode(node_id, parent, start, len(tokens), head, _image_spans(tokens, start))


def _image_spans(tokens: tuple[Any, ...], start: int) -> tuple[tuple[int, int], ...]:
    """Where the images a node adds stand: its key's runs of image values (vision/key.py)."""
    out, at = [], None
    for i in range(start, len(tokens)):
        if is_image_value(tokens[i]):
            at = i if at is None else at
            if ends_span(tokens[i]):
                out.append((at, i + 1))
                at = None
        elif at is not None:
            out.append((at, i))
            at = None
    if at is not None:
        out.append((at, len(tokens)))
    return tuple(out)


def _decode(tokenizer: Any, tokens: tuple[Any, ...]) -> str:
    """The text of `tokens`, each image span written `[image]`."""
    return readable(tokens, lambda text: _decode_text(tokenizer, text))


def _decode_text(tokenizer: Any, tokens: list[Any]) -> str:
    if not tokens:
        return ""
    try:
        return tokenizer.decode(tokens)
    except Exception:  # a tokenizer that cannot decode a bare head: show no text
        return ""


MISSES = 20  # the recent requests that missed something, in the page's panel


def snapshot(
    engine: EngineAPI,
    recent: RecentRequests,
    shapes: TreeShapes,
    caller: Caller,
    explainer: Explainer | None = None,
) -> dict:
    """Everything the page shows, as JSON-ready values. Does not mutate the cache."""
    memory = visible(caller, engine.views.cache_sequences())
    disk = visible(caller, engine.views.disk_sequences())
    sequences = {f"m{s.info.entry_id}": s.tokens for s in memory}
    mem_info = {f"m{s.info.entry_id}": s.info for s in memory}
    groups = {node_id: info.model_key for node_id, info in mem_info.items()}
    # Not a dict by tokens: hashing them costs O(length).
    by_length: dict[tuple[str, int], list[str]] = {}
    for node_id, tokens in sequences.items():
        by_length.setdefault((groups[node_id], len(tokens)), []).append(node_id)
    disk_info: dict[str, Any] = {}
    for s in disk:  # a file of a sequence also in memory (same key) joins that node
        candidates = by_length.get((s.info.model_key, len(s.tokens)), ())
        node_id = next((n for n in candidates if sequences[n] == s.tokens), f"d{s.info.name}")
        disk_info[node_id] = s.info
        sequences[node_id] = s.tokens
        groups[node_id] = s.info.model_key
    tree = [
        _node_json(n, mem_info.get(n.node_id), disk_info.get(n.node_id))
        for n in shapes.nodes(sequences, engine.model.tokenizer, groups)
    ]
    stats = engine.views.cache_stats()
    now = time.perf_counter()
    activity = engine.views.activity()
    jobs = [
        {**asdict(j), "age_s": max(0.0, now - j.submitted_at)}
        for j in visible(caller, activity.jobs)
    ]
    for job in jobs:
        del job["submitted_at"]
    return {
        "model": engine.model.name,
        "time": time.time(),
        "memory": {k: stats.get(k) for k in _MEMORY_STATS},
        "disk": _disk_json(stats.get("disk")),
        "prefetch": stats.get("prefetch"),
        "tree": tree,
        "activity": {"capacity": activity.capacity, "jobs": jobs},
        "requests": [asdict(r) for r in visible(caller, recent.records())],
        "misses": _misses(explainer, caller),
    }


def _misses(explainer: Explainer | None, caller: Caller) -> list[dict[str, Any]]:
    """The caller's recent requests that reused less than a hit would, newest first."""
    if explainer is None:
        return []
    records = visible(caller, explainer.records(wait_s=0))
    return [r.as_json() for r in records if r.reason != "hit"][:MISSES]


_MEMORY_STATS = (
    "budget_bytes", "bytes", "active_bytes", "active_requests", "bytes_by_kind",
    "entries_by_kind", "entries", "pinned", "locked", "evictions", "hits", "misses",
    "hit_ratio", "tokens_reused", "peak_bytes",
)  # fmt: skip


def _node_json(node: TreeNode, mem: Any, disk: Any) -> dict[str, Any]:
    info = mem or disk
    return {
        "id": node.node_id,
        "parent": node.parent,
        "start": node.start,
        "tokens": node.length,
        "head": node.head,
        "images": [list(span) for span in node.images],
        "entry_id": mem.entry_id if mem else None,
        "kind": mem.kind.name if mem else disk.kind,
        "bytes": mem.nbytes if mem else None,
        "hits": mem.hits if mem else None,
        "idle_s": info.idle_s,
        "age_s": mem.age_s if mem else None,
        "pinned": mem.pinned if mem else False,
        "in_use": mem.refs > 0 if mem else False,
        "trimmable": info.trimmable,
        "disk_bytes": disk.nbytes if disk else None,
        "namespace": namespace_of(info.model_key),  # an id: never the Origin it came from
    }


def _disk_json(disk: dict | None) -> dict | None:
    if disk is None:
        return None
    keys = ("directory", "files", "bytes", "budget_bytes", "pending_saves", "hits", "saves")
    return {k: disk.get(k) for k in keys}


class EntryNotFound(MlxPrefixError):
    status = 404
    type = "invalid_request_error"
    code = "entry_not_found"


class EntryBusy(MlxPrefixError):
    status = 409
    type = "invalid_request_error"
    code = "entry_busy"


def set_pinned(engine: EngineAPI, caller: Caller, entry_id: int, pinned: bool) -> None:
    _find(engine, caller, entry_id)
    if not engine.views.set_pinned(entry_id, pinned):
        raise _missing(entry_id)


def evict(engine: EngineAPI, caller: Caller, entry_id: int) -> None:
    _find(engine, caller, entry_id)
    outcome = engine.views.evict_entry(entry_id)
    if outcome is EvictOutcome.MISSING:
        raise _missing(entry_id)
    if outcome is EvictOutcome.PINNED:
        raise EntryBusy(f"cache entry {entry_id} is pinned; unpin it first")
    if outcome is EvictOutcome.LOCKED:
        raise EntryBusy(f"cache entry {entry_id} is in use by a running request; try again")


def _find(engine: EngineAPI, caller: Caller, entry_id: int) -> None:
    """Act only on an entry the caller can see (`visible`)."""
    if not any(
        s.info.entry_id == entry_id for s in visible(caller, engine.views.cache_sequences())
    ):
        raise _missing(entry_id)


def _missing(entry_id: int) -> EntryNotFound:
    return EntryNotFound(f"no cache entry {entry_id} (evicted, flushed, or never stored)")
