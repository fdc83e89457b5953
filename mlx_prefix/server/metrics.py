"""Prometheus metrics on a registry of the app's own, so many apps can live in one process."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mlx_prefix.engine.request import Usage

log = logging.getLogger("mlx_prefix.server")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(self, cache_stats: Callable[[], dict[str, Any]]):
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
        self.ttft = Histogram(
            "mlx_prefix_time_to_first_token_seconds",
            "Submit to first generated token",
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(CacheCollector(cache_stats))

    def observe_generation(self, usage: Usage) -> None:
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_tokens.inc(usage.cached_tokens)
        self.completion_tokens.inc(usage.completion_tokens)
        if usage.completion_tokens:
            self.ttft.observe(usage.ttft_s)

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
        gauges = {
            "bytes": "Bytes held by stored prefix-cache snapshots",
            "active_bytes": "Bytes held by running requests' caches",
            "budget_bytes": "Byte budget shared by stored and active caches",
            "entries": "Stored prefix-cache entries",
            "hit_ratio": "Cache hits / lookups since start",
        }
        for key, doc in gauges.items():
            if isinstance(stats.get(key), (int, float)):
                yield GaugeMetricFamily(f"mlx_prefix_cache_{key}", doc, value=stats[key])
        by_kind = stats.get("bytes_by_kind")
        if isinstance(by_kind, dict):
            family = GaugeMetricFamily(
                "mlx_prefix_cache_bytes_by_kind",
                "Stored cache bytes by cache kind",
                labels=["kind"],
            )
            for kind, value in sorted(by_kind.items()):
                family.add_metric([str(kind)], value)
            yield family
        counters = {
            "evictions": "Entries evicted to stay within the byte budget",
            "hits": "Prefix-cache lookups that reused tokens",
            "misses": "Prefix-cache lookups that reused nothing",
            "tokens_reused": "Prompt tokens restored from the cache",
        }
        for key, doc in counters.items():
            if isinstance(stats.get(key), (int, float)):
                yield CounterMetricFamily(f"mlx_prefix_cache_{key}", doc, value=stats[key])
