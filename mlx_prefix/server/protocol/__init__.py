"""Request bodies -> engine records, one module per API family (as in vLLM and SGLang).

Pure: validates, never touches the engine. Unknown fields are ignored (clients send many
we have no use for); known fields with the wrong type or range raise InvalidRequest
naming the field in `param`. Embeddings bodies are the exception: their fields are few
and a peer's extra ones (`truncate`, `input_type`, `normalize`) would change the vectors,
so any other field is refused.
"""
