"""What the views show once every model is unloaded (ModelPool.primary with none left):
the last model's name, tokenizer and the shared cache's views, without its engine.

Keeping the unloaded Engine itself for this kept all it referenced alive (its phases'
layer snapshots, the planner, a vision model's tower and feature cache), one more
engine's worth each time the last model went. This holds only the model's description
(an empty module in place of the weights, no vision part, no tokenizer: a 151K-token
vocabulary's takes ~90 MB) and the cache views, built anew without the draft model or
the last jobs' activity.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

from mlx_prefix.errors import Unavailable
from mlx_prefix.prompt.reply.reader import PLAIN_REPLIES, ReplyFormat

if TYPE_CHECKING:
    from mlx_prefix.engine.cache_views import CacheViews
    from mlx_prefix.engine.interface import EngineAPI
    from mlx_prefix.models.load import LoadedModel


class NoTokenizer:
    """The unloaded model's tokenizer went with it: views that decode (the dashboard's
    tree) show its entries' tokens without their text."""

    def decode(self, tokens: Any) -> str:
        return ""


@dataclass(eq=False)
class UnloadedEngine:
    """EngineAPI's views of an unloaded model; what would run a request refuses. The
    server reads and acts on the cache through `views`, as on a loaded engine's (no turn
    driver left: an action is applied at once)."""

    model: LoadedModel
    model_key: str
    views: CacheViews
    failure: str | None = None
    reply_format: ReplyFormat = PLAIN_REPLIES  # no reply is read: a request is refused

    def _refuse(self, *_: Any, **__: Any) -> Any:
        raise Unavailable(f"model '{self.model.name}' is unloaded: a request naming it loads it")

    submit = start_warm = count_tokens = _refuse

    def shutdown(self, timeout: float = 10.0, save_timeout: float = 0.0) -> None:
        pass


def unloaded(engine: EngineAPI) -> EngineAPI:
    """A stand-in for `engine`, unloaded, that holds none of it; a test's fake engine
    (its views are no CacheViews) as it is."""
    from mlx_prefix.engine.cache_views import CacheViews

    views = engine.views
    if not isinstance(views, CacheViews):
        return engine
    import mlx.nn as nn

    from mlx_prefix.engine.activity import ActivityBoard

    # A board of its own: the old one's last Activity names the engine's last jobs.
    bare = CacheViews(views.store, views.disk, views.model_key, views.prefetch, ActivityBoard(1))
    model = replace(
        engine.model, model=nn.Module(), vision=None, tokenizer=cast(Any, NoTokenizer())
    )
    return UnloadedEngine(model, engine.model_key, bare)
