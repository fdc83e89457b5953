"""The prefill phase (engine thread): a request's longest usable cached prefix matched
and restored, its remaining tokens computed one grid chunk at a time (phase.py), the
checkpoints it leaves behind, at its own offsets (checkpoints.py), and the engine's
lookups in and deferred saves to the disk tier (disk_access.py; the tier itself is
cache/disk.py).
"""

from __future__ import annotations

from mlx_prefix.lazy import exports

_NAMES = {
    "PrefillPhase": "phase",
    "PrefillStep": "phase",
    "Checkpointer": "checkpoints",
    "SharedPrefixes": "checkpoints",
    "DiskAccess": "disk_access",
}
__all__ = list(_NAMES)
__getattr__ = exports(__name__, _NAMES)
