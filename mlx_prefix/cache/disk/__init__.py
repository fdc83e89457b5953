"""The disk tier: checkpoints persisted so the cache survives restarts. Import each name
from its module.

    tier.py     DiskCache: the entry point (save, match, load, scan, stats)
    index.py    in-memory index of the files: matching, LRU order, byte budget
    files.py    directory survey, atomic temp-file writes (flock, fsync), removals
    failures.py a failed load triaged (only proven damage removes the file), a failed
                save warned once per errno
    stats.py    the tier's counters and its DiskStats snapshot
    header.py   file header: fields, names, digests; built, read and verified
    trust.py    this user's alone: folder 0700, files 0600, others' files never served
    payload.py  layer tree and tensor data: encode, write, one-pass verified load (MLX)
    policy.py   which positions go to disk for a scope: off | full | auto[:N] | N
"""
