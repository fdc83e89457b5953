"""Prompt lookup's parts below the decode phase (engine/decode/lookup.py drives them):
the n-gram index a request drafts from, its adaptive draft length, and what a verify
costs against a plain step. Pure Python: no MLX call."""
