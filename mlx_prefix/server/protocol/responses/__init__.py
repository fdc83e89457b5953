"""OpenAI Responses API bodies (bodies.py) and their items -> the conversation (items.py)."""
