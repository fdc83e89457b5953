import pytest

from mlx_prefix.config import CacheConfig, EngineConfig
from mlx_prefix.env import from_env
from mlx_prefix.server.settings import ServerSettings


def test_env_vars_fill_fields_and_flags_override_them(monkeypatch):
    monkeypatch.setenv("MLX_PREFIX_CACHE_BUDGET_BYTES", "1000")
    monkeypatch.setenv("MLX_PREFIX_CACHE_ENABLED", "off")
    monkeypatch.setenv("MLX_PREFIX_CACHE_MAX_ENTRIES", "none")
    config = from_env(CacheConfig, "CACHE", {"budget_bytes": 5, "prefill_chunk": None})
    assert (config.budget_bytes, config.enabled, config.max_entries) == (5, False, None)
    assert config.prefill_chunk == CacheConfig().prefill_chunk


def test_tuple_fields_split_on_commas(monkeypatch):
    monkeypatch.setenv("MLX_PREFIX_SERVER_ALLOWED_ORIGINS", "https://a.example, https://b.example")
    settings = from_env(ServerSettings, "SERVER")
    assert settings.allowed_origins == ("https://a.example", "https://b.example")


def test_bad_env_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("MLX_PREFIX_CACHE_PREFILL_CHUNK", "lots")
    with pytest.raises(ValueError, match="MLX_PREFIX_CACHE_PREFILL_CHUNK"):
        from_env(CacheConfig, "CACHE")


def test_byte_sizes_take_units_in_variables_as_in_flags(monkeypatch):
    monkeypatch.setenv("MLX_PREFIX_CACHE_BUDGET_BYTES", "4GiB")
    assert from_env(CacheConfig, "CACHE").budget_bytes == 4 * 2**30
    monkeypatch.setenv("MLX_PREFIX_CACHE_BUDGET_BYTES", "plenty")
    with pytest.raises(ValueError, match="MLX_PREFIX_CACHE_BUDGET_BYTES"):
        from_env(CacheConfig, "CACHE")


def test_engine_flags_and_variables_reach_the_engine_config(monkeypatch):
    from mlx_prefix.cli import build_parser
    from mlx_prefix.cli.args import engine_config

    monkeypatch.setenv("MLX_PREFIX_ENGINE_MAX_QUEUED", "7")
    args = build_parser().parse_args(["serve", "--max-running", "3", "--no-prefetch"])
    config = engine_config(args)
    assert (config.max_running, config.max_queued, config.prefetch_next_turn) == (3, 7, False)
    assert engine_config(build_parser().parse_args(["serve"])).prefetch_next_turn is True
    gather = build_parser().parse_args(["serve", "--gather-tokens", "0"])
    assert engine_config(gather).gather_tokens == 0
    with pytest.raises(ValueError, match="gather_tokens"):
        EngineConfig(gather_tokens=-1)


def test_finish_cancelled_from_flag_or_variable(monkeypatch):
    from mlx_prefix.cli import build_parser
    from mlx_prefix.cli.args import engine_config

    def parsed(*flags: str) -> bool:
        return engine_config(build_parser().parse_args(["serve", *flags])).finish_cancelled

    assert parsed() is True
    assert parsed("--no-finish-cancelled") is False
    monkeypatch.setenv("MLX_PREFIX_ENGINE_FINISH_CANCELLED", "0")
    assert parsed() is False
    assert parsed("--finish-cancelled") is True  # the flag over the variable


def test_responses_store_size_from_flag_or_variable(monkeypatch):
    from mlx_prefix.cli import build_parser

    monkeypatch.setenv("MLX_PREFIX_SERVER_RESPONSES_STORE", "12")
    assert from_env(ServerSettings, "SERVER").responses_store == 12
    args = build_parser().parse_args(["serve", "--responses-store", "3"])
    overrides = {"responses_store": args.responses_store}
    assert from_env(ServerSettings, "SERVER", overrides).responses_store == 3
    with pytest.raises(ValueError, match="responses_store"):
        ServerSettings(responses_store=-1)


def test_cache_sharing_from_flag_or_variable(monkeypatch):
    from mlx_prefix.cli import build_parser

    assert ServerSettings().cache_sharing == "origin"
    monkeypatch.setenv("MLX_PREFIX_SERVER_CACHE_SHARING", "global")
    assert from_env(ServerSettings, "SERVER").cache_sharing == "global"
    args = build_parser().parse_args(["serve", "--cache-sharing", "origin"])
    overrides = {"cache_sharing": args.cache_sharing}
    assert from_env(ServerSettings, "SERVER", overrides).cache_sharing == "origin"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--cache-sharing", "per-user"])
    with pytest.raises(ValueError, match="cache_sharing"):
        ServerSettings(cache_sharing="per-user")


def test_max_request_pixels_from_flag_or_variable_reaches_the_image_limits(monkeypatch):
    from mlx_prefix.cli import build_parser
    from mlx_prefix.cli.serve_args import server_settings

    default = server_settings(build_parser().parse_args(["serve"]))
    assert default.images.max_request_pixels == 4 * 3840 * 2160
    monkeypatch.setenv("MLX_PREFIX_SERVER_MAX_REQUEST_PIXELS", "5000000")
    assert server_settings(build_parser().parse_args(["serve"])).images.max_request_pixels == (
        5_000_000
    )
    args = build_parser().parse_args(["serve", "--max-request-pixels", "1000"])
    assert server_settings(args).images.max_request_pixels == 1000
    with pytest.raises(ValueError, match="max_request_pixels"):
        ServerSettings(max_request_pixels=-1)
    monkeypatch.setenv("MLX_PREFIX_SERVER_RESPONSES_STORE_BYTES", "1MiB")
    assert from_env(ServerSettings, "SERVER").responses_store_bytes == 1024 * 1024
