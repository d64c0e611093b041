"""Fitting the xKV baseline: the cross-layer SVD's statistics over the dump's train rows (source
and targets' K/V, block by block) and its held-out fit.
"""

from __future__ import annotations

import numpy as np
import torch

from ..data.dump_file import DumpReader
from ..data.loader import cat_features, iter_blocks
from .fit_metrics import FitStats
from .xkv import KINDS, GramAccumulator, XKVBasis
from ..pipeline.progress import Progress

# Rows per read (rounded up to the dump's block): memory is O(rows * L * kv_dim) per read
# plus the two (L*kv_dim)² Grams, whatever the number of rows; the sums do not depend on it
# beyond float64 rounding.
BLOCK_ROWS = 8192


def xkv_names(kind: str, layers: tuple[int, ...]) -> list[str]:
    """The dump's datasets of one kind, in stacking order (``k_20``, ``k_24``, ...)."""
    return [f"{kind}_{layer}" for layer in layers]


def xkv_statistics(reader: DumpReader, layers: tuple[int, ...], mask: np.ndarray, block_rows: int
                   ) -> dict[str, GramAccumulator]:
    """``{kind: GramAccumulator}`` of the stacked K (V) rows of ``layers`` over the masked rows, one pass."""
    width = reader.layout.widths()[f"k_{layers[0]}"] * len(layers)
    accs = {kind: GramAccumulator(width, f"xkv {kind} Gram of layers {list(layers)}") for kind in KINDS}
    with Progress(total=int(mask.sum()), desc="xkv fit", unit="row", unit_scale=True) as bar:
        for block in iter_blocks(reader, xkv_names("k", layers) + xkv_names("v", layers), mask, block_rows):
            for kind, acc in accs.items():
                acc.update(torch.from_numpy(cat_features(block, xkv_names(kind, layers))))
            bar.update(len(block[f"k_{layers[0]}"]))
    return accs


def xkv_heldout(reader: DumpReader, basis: XKVBasis, mask: np.ndarray, block_rows: int) -> dict:
    """Held-out fit of ``basis`` on the masked rows: per layer and kind FitStats, and captured energy."""
    layers = basis.layers
    stats = {f"{kind}_{layer}": FitStats() for kind in KINDS for layer in layers}
    kept = {kind: 0.0 for kind in KINDS}
    total = {kind: 0.0 for kind in KINDS}
    with Progress(total=int(mask.sum()), desc="xkv val", unit="row", unit_scale=True) as bar:
        for block in iter_blocks(reader, xkv_names("k", layers) + xkv_names("v", layers), mask, block_rows):
            for kind in KINDS:
                rows = {layer: torch.from_numpy(block[f"{kind}_{layer}"]) for layer in layers}
                c = basis.compress(kind, rows)
                for layer, x_hat in basis.reconstruct(kind, c).items():
                    stats[f"{kind}_{layer}"].update(x_hat, rows[layer])
                kept[kind] += float(c.double().square().sum())
                total[kind] += float(basis.stack(rows).double().square().sum())
            bar.update(len(block[f"k_{layers[0]}"]))
    out = {}
    for name, s in stats.items():
        r = s.result()
        out[name] = {"rel_err": r["rel_mse"], "r2": r["r2"], "cos": r["cos"], "n_val": r["n"]}
    return {"layers": out, "energy_val": {kind: kept[kind] / total[kind] for kind in KINDS}}
