"""A request's life around the model, engine thread and callers alike: the records it
takes through the phases (jobs.py), the handle its caller reads events from
(handle.py), the checks before it is queued (admission.py), the inbox and its one final
event (lifecycle.py), the waiting list and who starts next (scheduler.py), how much
prefill shares a step with decode (pace.py), and the next-turn prefetch that follows a
chat's reply (prefetch.py, chat_traffic.py).
"""

from __future__ import annotations

from mlx_prefix.lazy import exports

_NAMES = {
    "Job": "jobs",
    "PrefillTask": "jobs",
    "Running": "jobs",
    "WarmResult": "jobs",
    "PrefetchStats": "jobs",
    "RequestHandle": "handle",
    "plan_prompt": "admission",
    "check_sampling": "admission",
    "check_reply_fits": "admission",
    "Lifecycle": "lifecycle",
    "WaitingList": "scheduler",
    "Pace": "pace",
    "gathers": "pace",
    "Prefetcher": "prefetch",
    "wants_prefetch": "prefetch",
    "ChatTraffic": "chat_traffic",
}
__all__ = list(_NAMES)
__getattr__ = exports(__name__, _NAMES)
