"""Room in the memory tier: what counts against the byte budget and what goes to make
room. Pure Python (no MLX); not thread-safe: the store calls each with its lock held (the
log excepted: it has its own). Import each name from its module.

    budget.py     what counts against the byte budget (stored + active bytes), whether a
                  new entry fits, which entry eviction takes next
    residency.py  the buffers entries keep alive, each counted once; what removing an
                  entry frees (its eviction share)
    active.py     running requests' bytes, buffers shared with stored entries counted once
    policy.py     which entry goes first: the policy interface, ValueLRU and KindLRU
    uses.py       Lineage: how often a conversation's prefix was restored, carried from
                  turn to turn (the value policy's frequent segment)
    log.py        EvictionLog: a bounded record of what was evicted (or refused for room)
"""
