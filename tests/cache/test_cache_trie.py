from __future__ import annotations

import random

import pytest

from mlx_prefix.cache.token_ids import TokenIds
from mlx_prefix.cache.trie import TokenTrie


def _lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_insert_get_replace_and_len():
    t: TokenTrie[str] = TokenTrie()
    assert t.insert([1, 2, 3], "a") is None
    assert t.insert([1, 2], "b") is None  # splits the edge
    assert t.insert([1, 2, 3], "c") == "a"
    assert len(t) == 2
    assert t.get([1, 2, 3]) == "c"
    assert t.get([1, 2]) == "b"
    assert t.get([1]) is None
    assert t.get([1, 2, 3, 4]) is None
    t.check_integrity()


def test_match_reports_common_prefix_and_ancestors():
    t: TokenTrie[str] = TokenTrie()
    t.insert([1, 2], "short")
    t.insert([1, 2, 3, 4, 5], "long")
    t.insert([1, 9], "other")
    m = t.match([1, 2, 3, 7])
    assert m.matched == 3  # diverges inside the [3, 4, 5] edge
    assert [(e.length, e.value) for e in m.ancestors] == [(2, "short")]
    m = t.match([1, 2, 3, 4, 5, 6])
    assert m.matched == 5
    assert [e.value for e in m.ancestors] == ["short", "long"]
    assert t.match([7]).matched == 0
    assert t.match([]).matched == 0


def test_remove_prunes_and_merges():
    t: TokenTrie[str] = TokenTrie()
    t.insert([1, 2, 3], "a")
    t.insert([1, 2, 4], "b")
    t.insert([1], "c")
    assert t.remove([1, 2, 3]) == "a"
    t.check_integrity()  # the valueless [1]->[2] node with one child got merged
    assert t.get([1, 2, 4]) == "b"
    assert t.remove([1]) == "c"
    t.check_integrity()
    with pytest.raises(KeyError):
        t.remove([1, 2])  # a path point, not an entry
    with pytest.raises(KeyError):
        t.remove([5])
    assert t.remove([1, 2, 4]) == "b"
    assert len(t) == 0 and list(t.items()) == []
    t.check_integrity()


def test_nearest_prefers_longest_common_prefix_then_shortest_entry():
    t: TokenTrie[str] = TokenTrie()
    t.insert([1, 2, 3, 4, 5, 6], "deep")
    t.insert([1, 2, 3, 4, 5, 6, 7, 8], "deeper")
    t.insert([1, 2, 9], "side")
    n = t.nearest([1, 2, 3, 4, 0], lambda v: True)
    assert n is not None and n.value == "deep" and n.common == 4
    assert n.length == 6
    # Reject the deep branch: the best left shares only [1, 2].
    n = t.nearest([1, 2, 3, 4, 0], lambda v: v == "side")
    assert n is not None and n.value == "side" and n.common == 2 and n.length == 3
    n = t.nearest([5], lambda v: True)  # nothing shared, but an entry still qualifies
    assert n is not None and n.common == 0
    assert t.nearest([1, 2, 3], lambda v: False) is None


def test_extensions_are_strict():
    t: TokenTrie[str] = TokenTrie()
    t.insert([1, 2], "a")
    t.insert([1, 2, 3], "b")
    t.insert([1, 2, 3, 4, 5], "c")
    t.insert([1, 7], "d")
    assert sorted(e.value for e in t.extensions([1, 2])) == ["b", "c"]
    assert sorted(e.value for e in t.extensions([1, 2, 3, 4])) == ["c"]  # mid-edge
    assert sorted(e.value for e in t.extensions([1])) == ["a", "b", "c", "d"]
    assert list(t.extensions([1, 2, 3, 4, 5])) == []
    assert list(t.extensions([9])) == []
    assert {e.tokens for e in t.extensions([1, 2, 3, 4])} == {(1, 2, 3, 4, 5)}


def test_sharing_lists_every_other_entry_sharing_a_prefix_deepest_first():
    t: TokenTrie[str] = TokenTrie()
    for seq, v in (([1, 2, 3, 4], "own"), ([1, 2], "prefix"), ([1, 2, 3, 9], "sibling"),
                   ([1, 2, 3, 4, 5], "extension"), ([1, 7], "far"), ([8], "none")):  # fmt: skip
        t.insert(seq, v)
    got = list(t.sharing([1, 2, 3, 4]))
    assert got[0] == ("extension", 4)  # all of the query
    assert got[1:] == [("sibling", 3), ("prefix", 2), ("far", 1)]  # never itself, nor [8]
    got = list(t.sharing([1, 2, 3, 6]))  # not stored: every entry past [1, 2, 3] shares 3
    assert set(got[:3]) == {("own", 3), ("sibling", 3), ("extension", 3)}
    assert got[3:] == [("prefix", 2), ("far", 1)]


def test_random_operations_agree_with_a_dict():
    rng = random.Random(0)
    t: TokenTrie[int] = TokenTrie()
    ref: dict[tuple[int, ...], int] = {}
    for step in range(3000):
        seq = tuple(rng.randrange(3) for _ in range(rng.randrange(0, 9)))
        if rng.random() < 0.6:
            assert t.insert(seq, step) == ref.get(seq)
            ref[seq] = step
        elif seq in ref:
            assert t.remove(seq) == ref.pop(seq)
        q = tuple(rng.randrange(3) for _ in range(rng.randrange(0, 10)))
        m = t.match(q)
        assert m.matched == max((_lcp(q, k) for k in ref), default=0)
        assert [q[: e.length] for e in m.ancestors] == sorted(
            (k for k in ref if q[: len(k)] == k), key=len
        )
        assert all(ref[q[: e.length]] == e.value for e in m.ancestors)
        odd = t.nearest(q, lambda v: v % 2 == 1)
        want = max((_lcp(q, k) for k, v in ref.items() if v % 2 == 1), default=None)
        if want is None:
            assert odd is None
        else:
            assert odd is not None and odd.common == want
            (key,) = [k for k, v in ref.items() if v == odd.value]  # values are unique
            assert len(key) == odd.length and _lcp(q, key) == want
            both = t.lookup(q, lambda v: v % 2 == 1)
            assert both.match == m and both.nearest == odd
        assert {e.tokens for e in t.extensions(q)} == {
            k for k in ref if len(k) > len(q) and k[: len(q)] == q
        }
        shared = list(t.sharing(q))
        assert sorted(shared) == sorted(
            (v, _lcp(q, k)) for k, v in ref.items() if k != q and _lcp(q, k) > 0
        )
        assert [d for _, d in shared] == sorted((d for _, d in shared), reverse=True)
        if step % 100 == 0:
            t.check_integrity()
            assert {e.tokens: e.value for e in t.items()} == ref
    t.check_integrity()


@pytest.mark.parametrize("at", [0, 1, 4095, 4096, 4097, 8191, 12288, 19999, None])
def test_long_sequences_diverging_anywhere(at):
    # Edges of tens of thousands of tokens are compared in growing memory blocks (the
    # first is 4096 tokens): the divergence is found exactly wherever it falls.
    rng = random.Random(at)
    stored = tuple(rng.randrange(-5, 200_000) for _ in range(20_000))
    query = list(stored) + [7]
    if at is not None:
        query[at] = stored[at] + 1
    t: TokenTrie[str] = TokenTrie()
    t.insert(stored, "long")
    t.insert(stored[:5000], "short")
    want = len(stored) if at is None else at
    for q in (query, TokenIds(query)):
        m = t.match(q)
        assert m.matched == want
        assert [a.length for a in m.ancestors] == [n for n in (5000, 20_000) if n <= want]
        near = t.nearest(q, lambda v: v == "long")
        assert near is not None and (near.length, near.common) == (20_000, want)
    assert t.get(TokenIds(stored)) == "long" and t.get(stored[:4096]) is None
    assert {e.tokens for e in t.extensions(stored[:4097])} == {stored[:5000], stored}
    t.check_integrity()


def test_token_ids_are_a_tuple_with_their_packed_form():
    ids = TokenIds([3, -1, 2**40])
    assert ids == (3, -1, 2**40) and hash(ids) == hash((3, -1, 2**40))
    assert type(ids[:2]) is tuple and len(ids.packed) == 24
