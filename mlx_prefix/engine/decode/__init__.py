"""The decode phase (engine thread): requests whose prompt is computed, one token a step
each (phase.py) in one batch (batch.py), each row sampled by its own sampler
(sampling.py, logits.py, constraints.py), its text streamed with stop strings held back
(text.py); a request decoding alone may speculate with a draft model (speculative.py).
"""

from __future__ import annotations

from mlx_prefix.lazy import exports

_NAMES = {
    "DecodePhase": "phase",
    "DecodeBatch": "batch",
    "batchable": "batch",
    "TokenSampler": "sampling",
    "LogitsAdjuster": "logits",
    "ConstraintFactory": "constraints",
    "TextStream": "text",
    "Speculator": "speculative",
    "SpeculationStats": "speculative",
}
__all__ = list(_NAMES)
__getattr__ = exports(__name__, _NAMES)
