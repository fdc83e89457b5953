"""Anthropic's Messages API bodies: the request (bodies.py) and its content blocks
(blocks.py)."""
