from mlx_prefix.engine.decode.text import TextStream


class CharDetokenizer:
    """Token i is chr(i); mimics mlx-lm's streaming detokenizer interface."""

    def __init__(self):
        self.last_segment = ""

    def reset(self):
        self.last_segment = ""

    def add_token(self, token):
        self.last_segment = chr(token)

    def finalize(self):
        self.last_segment = ""


class Tok:
    @property
    def detokenizer(self):
        return CharDetokenizer()


def run(text, stop):
    stream = TextStream(Tok(), stop)
    out = []
    for ch in text:
        out.append(stream.add(ord(ch)))
        if stream.stopped:
            break
    out.append(stream.finish())
    return "".join(out), stream.stopped


def test_stop_string_split_across_tokens_never_reaches_the_client():
    assert run("Hello END world", ["END"]) == ("Hello ", True)


def test_partial_stop_prefix_is_released_when_it_does_not_match():
    text, stopped = run("a EN b", ["END"])
    assert (text, stopped) == ("a EN b", False)


def test_without_stop_strings_text_streams_through():
    stream = TextStream(Tok(), ())
    assert [stream.add(ord(c)) for c in "hi"] == ["h", "i"]


def test_the_stop_string_that_ended_the_text_is_reported():
    stream = TextStream(Tok(), ["world", "lo w"])
    for ch in "Hello world":
        stream.add(ord(ch))
    assert stream.stopped and stream.matched == "lo w"  # the earliest match wins
    assert TextStream(Tok(), ["x"]).matched is None


class WordTok:
    """Tokens index a fixed list of text pieces (several characters per token)."""

    def __init__(self, pieces):
        self.pieces = pieces

    @property
    def detokenizer(self):
        pieces = self.pieces

        class Detok(CharDetokenizer):
            def add_token(self, token):
                self.last_segment = pieces[token]

        return Detok()


def run_pieces(pieces, stop):
    stream = TextStream(WordTok(pieces), stop)
    out = [stream.add(i) for i in range(len(pieces))]
    out.append(stream.finish())
    return "".join(out), stream.matched, stream.text


def test_the_first_match_to_end_wins_whatever_the_token_boundaries():
    for pieces in (["abcd"], ["a", "bcd"], ["ab", "cd"], list("abcd")):
        text, matched, _ = run_pieces(pieces, ["abcd", "bc"])
        assert (text, matched) == ("a", "bc"), pieces


def test_of_matches_ending_together_the_longest_cuts():
    assert run_pieces(["xabc"], ["bc", "abc"])[:2] == ("x", "abc")


def test_held_back_text_with_overlapping_prefixes():
    # "aab" ends a text of "aaab": the first "a" was safe, the rest never reaches the client.
    stream = TextStream(Tok(), ["aab"])
    assert [stream.add(ord(c)) for c in "aaa"] == ["", "", "a"]
    assert stream.add(ord("b")) == "" and stream.matched == "aab"
    assert stream.text == "a"
    assert run("aaac", ["aab"]) == ("aaac", False)


def test_the_text_is_the_reply_cut_before_the_stop_string():
    text, matched, whole = run_pieces(["He", "llo ", "wor", "ld!"], ["o w", "zz"])
    assert (text, matched, whole) == ("Hell", "o w", "Hell")
    assert run_pieces(["He", "llo"], ["lo!"]) == ("Hello", None, "Hello")


def test_work_per_token_does_not_grow_with_the_stop_strings():
    """Counted in the matcher's steps, not time: the old matcher tried every prefix of
    every stop string at every token (thousands of comparisons a token here); the
    automaton takes amortised O(1) steps a character, whatever the stop strings."""
    reply = "the quick brown fox jumps over the lazy dog " * 3
    for count, length in ((1, 10), (4, 400), (16, 1000)):
        stops = [chr(ord("A") + i) * length + "!" for i in range(count)]
        stream = TextStream(Tok(), stops)
        for ch in reply:
            stream.add(ord(ch))
        stream.finish()
        assert stream.text == reply
        assert stream._matcher.steps <= 2 * len(reply)


def test_the_automaton_takes_amortised_constant_steps_a_character():
    from mlx_prefix.engine.decode.text import StopMatcher

    matcher = StopMatcher(["a" * 300 + "b", "a" * 150 + "c"] + ["ab" * 100 + "x"])
    text = ("a" * 299 + "c" + "ab" * 99 + "y") * 5
    for ch in text:
        assert matcher.feed(ch) is None or ch == "c"
    assert matcher.steps <= 2 * len(text)


def test_stop_matchers_of_one_stop_list_share_the_tables_not_the_state():
    from mlx_prefix.engine.decode.text import StopMatcher

    a, b = StopMatcher(["ab", "c"]), StopMatcher(("ab", "c"))
    assert a._a is b._a  # built once
    assert a.feed("a") is None and a.held == 1 and b.held == 0
    assert a.feed("b") == "ab" and b.feed("c") == "c"
