"""A prompt's prefill shown on stderr while `generate` waits for its first token: tokens
done of the total, how many came from the cache, the rate and the time left (tqdm's
bar, as `pull` shows a download). Nothing is drawn when stderr is not a terminal."""

from __future__ import annotations

from typing import IO

from tqdm import tqdm

from mlx_prefix.records import ProgressEvent


class PrefillBar:
    """Fed the request's ProgressEvents; `close` before the reply's first text."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._bar: tqdm | None = None

    def update(self, event: ProgressEvent) -> None:
        if self._bar is None:
            # `initial`: the cached tokens count as done but not in the rate (tqdm's
            # rate and time left are over n - initial).
            self._bar = tqdm(
                total=event.total,
                initial=event.cached,
                desc="prefill",
                unit="tok",
                file=self._stream,
                leave=False,
                dynamic_ncols=True,
                postfix=f"cached {event.cached}",
            )
        self._bar.update(event.processed - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def wants_bar(stream: IO[str], quiet: bool) -> bool:
    """A bar only for a person watching: stderr a terminal and no `-q`."""
    isatty = getattr(stream, "isatty", None)
    return not quiet and isatty is not None and isatty()
