"""The ``storage`` stage: stored KV bytes per token, per group, on every basis (docs/design.md §6).

    python -m ced_csa2.stages.storage       # what `dvc repro storage` runs

Reads ``params.yaml`` and the active model's config (no weights), and writes
``metrics/storage.json`` with, for the active model and for the full Qwen3.5-4B geometry
(built locally, no download; plan 16 / 20 / 24, 28, 32):

* ``kv.<dtype>.<basis>.<group>``: ``bytes_per_token`` and ``compression_vs_baseline``
  for dtype ``bf16`` / ``fp32``, every group of the registry (``xkv`` at ``xkv.rank``
  coefficients, ``0`` = ``kv_dim``) and bases ``decoder_attention`` (attention layers above
  the split), ``all_attention`` (every attention layer) and
  ``all_attention_amortised_{4k,32k,128k}`` (``all_attention`` plus the adapter weights,
  or xkv's bases, and a sink group's kept target entries, spread over a context of that length);
* ``stored_layers`` and ``weights`` (adapter, xkv basis, FP4 rotation and projector parameter counts,
  and how each is counted);
* ``sink_bytes_per_sequence.<dtype>.<group>``: a sink group's kept target entries per sequence (a
  constant, in no per-token basis; ``sink_counting``);

plus ``kv_format`` (the FP4 groups' format, whose scale block sets their bytes: the report refuses
figures of another one), the DeepSeek-V4.1 reference figures of seed 003 (``deepseek_v4_1``) and a note on
the seed's unexplained 3.44×.  All arithmetic lives in :mod:`ced_csa2.kv.kv_bytes`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from ..config import Params
from ..kv.formats import FP4_FORMATS
from ..kv.storage_table import (
    BASIS_DOC,
    QWEN3_5_4B_PLAN,
    deepseek_section,
    model_section,
    qwen3_5_4b_geometry,
    seed_ratio_note,
)
from ..model_utils import QWEN3_5_4B_ID
from ..pipeline.atomic_files import write_json
from ..pipeline.paths import STORAGE_METRICS
from ..pipeline.stage_runner import run_stage, stage_arguments
from ..plan import load_plan
from ..groups import GROUPS

log = logging.getLogger(__name__)


def run(params: Params, workdir: Path = Path(".")) -> dict:
    """Compute every storage figure and write ``metrics/storage.json`` under ``workdir``; returns it."""
    plan, geo = load_plan(params.plan, params.model)
    width_mult, adapter_input = params.train_adapters.width_mult, params.train_adapters.input
    fp4_group = FP4_FORMATS[params.kv_format]().group
    qwen_geo = qwen3_5_4b_geometry()
    xkv_rank = params.xkv.rank  # 0 = each geometry's own kv_dim
    qwen = model_section(QWEN3_5_4B_ID, qwen_geo, QWEN3_5_4B_PLAN.validate(qwen_geo), GROUPS, width_mult,
                         adapter_input, fp4_group, xkv_rank)
    metrics = {
        "kv_format": params.kv_format,  # the FP4 groups' entries (fp4_group); the report checks it is params.yaml's
        "bases": BASIS_DOC,
        "groups": {name: g.doc for name, g in GROUPS.items()},
        "active_model": model_section(params.model.name, geo, plan, GROUPS, width_mult, adapter_input, fp4_group,
                                      xkv_rank),
        "qwen3_5_4b": qwen,
        "deepseek_v4_1": deepseek_section(),
        "note": seed_ratio_note(qwen),
    }
    write_json(Path(workdir) / STORAGE_METRICS, metrics)
    log.info("wrote %s", Path(workdir) / STORAGE_METRICS)
    return metrics


def main(argv: Sequence[str] | None = None) -> None:
    run_stage(run, *stage_arguments(run, argv))


if __name__ == "__main__":
    main()
