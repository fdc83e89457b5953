"""Text embeddings (`POST /v1/embeddings`): an embedding model served beside the chat model.

    model.py   EmbeddingModel: a decoder checkpoint loaded with mlx-lm's own model classes,
               backbone only (no LM head), its pooling and normalisation read from the
               folder's sentence-transformers files; one padded batch -> pooled vectors (MLX)
    batches.py which sequences share a forward (sorted by length, bounded padded tokens)
    worker.py  EmbeddingWorker: the one thread that runs the model; requests queue there,
               and whatever is waiting when it turns is embedded together

Why mlx-lm's classes and not PyPI `mlx-embeddings` 0.1.0: mlx-lm is already the server's
model library (Apple's ml-explore, released every few weeks, and every decoder family
the chat side loads: qwen3, llama, gemma3, mistral...), so Qwen3-Embedding, gte-Qwen2 or
e5-mistral load with the same quantization, dtype and loading code as chat models, and
run mlx-lm's fused kernels (`mx.fast` RoPE, RMSNorm, SDPA). mlx-embeddings re-implements
those models on the same MLX ops and is no faster for them (benchmarks/
studies/embedding_libraries.py, same weights, alternated: within 10% either way on a
loaded 2-core CPU, vectors equal to cosine 0.999999); it pins `mlx-vlm` (which
pulls opencv, datasets, mlx-audio and fastapi) and `transformers[sentencepiece]`, and is
GPL-3.0, which an MIT server cannot take on as a dependency. What it has that mlx-lm
lacks is bidirectional encoders (BERT, XLM-RoBERTa, ModernBERT); those are refused at
load with a line saying so.
"""
