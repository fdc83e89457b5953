"""mlx-prefix: a prompt-caching OpenAI-compatible LLM server for MLX."""

__version__ = "0.1.0"
