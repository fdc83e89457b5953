"""What an engine checks and measures at startup, before it serves anything.

In the constructor (the caller's thread), features that cannot serve together are
refused in one line: a draft model that does not fit the target, or a draft with
quantized KV; quantized KV is checked against the model's head sizes.

By default nothing is measured: prefill computes each request alone on its grid (so
what the cache stores is exact by construction) and decode batches every running row
in one forward, as mlx_lm.server does (`PLAIN`). Only `--deterministic` (batch
invariance) measures, on the engine thread before the first job: `calibrate` makes
batched forwards batch-invariant (engine/forward/rowwise.py) and checks it on this model and
backend (engine/probe.py). With a draft model, `check_speculator` checks that a verify
forward keeps plain decoding's numbers (engine/decode/speculative.py); what does not hold
runs alone, or plainly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mlx_prefix.config import EngineConfig
from mlx_prefix.engine.decode.speculative import (
    DraftMismatch,
    Speculator,
    check_draft,
    verify_matches,
)
from mlx_prefix.engine.forward import rowwise
from mlx_prefix.engine.forward.kv_quant import KvQuant, check_model
from mlx_prefix.engine.forward.rowwise import Grouping
from mlx_prefix.engine.probe import ProbeResult, probe
from mlx_prefix.models.load import LoadedModel

log = logging.getLogger("mlx_prefix.engine")


def check_draft_config(
    model: LoadedModel, draft: LoadedModel | None, config: EngineConfig | None
) -> None:
    """Refuse a draft model that cannot serve `model`, or one combined with --kv-bits."""
    if draft is None:
        return
    if config is not None and config.prompt_lookup:
        raise DraftMismatch("--prompt-lookup and --draft-model: one drafter at a time")
    check_draft(model, draft)
    if config is not None and config.kv_bits is not None:
        # Not shown exact yet: the verify forward over quantized keys.
        raise DraftMismatch("--draft-model cannot be combined with --kv-bits yet")


def quantized_kv(model: LoadedModel, config: EngineConfig) -> KvQuant | None:
    """The engine's quantized-KV setting (engine/forward/kv_quant.py), checked against the model."""
    kv = KvQuant.of(config.kv_bits, config.kv_group_size, config.quantized_kv_start)
    if kv is not None:
        check_model(model.model, kv)
    return kv


@dataclass(frozen=True, slots=True)
class Calibration:
    # Most decode rows per BLAS-consistent group (engine/forward/rowwise.py); None: a decode
    # step is one plain forward of every row (not batch-invariant).
    rows: int | None
    stacked_prefill: bool  # equal-shape chunks may share a forward
    batched_decode: bool  # requests may decode in one batch


# The default: each prefill alone, decode batched plainly; nothing measured.
PLAIN = Calibration(rows=None, stacked_prefill=False, batched_decode=True)


class Agreement:
    """How the ranks of a sharded engine combine what each measured
    (engine/sharded/lockstep.py); an engine on its own keeps its own figures."""

    def rows(self, found: list[Grouping]) -> list[Grouping]:
        """Each layer shape's decode row group (engine/forward/rowwise.py `measure_rows`)."""
        return found

    def verdicts(self, checked: ProbeResult) -> ProbeResult:
        return checked


def calibrate(model: LoadedModel, agreement: Agreement | None = None) -> Calibration:
    """Install the batch-invariant layers, find the consistent row count and probe
    batching on this model (engine thread; every rank alike when sharded)."""
    agree = agreement or Agreement()
    net = model.model
    rowwise.install(net)
    rows = rowwise.assign_rows(net, agree.rows(rowwise.measure_rows(net)))
    checked = agree.verdicts(probe(net, rows, model.tokenizer.vocab_size))
    return Calibration(rows, checked.stacked_prefill, checked.batched_decode)


def check_speculator(model: LoadedModel, rows: int | None, spec: Speculator | None) -> None:
    """Turn off a speculator whose verify forward changes this model's numbers here.
    Its verify forward needs the batch-invariant layers, installed here if the engine
    runs plainly (outside a verify they compute as before)."""
    if spec is None:
        return
    if rows is None:
        rowwise.install(model.model)
    if not verify_matches(model.model, rows or 1, model.tokenizer.vocab_size):
        log.warning("a verify forward changes this model's numbers here: decoding plainly")
        spec.enabled = False  # the replies are the same, only not sped up
