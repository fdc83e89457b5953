"""A live server over real tiny models that loads others on demand (server/served/pool.py):
the default model's folder, the loader every test shares, and the pool, closed after."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from mlx_prefix.config import CacheConfig, DiskConfig
from mlx_prefix.engine.engine import Engine
from mlx_prefix.models.load import load_model
from mlx_prefix.models.settings_file import ModelsFile
from mlx_prefix.server import ServerSettings, create_app
from mlx_prefix.server.served.names import ModelSpec
from mlx_prefix.server.served.pool import ModelPool
from support.models import TEST_CACHE
from support.server_fakes import LiveServer


@contextlib.contextmanager
def pool_server(
    default: Path,
    cache: CacheConfig = TEST_CACHE,
    model_settings: ModelsFile | None = None,
    disk: DiskConfig | None = None,
    **settings,
) -> Iterator[tuple[str, ModelPool]]:
    """(base URL, pool) of a server whose --model is `default` (with its disk tier when
    `disk`); `settings` are ServerSettings fields (allowed_models, max_models,
    keep_alive_s, api_key...). Models load with their adapter, as `serve` loads them."""

    def loader(spec: ModelSpec, store, disk_cache) -> Engine:
        adapter = str(spec.adapter) if spec.adapter else None
        model = load_model(str(spec.folder), adapter=adapter)
        return Engine(model, cache, store=store, disk_config=disk, disk_cache=disk_cache)

    first = loader(ModelSpec(default, None, default.name, True), None, None)
    app = create_app(first, ServerSettings(**settings), loader, model_settings=model_settings)
    pool = app.state.server.models
    try:
        with LiveServer(app) as server:
            yield server.url, pool
    finally:
        pool.close()
