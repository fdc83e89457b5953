"""The last requests served, as records for the dashboard's charts: a bounded ring fed
by each request's one log line (metrics.RequestLog), read from any thread.

Records carry numbers only (token counts, timings, status), never prompt text.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from mlx_prefix.records import Usage

RECENT_REQUESTS = 200


@dataclass(frozen=True, slots=True)
class RequestRecord:
    seq: int  # 1, 2, ... in the order requests finished
    request_id: str
    endpoint: str
    status: str  # "200", an HTTP error status, "client_disconnected", "cancelled", "error"
    finished_at: float  # unix time
    total_s: float  # request received -> last byte
    prompt_tokens: int
    cached_tokens: int | None  # None: the engine gave no usage (it failed or was cut short)
    completion_tokens: int | None
    ttft_s: float | None
    prefill_tokens_per_s: float | None
    decode_tokens_per_s: float | None
    finish: str | None  # "stop", "length", "tool_calls"
    namespace: str | None = None  # the sender's cache namespace id (server/guards/namespaces.py)


class RecentRequests:
    """The last `size` records, oldest first. Thread-safe."""

    def __init__(self, size: int = RECENT_REQUESTS) -> None:
        self._records: deque[RequestRecord] = deque(maxlen=size)
        self._lock = threading.Lock()
        self._seq = 0

    def add(
        self,
        request_id: str,
        endpoint: str,
        status: str,
        total_ms: float,
        prompt_tokens: int,
        usage: Usage | None,
        finish: str | None,
        namespace: str | None = None,
    ) -> None:
        with self._lock:
            self._seq += 1
            self._records.append(
                RequestRecord(
                    seq=self._seq,
                    request_id=request_id,
                    endpoint=endpoint,
                    status=status,
                    finished_at=time.time(),
                    total_s=total_ms / 1000,
                    prompt_tokens=usage.prompt_tokens if usage else prompt_tokens,
                    cached_tokens=usage.cached_tokens if usage else None,
                    completion_tokens=usage.completion_tokens if usage else None,
                    ttft_s=usage.ttft_s if usage and usage.completion_tokens else None,
                    prefill_tokens_per_s=usage.prefill_tokens_per_s if usage else None,
                    decode_tokens_per_s=usage.decode_tokens_per_s if usage else None,
                    finish=finish,
                    namespace=namespace,
                )
            )

    def records(self) -> list[RequestRecord]:
        """Oldest first. Does not mutate."""
        with self._lock:
            return list(self._records)
