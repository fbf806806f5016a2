"""Folding repeated layers in reports: runs of consecutive layers with the same structure.

`tilertc inspect --summary` and `tilertc explain` show a model of dozens of identical layers as
one row per op with a ×count; they differ only in what a row holds and what "the same
structure" means, which each passes in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar


class LayerRow(Protocol):
    name: str
    layers: tuple[int, int] | None  # (first, last) layer of the row; None outside the layers


Row = TypeVar("Row", bound=LayerRow)


def rename(name: str, layer: int, layers: str) -> str:
    """`layers.3.q_proj` -> `layers.{layers}.q_proj`."""
    prefix = f"layers.{layer}."
    return f"layers.{layers}.{name[len(prefix):]}" if name.startswith(prefix) else name


def layer_runs(rows: Sequence[Row], structure: Callable[[list[Row]], Any]) -> list[list[list[Row]]]:
    """Rows grouped into runs: each run a list of per-layer row lists whose `structure` is
    equal, consecutive layers only; a row outside the layers is a run of its own."""
    segments: list[list[Row]] = []  # one per layer, or one per row outside the layers
    for r in rows:
        if r.layers is not None and segments and segments[-1][0].layers == r.layers:
            segments[-1].append(r)
        else:
            segments.append([r])
    runs: list[list[list[Row]]] = []
    i = 0
    while i < len(segments):
        j = i + 1
        if segments[i][0].layers is not None:
            while (j < len(segments) and segments[j][0].layers is not None
                   and structure(segments[j]) == structure(segments[i])):
                j += 1
        runs.append(segments[i:j])
        i = j
    return runs
