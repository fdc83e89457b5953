"""The prefill phase (engine thread): a request's longest usable cached prefix matched
and restored (restore.py) as its task begins (start.py), its remaining tokens computed
one grid chunk at a time (phase.py: PrefillPhase, each request a PrefillTask of task.py;
which chunks a step takes: rounds.py), the checkpoints it leaves behind, at its own
offsets (checkpoints.py; for waiting requests sharing a prefix: sharing.py; where a
cancelled one stopped: cancelled.py), the short rests stacked in one forward (tails.py),
and the engine's lookups in and deferred saves to the disk tier (disk_access.py; the
tier itself is cache/disk/). Import each name from its module.
"""
