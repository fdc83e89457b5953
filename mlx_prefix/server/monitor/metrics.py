"""What each request leaves behind: Prometheus metrics on a registry of the app's own (so
many apps can live in one process), its one log line (RequestLog, which also feeds the
dashboard's recent requests) and the response count by endpoint and status
(RequestCounter, a pure ASGI middleware)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlx_prefix.explain.explainer import Explainer
from mlx_prefix.records import Usage

from .recent import RecentRequests

if TYPE_CHECKING:
    from mlx_prefix.explain.trace import CacheTrace

log = logging.getLogger("mlx_prefix.server")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(self, cache_stats: Callable[[], dict[str, Any]], explain: bool = True):
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "mlx_prefix_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "mlx_prefix_prompt_tokens", "Prompt tokens received", registry=self.registry
        )
        self.cached_tokens = Counter(
            "mlx_prefix_cached_tokens",
            "Prompt tokens restored from the prefix cache instead of computed",
            registry=self.registry,
        )
        self.completion_tokens = Counter(
            "mlx_prefix_completion_tokens", "Tokens generated", registry=self.registry
        )
        self.images = Counter(
            "mlx_prefix_images", "Images received in prompts", registry=self.registry
        )
        self.image_tokens = Counter(
            "mlx_prefix_image_tokens",
            "Prompt tokens taken by images (also in mlx_prefix_prompt_tokens)",
            registry=self.registry,
        )
        self.ttft = Histogram(
            "mlx_prefix_time_to_first_token_seconds",
            "Submit to first generated token",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.embedding_inputs = Counter(
            "mlx_prefix_embedding_inputs",
            "Inputs embedded",
            registry=self.registry,
        )
        self.embedding_tokens = Counter(
            "mlx_prefix_embedding_tokens",
            "Tokens embedded",
            registry=self.registry,
        )
        self.registry.register(CacheCollector(cache_stats))
        self.recent = RecentRequests()  # for the dashboard; fed by RequestLog
        # Why each request reused what it did (explain/): /v1/cache/requests, the
        # dashboard, the per-reason counters below; fed by RequestLog too.
        self.explainer = Explainer(enabled=explain)
        self.registry.register(ReasonCollector(self.explainer))

    def observe_generation(self, usage: Usage) -> None:
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_tokens.inc(usage.cached_tokens)
        self.completion_tokens.inc(usage.completion_tokens)
        self.images.inc(usage.images)
        self.image_tokens.inc(usage.image_tokens)
        if usage.completion_tokens:
            self.ttft.observe(usage.ttft_s)

    def observe_embeddings(self, inputs: int, tokens: int) -> None:
        self.embedding_inputs.inc(inputs)
        self.embedding_tokens.inc(tokens)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class CacheCollector(Collector):
    """Reads the engine's cache statistics at scrape time, so gauges are never stale."""

    def __init__(self, cache_stats: Callable[[], dict[str, Any]]):
        self._cache_stats = cache_stats

    def describe(self) -> list[Metric]:
        return []  # unknown until scraped; keeps registration from calling the engine

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._cache_stats()
        except Exception:  # a scrape must not fail because the engine is shutting down
            log.exception("cache_stats() failed during a /metrics scrape")
            return
        yield from _cluster_metrics(stats.pop("distributed", None))
        yield from _speculative_metrics(stats.pop("speculative", None))
        disk = stats.pop("disk", None)
        if isinstance(disk, dict):
            for key, value in sorted(disk.items()):
                if _NAME.fullmatch(key) and _is_number(value):
                    family_type = (
                        CounterMetricFamily if key in _DISK_COUNTERS else GaugeMetricFamily
                    )
                    yield family_type(
                        f"mlx_prefix_disk_{key}",
                        f"Disk prompt cache {key.replace('_', ' ')}",
                        value=value,
                    )
        for key, value in sorted(stats.items()):
            name = f"mlx_prefix_cache_{key}"
            doc = _DOCS.get(key, f"Prefix cache {key.replace('_', ' ')}")
            if not _NAME.fullmatch(key) or isinstance(value, bool):
                continue
            if not isinstance(value, (int, float, dict)):
                continue
            if isinstance(value, dict):  # e.g. bytes_by_kind: {"SYSTEM": 123, ...}
                family = GaugeMetricFamily(name, doc, labels=["kind"])
                for kind, v in sorted(value.items()):
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        family.add_metric([str(kind)], v)
                yield family
            elif key in _COUNTERS:
                yield CounterMetricFamily(name, doc, value=value)
            else:
                yield GaugeMetricFamily(name, doc, value=value)


class ReasonCollector(Collector):
    """Requests and prompt tokens lost per reason (explain/reasons.py), read at scrape."""

    def __init__(self, explainer: Explainer):
        self._explainer = explainer

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        totals = self._explainer.totals()
        requests = CounterMetricFamily(
            "mlx_prefix_cache_reason_requests",
            "Requests by why they reused what they did (hit, new, edited, evicted, ...)",
            labels=["reason"],
        )
        lost = CounterMetricFamily(
            "mlx_prefix_cache_reason_lost_tokens",
            "Prompt tokens computed that the cache would have served but for the reason",
            labels=["reason"],
        )
        for reason, (count, tokens) in totals.items():
            requests.add_metric([reason], count)
            lost.add_metric([reason], tokens)
        yield requests
        yield lost


_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _speculative_metrics(spec: dict | None) -> Iterator[Metric]:
    """--draft-model: draft tokens proposed and accepted (engine/decode/speculative.py)."""
    if not isinstance(spec, dict):
        return
    for key, doc in (
        ("steps", "Speculative verify steps"),
        ("drafted", "Draft tokens proposed"),
        ("accepted", "Draft tokens the model drew too (accepted)"),
    ):
        yield CounterMetricFamily(f"mlx_prefix_speculative_{key}", doc, value=spec[key])


def _cluster_metrics(cluster: dict | None) -> Iterator[Metric]:
    """A sharded server's group (group.Cluster.as_dict): its size, and one info series
    per rank naming its host, what it holds, the backend and the mode."""
    if not isinstance(cluster, dict):
        return
    yield GaugeMetricFamily(
        "mlx_prefix_distributed_world_size",
        "Ranks the model is sharded over",
        value=cluster["world_size"],
    )
    info = GaugeMetricFamily(
        "mlx_prefix_distributed_rank_info",
        "One series per rank of the group (value 1)",
        labels=["rank", "host", "part", "backend", "mode"],
    )
    for r in cluster["ranks"]:
        info.add_metric(
            [str(r["rank"]), r["host"], r["part"], cluster["backend"], cluster["mode"]], 1
        )
    yield info


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# Monotonic statistics; every other number in cache_stats() is a gauge.
_COUNTERS = frozenset({"hits", "misses", "tokens_reused", "evictions"})
# Monotonic totals of the disk tier (DiskStats); files, bytes and the rest are gauges.
_DISK_COUNTERS = frozenset(
    {
        "hits",
        "misses",
        "saves",
        "save_failures",
        "load_failures",
        "evictions",
        "removed",
        "dropped_saves",
    }
)
_DOCS = {
    "bytes": "Bytes held by stored prefix-cache snapshots",
    "active_bytes": "Bytes held by running requests' caches",
    "budget_bytes": "Byte budget shared by stored and active caches",
    "entries": "Stored prefix-cache entries",
    "hit_ratio": "Cache hits / lookups since start",
    "evictions": "Entries evicted to stay within the byte budget",
    "hits": "Prefix-cache lookups that reused tokens",
    "misses": "Prefix-cache lookups that reused nothing",
    "tokens_reused": "Prompt tokens restored from the cache",
}


@dataclass
class RequestLog:
    """The per-request log line and token metrics, written exactly once."""

    request_id: str
    endpoint: str
    metrics: ServerMetrics
    namespace: str | None = None  # the sender's cache namespace id: who sees the record
    prompt_tokens: int = 0
    trace: CacheTrace | None = None  # the engine's (explain/trace.py), once submitted
    started: float = field(default_factory=time.perf_counter)
    _written: bool = False

    def write(
        self,
        status: str,
        usage: Usage | None = None,
        finish: str | None = None,
        error: str | None = None,
    ) -> None:
        if self._written:
            return
        self._written = True
        total_ms = (time.perf_counter() - self.started) * 1000
        self.metrics.recent.add(
            self.request_id,
            self.endpoint,
            status=status,
            total_ms=total_ms,
            prompt_tokens=self.prompt_tokens,
            usage=usage,
            finish=finish,
            namespace=self.namespace,
        )
        if usage is None:
            log.info(
                "%s %s prompt=%d cached=- ttft=- decode=- status=%s total=%.0fms%s",
                self.request_id, self.endpoint, self.prompt_tokens, status, total_ms,
                f" error={error!r}" if error else "",
            )  # fmt: skip
            return
        self.metrics.observe_generation(usage)
        if self.trace is not None:  # ended with its usage: the engine wrote all of it
            api = api_name(self.endpoint)
            self.metrics.explainer.submit(self.trace, self.request_id, api, self.namespace or "")
        log.info(
            "%s %s prompt=%d cached=%d completion=%d ttft=%.1fms decode=%.1ftok/s "
            "finish=%s status=%s total=%.0fms",
            self.request_id, self.endpoint, usage.prompt_tokens, usage.cached_tokens,
            usage.completion_tokens, usage.ttft_s * 1000, usage.decode_tokens_per_s,
            finish, status, total_ms,
        )  # fmt: skip


def api_name(path: str) -> str:
    """The API family of a generation path: chat, completions, messages, responses."""
    return path.removeprefix("/v1").strip("/").split("/")[0]


class RequestCounter:
    """Counts responses by endpoint and HTTP status. Unknown paths share one label so a
    scanner cannot blow up the metric's cardinality."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, endpoints: Collection[str]):
        self.app = app
        self._metrics = metrics
        self._endpoints = [(p, re.compile(_path_regex(p))) for p in endpoints]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self._metrics.requests.labels(self._label(scope), str(status)).inc()

    def _label(self, scope: Scope) -> str:
        if scope["method"] == "OPTIONS":
            return "preflight"
        path = scope["path"]
        return next((p for p, rx in self._endpoints if rx.fullmatch(path)), "other")


def _path_regex(path: str) -> str:
    return re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(path))
