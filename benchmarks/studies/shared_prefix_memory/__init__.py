"""Each cached token stored once (issue 48): bytes held per distinct token, restore time and
warm-turn TTFT, and the sessions a budget holds, before and after.

Three parts, each its own run (`--part`), writing benchmarks/out/shared_prefix_memory-
<part>-<label>.json. Run one label on main's code and one on the change's, the same day on
the same machine (`PYTHONPATH=<main checkout>:<this checkout>` picks main's mlx_prefix and
this benchmark; the servers inherit PYTHONPATH):

- `memory`: `mlx-prefix serve` with the bundled SmolLM2-135M-Instruct (float32, 46,080
  bytes of KV per token), `--disk-cache off`, a budget nothing is evicted under. Three
  interleaved five-turn conversations, A and B sharing a system prompt, C with its own
  (KJV text; greedy replies of up to 40 tokens). Then GET /v1/dashboard: the stored
  entries nest by their longest stored prefix, so the distinct tokens they cover are the
  sum of what each adds to its parent (a few template tokens per branch are counted twice
  where siblings share more than their stored parent); bytes held / (distinct x KV per
  token) is the figure (1.0: each token once; step padding included). Each turn's TTFT and
  cached tokens, then what a regenerate and an edit-last-message of A's last turn and a
  regenerate of its turn before restore. With `--disk`, the same workload with the disk
  tier on (`--disk-cache full`): bytes of the files written against the same KV.
- `sessions`: eight interleaved agent sessions (a shared 600-token system prompt, then
  tool results of ~330 tokens and 16-token replies, 11 steps: ~4.2K tokens each), round
  robin, under one byte budget (`--budget`, default 112 MiB: about three sessions' worth
  of today's entries), on mlx-prefix, mlx_lm.server (`--prompt-cache-bytes`, same bytes)
  and vllm-mlx where `make peers` installed it. Model: a random-weight llama with
  SmolLM2's tokenizer, 4 layers, 2 KV heads of 64 (4,096 bytes of KV per token): the
  cache's behaviour is what is measured, and SmolLM2 would take hours to prefill the
  misses here. Tokens reused per turn (usage.prompt_tokens_details.cached_tokens).
- `restore`: in process (mlx-prefix's Engine), the same tiny llama with a 128K context
  (SmolLM2's is 8K and it prefills 16K-64K far too slowly on this CPU): for each length a
  cold turn of that many tokens, then two warm turns of ~100 new tokens each (the second
  restores from an entry whose parent is the first's: a chain of pieces after the change).
  Per warm turn: the restore (`restore_longest`, incl. evaluating the restored state),
  the first prefill step after it (where today's restore pays its copy, on first append)
  and the TTFT.

    python -m mlx_prefix.blas_exec python -m benchmarks.studies.shared_prefix_memory \\
        --part memory --label after
"""
