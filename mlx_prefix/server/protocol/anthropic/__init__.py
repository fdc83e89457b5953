"""Anthropic's Messages API bodies: the request (bodies.py), its content blocks (blocks.py),
its tools and tool_choice (tools.py), its thinking and effort (thinking.py)."""
