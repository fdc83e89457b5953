"""Ollama's /api/chat and /api/generate bodies (bodies.py) and the fields around their
prompt: options, format, think, keep_alive (options.py)."""
