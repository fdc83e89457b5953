"""The decode phase (engine thread): requests whose prompt is computed, one token a step
each (phase.py: DecodePhase, and the Arrival it admits: arrival.py) in one batch
(batch.py; a step's results: step.py), each
row (running.py: Running) sampled by its own sampler (sampling.py, logits.py,
constraints.py), its text streamed with stop strings held back (text.py), its reasoning
bounded (reasoning_budget.py); a request decoding alone may speculate with a draft model
(speculative.py). Import each name from its module.
"""
