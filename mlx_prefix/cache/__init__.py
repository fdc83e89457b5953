"""The prompt cache: what is stored, where, and what a prompt may reuse. Pure Python but
for snapshot.py, layers/ and disk/payload.py, which touch MLX arrays. Import each name
from its module.

    types.py      the cache's records: CheckpointKind, Buffer, the store's results
    store.py      PromptCache: the thread-safe store (lookup, insert, pin, evict, listings)
                  over contents.py (what it holds, the steps under its lock), trie.py /
                  token_ids.py (token radix trees), reuse.py (the reuse rules),
                  entries.py, pins.py, counters.py
    eviction/     room: the byte budget, residency, active bytes, the eviction policy
                  (which entry goes first) and the log of what went
    snapshot.py   immutable captures of mlx-lm cache lists, and their restore
    layers/       one adapter per mlx-lm cache class: snapshot, batch, trim, quantize, cost
    disk/         the disk tier: DiskCache (tier.py), its index, files, header, trust,
                  payload, and which positions go to disk (policy.py)
"""
