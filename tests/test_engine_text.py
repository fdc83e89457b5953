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
