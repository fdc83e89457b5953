"""Why a request reused what it did (issue 46): every request's reuse explained.

    trace.py      CacheTrace: what the engine learned about one request's prompt and the
                  cache (filled at submit and at admission); ExplainContext: its model's
                  tokenizer, grid and eviction record
    history.py    PromptHistory: each namespace's recent prompts (and the replies the
                  server generated for them), bounded; the closest to a new prompt
    reasons.py    the reason of one request from the evidence (pure): hit, new, edited,
                  re_rendered, volatile, evicted, grid, model, settings, disabled
    texts.py      where a divergence is (message, role) and the texts either side of it
    explainer.py  Explainer: a thread of its own turns finished requests into records
                  (GET /v1/cache/requests, the dashboard, /metrics, one log line)
Pure Python (no MLX, no HTTP). The engine imports trace.py only; the server the rest.
"""
