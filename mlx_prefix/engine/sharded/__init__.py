"""A model split over mlx.distributed ranks (mlx.launch): every rank runs the engine's
steps in lockstep (lockstep.py) under rank 0's plan for each turn (plan.py);
DistributedEngine (distributed.py) is the callers' side and the failure path.
"""

from __future__ import annotations

from mlx_prefix.lazy import exports

_NAMES = {
    "DistributedEngine": "distributed",
    "Lockstep": "lockstep",
    "TurnPlan": "plan",
}
__all__ = list(_NAMES)
__getattr__ = exports(__name__, _NAMES)
