"""One-off studies, each run by hand to answer one question (README.md: one line each)."""
