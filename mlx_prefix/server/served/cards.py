"""/v1/models' rows (and what /api/tags lists): the models the pool serves, as cards.

The default model (with its aliases), each --model-alias (not resident until asked for),
then every other resident model; an adapter is listed under its base model's row, never
as a row of its own. Reads the pool's slots; changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from .loading import Slot
from .names import ModelSpec


@dataclass(frozen=True)
class ModelCard:
    """One /v1/models row."""

    id: str
    context_length: int | None
    aliases: tuple[str, ...] = ()
    alias_of: str | None = None  # --model-alias rows: the folder or hub id it names
    resident: bool = True
    adapters: tuple[str, ...] = ()  # adapter folders with an engine resident


def model_cards(
    default_spec: ModelSpec,
    default_aliases: tuple[str, ...],
    model_aliases: Mapping[str, str],
    slots: Iterable[Slot],
) -> list[ModelCard]:
    """The rows for the resident `slots` (least recently used first, as the pool keeps
    them), the default model's first whether resident or not."""
    slots = list(slots)
    default = next((s for s in slots if s.spec.key == default_spec.key), None)
    rows = {
        default_spec.id: ModelCard(
            default_spec.id,
            _context(default),
            default_aliases,
            resident=default is not None,
        )
    }
    for alias, target in model_aliases.items():
        rows.setdefault(alias, ModelCard(alias, None, alias_of=target, resident=False))
    for slot in slots:
        row = rows.get(slot.spec.id) or ModelCard(slot.spec.id, None, resident=False)
        if slot.spec.adapter is None or slot.spec == default_spec:
            row = replace(row, resident=True, context_length=_context(slot))
        else:
            row = replace(row, adapters=(*row.adapters, str(slot.spec.adapter)))
        rows[slot.spec.id] = row
    return list(rows.values())


def _context(slot: Slot | None) -> int | None:
    return slot.served.engine.model.context_length if slot is not None else None
