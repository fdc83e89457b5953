"""Ollama's API handlers (its paths under /api/, and / as its liveness probe): chat.py
(/api/chat and /api/generate), embed.py (/api/embed and the legacy /api/embeddings),
info.py (tags, show, ps, version, and the model-store routes Ollama's clients call)."""
