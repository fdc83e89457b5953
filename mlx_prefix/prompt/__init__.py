"""Prompts: a conversation rendered through the chat template into tokens, and its
checkpoint plan (request side); a reply read apart into reasoning, text and tool calls
(reply side). Import each name from its module.
"""
