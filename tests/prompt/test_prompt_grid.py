from mlx_prefix.prompt.request.grid import GRID_RULES, ChunkGrid

START, A, NL = 1, 7, 8  # a message-start token, "assistant", "\n"


def grid() -> ChunkGrid:
    return ChunkGrid(4, segment_tokens=frozenset([START]), generation_suffix=(START, A, NL))


def test_points_are_multiples_segment_starts_and_generation_prompt_ends():
    tokens = [5, START, 5, 5, 5, 5, START, A, NL]
    assert grid().points(tokens) == [2, 4, 7, 8, 9]


def test_a_segment_token_opening_the_prompt_makes_no_one_token_chunk():
    tokens = [START, 5, 5, 5, 5, START, A, NL]
    assert grid().points(tokens) == [4, 6, 8]
    assert grid().chunk_ends(tokens, 0)[0] == 4


def test_signature_changes_with_everything_that_moves_a_chunk_end():
    base = grid()
    variants = [
        ChunkGrid(8, segment_tokens=frozenset([START]), generation_suffix=(START, A, NL)),
        ChunkGrid(4, segment_tokens=frozenset([START, 2]), generation_suffix=(START, A, NL)),
        ChunkGrid(4, segment_tokens=frozenset([START]), generation_suffix=(START, A)),
    ]
    signatures = {base.signature(), *(v.signature() for v in variants)}
    assert len(signatures) == 4
    assert f"rules={GRID_RULES}" in base.signature()


def test_grid_point_depends_only_on_the_prefix():
    g = grid()
    a = [START, 5, 5, 9, 9, 9, 9, START, 3, 3, 3, 3, 3, 3]
    b = [START, 5, 5, 9, 9, 9, 9, START, A, NL, 2]
    shared = 8
    assert [p for p in g.points(a) if p <= shared] == [p for p in g.points(b) if p <= shared]


def test_align_and_chunk_ends_resume_like_a_cold_run():
    g = grid()
    tokens = [9] * 3 + [START] + [9] * 9 + [START, A, NL]
    cold = g.chunk_ends(tokens, 0)
    assert cold == [4, 8, 12, 14, 16]
    for checkpoint in cold[:-1]:
        warm = g.chunk_ends(tokens, checkpoint)
        assert warm == [e for e in cold if e > checkpoint]
    assert g.align(tokens, 11) == 8
    assert g.align(tokens, 3) == 0


def test_last_chunk_ends_at_the_prompt_end_even_off_grid():
    assert ChunkGrid(4).chunk_ends([9] * 10, 4) == [8, 10]


def test_a_turn_start_run_is_a_grid_point_wherever_it_ends_the_prefix():
    g = ChunkGrid(16, turn_start=((A, NL),))
    tokens = [9, 9, A, NL, 9, 9, 9, A, NL, 3]
    assert g.turn_starts(tokens) == [4, 9]
    assert g.points(tokens) == [4, 9]
    assert g.align(tokens, 8) == 4
    assert g.chunk_ends(tokens, 4) == [9, 10]


def test_the_turn_start_is_in_the_signature():
    assert ChunkGrid(4, turn_start=((A, NL),)).signature() != ChunkGrid(4).signature()
    assert (
        ChunkGrid(4, turn_start=((A, NL),)).signature()
        != ChunkGrid(4, turn_start=((A,),)).signature()
    )
