"""Every file the pipeline reads or writes, relative to the repository root (defined once).

``dvc.yaml`` names the same paths; ``tests/test_graph.py`` checks that each stage
declares every one of them it reads.
"""

from __future__ import annotations

from pathlib import Path

DATA, MODELS, METRICS, REPORTS = Path("data"), Path("models"), Path("metrics"), Path("reports")
# Wall times and speed ratios of the last run of each stage: measurements of a machine, not
# results, so in no DVC output (a rerun would change dvc.lock) and not in git (.gitignore).
TIMINGS = Path("timings")


def timings_path(stage: str) -> Path:
    """``timings/<stage>.json`` (``stage`` as DVC names it, ``@`` kept: ``tune@attn_out``)."""
    return TIMINGS / f"{stage}.json"

# check_params: params.yaml validated, every default filled in
VALIDATED_PARAMS = DATA / "params.json"

# prepare
CORPUS_DIR = DATA / "corpus"
TRAIN_JSONL = CORPUS_DIR / "train.jsonl"
EVAL_JSONL = CORPUS_DIR / "eval.jsonl"
GSM8K_JSONL = DATA / "gsm8k.jsonl"
PREPARE_METRICS = METRICS / "prepare.json"
DOMAINS_DIR = CORPUS_DIR / "domains"


def domain_jsonl(name: str) -> Path:
    """The records of evaluation domain ``name`` (``data.domains``), in ``eval.jsonl``'s format."""
    return DOMAINS_DIR / f"{name}.jsonl"


def provenance_path(path: Path) -> Path:
    """Where ``prepare`` records what the file at ``path`` was made from: ``train.jsonl`` -> ``train.provenance.json``.

    Beside the file, not in it: a JSON-lines file has no place for it (lm-eval reads ``gsm8k.jsonl``
    as it is), and one record per file changes only when that file's params do.
    """
    return path.with_suffix(".provenance.json")


# dump (the partial file lives outside the DVC out: DVC deletes outs before a run)
DUMP_PATH = DATA / "dump" / "dump.h5"
DUMP_PARTIAL = DATA / "dump.partial.h5"


def dump_shard(rank: int, world: int) -> tuple[Path, Path]:
    """A data-parallel dump's shard of rank ``rank`` of ``world``: complete, and while it grows.

    Beside :data:`DUMP_PARTIAL`, outside the DVC out; removed once merged into :data:`DUMP_PATH`.
    """
    stem = f"dump.partial.rank{rank}of{world}"
    return DATA / f"{stem}.h5", DATA / f"{stem}.growing.h5"
DUMP_METRICS = METRICS / "dump.json"

# ridge, train_projector, train_adapters
RIDGE_PATH = MODELS / "ridge.pt"
RIDGE_METRICS = METRICS / "ridge.json"
PROJECTORS_EXTRA = MODELS / "projectors_extra.pt"
PROJECTOR_METRICS = METRICS / "projector.json"
EXTRA_METRICS = METRICS / "extra_projectors.json"
ADAPTERS_PATH = MODELS / "adapters.pt"
ADAPTERS_METRICS = METRICS / "adapters.json"
CURVES = METRICS / "curves"  # one long-format table per training stage (train.training.write_curves)
PROJECTOR_CURVES = CURVES / "train_projector.tsv"
ADAPTERS_CURVES = CURVES / "train_adapters.tsv"

# fit_xkv (the cross-layer low-rank baseline)
XKV_PATH = MODELS / "xkv.pt"
XKV_METRICS = METRICS / "xkv.json"

# evaluation, storage, report
PPL_METRICS = METRICS / "ppl.json"
GSM8K_METRICS = METRICS / "gsm8k.json"
GENERATION_METRICS = METRICS / "generation.json"
RETRIEVAL_METRICS = METRICS / "retrieval.json"
GOLD_PATH = DATA / "gsm8k_gold.json"
STORAGE_METRICS = METRICS / "storage.json"
SUMMARY = METRICS / "summary.json"  # the DVC metrics (the headline)
GROUPS_TABLE = METRICS / "groups.tsv"  # every group's numbers with their intervals (a DVC plot)


# The seed's recipe read literally (PyTorch's random init, the last epoch's weights), trained by
# train_projector beside the main projector as the report's reference row.
SEED_INIT = "seed_init"
SEED_INIT_MODELS = MODELS / f"projector_{SEED_INIT}"


def projector_path(layer: int, models: Path = MODELS) -> Path:
    """Checkpoint of the source layer's projector, named as in the seed (``projector_k20v20.pt``)."""
    return models / f"projector_k{layer}v{layer}.pt"


def objective_models(objective: str) -> Path:
    """Maps written by ``tune@<objective>``."""
    return MODELS / "objectives" / objective


def objective_pair_models(objective: str, pair: str) -> Path:
    """Folder of one of ``tune@<objective>``'s two pairs (``ced_csa2.pipeline.map_roles.PAIRS``): ``csa2``'s is the
    branch's folder, ``ced_csa2``'s its ``ced_csa2/``."""
    return objective_models(objective) / "ced_csa2" if pair == "ced_csa2" else objective_models(objective)


OBJECTIVES_EVAL = METRICS / "objectives" / "eval.json"  # eval_objectives: every objective's scores

# tune_mode_a: the maps Mode A runs with under mode_a.maps: trained
MODE_A_MODELS = MODELS / "mode_a"
MODE_A_SINK = MODE_A_MODELS / "sink.pt"  # the attention sink's K/V above the cut (ced_runtime.SinkKV)
MODE_A_METRICS = METRICS / "mode_a" / "train.json"
MODE_A_CURVES = CURVES / "tune_mode_a.tsv"


def objective_metrics(objective: str) -> Path:
    """``train.json`` of one objective's branch (``tune@<objective>``)."""
    return METRICS / "objectives" / objective


def objective_curves(objective: str) -> Path:
    """Training curves of ``tune@<objective>`` (the header alone for ``ridge``, which trains nothing)."""
    return CURVES / "tune" / f"{objective}.tsv"
