"""mlx-prefix: a prompt-caching OpenAI-compatible LLM server for MLX."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["GenerationResult", "PrefixCacheSession", "__version__", "chat_prompt"]

if TYPE_CHECKING:
    from mlx_prefix.session import GenerationResult, PrefixCacheSession, chat_prompt

# Imported on first access: `import mlx_prefix` (the launcher, `--version`) must not load MLX.
_LAZY = {name: "mlx_prefix.session" for name in __all__ if name != "__version__"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'mlx_prefix' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
