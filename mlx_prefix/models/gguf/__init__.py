"""GGUF -> an mlx-lm / Hugging Face model folder (the bundled default's source). Import
each name from its module.

    convert.py    GGUF tensors -> safetensors and config.json (q/k un-permuted)
    tokenizer.py  the GGUF's tokenizer metadata -> tokenizer.json
"""
