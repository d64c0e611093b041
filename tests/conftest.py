"""Shared tiny, real objects: the tiny Qwen3.5 profile and a tiny Llama, built locally.

The trainers' autocast dtype
----------------------------
``CED_CSA2_TEST_AMP_DTYPE=<dtype>`` (``bfloat16``, ``float16``, ``float32`` or ``auto``)
runs the whole suite with both trainers' ``amp_dtype`` set to ``<dtype>``, as a machine
whose ``auto`` picks it would (bf16 on AMX CPUs and CUDA)::

    CED_CSA2_TEST_AMP_DTYPE=bfloat16 python -m pytest -q tests/test_distributed.py

Unset, the composed params keep the conf's own value.  Every params file or object a test
builds comes from :func:`compose` or :func:`tiny_params` here, or from
``python -m ced_csa2.compose ... *AMP_OVERRIDES``, which add :data:`AMP_OVERRIDES`; only
``tests/test_config.py`` uses ``ced_csa2.compose.compose`` itself, as it compares
compositions with the committed ``params.yaml``.  Tests that compare two runs of a trainer
take their tolerance from the dtype in effect (:func:`trainer_amp_dtype`, :func:`rtol_for`).
"""

import dataclasses
import functools
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ced_csa2 import compose as _compose
from ced_csa2.config import COMPUTE_DTYPES, Params, from_dict
from ced_csa2.model_utils import build_tiny_model, load_model_and_tokenizer, resolve_dtype
from ced_csa2.train.objective_registry import OBJECTIVES

TINY_OVERRIDES = ["model=tiny_qwen3_5", "data=tiny", "plan=qwen3_5"]

AMP_ENV = "CED_CSA2_TEST_AMP_DTYPE"
AMP_KEYS = ("train_projector.amp_dtype", "train_adapters.amp_dtype")  # every autocast in src/ced_csa2/config.py


def _amp_overrides() -> list[str]:
    dtype = os.environ.get(AMP_ENV, "")
    if not dtype:
        return []
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"{AMP_ENV}={dtype!r}: must be one of {COMPUTE_DTYPES}")
    return [f"{key}={dtype}" for key in AMP_KEYS]


AMP_OVERRIDES = _amp_overrides()  # Hydra overrides: the last one of a key wins, so these go last


def compose(overrides=()) -> str:
    """:func:`ced_csa2.compose.compose` with :data:`AMP_OVERRIDES` appended.

    Composed once per list of overrides and worker: ``conf/`` does not change while the suite runs,
    and hundreds of tests build params from the same few lists (each composition starts Hydra anew)."""
    return _composed(tuple(overrides))


@functools.cache
def _composed(overrides: tuple[str, ...]) -> str:
    return _compose.compose([*overrides, *AMP_OVERRIDES])


def trainer_amp_dtype(params: Params, device: torch.device = torch.device("cpu")) -> torch.dtype:
    """The autocast dtype both trainers of ``params`` run in on ``device`` (``auto`` resolved)."""
    dtypes = {resolve_dtype(cfg.amp_dtype, device) for cfg in (params.train_projector, params.train_adapters)}
    assert len(dtypes) == 1, f"the trainers autocast to different dtypes: {dtypes}"
    return dtypes.pop()


# Float tolerances
# ----------------
# Every float tolerance in tests/ comes from the dtype the compared values are computed in, never
# from the machine a test happened to pass on: another CPU (AVX2, AVX-512, AMX) or BLAS
# (MKL, OpenBLAS) sums in another order, blocks a matmul differently or fuses a multiply-add,
# and each such change moves a result by whole units of rounding.  A tolerance is therefore a
# stated count of roundings times the dtype's eps times the magnitude rounded
# (:func:`rounding_tol`); a bare literal is allowed only with a comment giving its reason
# (tests/test_tolerances.py checks it).

EPS32 = torch.finfo(torch.float32).eps  # 2**-23 = 1.19e-7
EPS64 = torch.finfo(torch.float64).eps  # 2**-52 = 2.22e-16


def rounding_tol(dtype: torch.dtype, roundings: float, magnitude: float = 1.0) -> float:
    """How far two evaluations of one quantity may be apart when they differ only in rounding.

    Parameters
    ----------
    dtype
        The dtype the quantity is computed (accumulated) in.
    roundings
        A bound on the roundings that separate the two results, stated at the call site: each
        operation rounds to within eps/2 relative, so two evaluations that round differently
        are at most eps apart per rounding, and roundings that may all go one way add up
        (counted linearly, the worst case, not as a random walk).  A sum of n terms counts n;
        a per-token quantity summed over n tokens counts n times its own.
    magnitude
        The size of the values rounded (e.g. the largest |logit|, |log p| or |entry|); 1 for a
        relative tolerance.

    Returns
    -------
    float
        ``roundings * finfo(dtype).eps * magnitude``: an absolute bound on ``|a - b|``, or with
        ``magnitude=1`` a relative one.  Call sites keep it orders of magnitude below the
        difference the test guards against, and say so where that is not obvious.
    """
    return roundings * torch.finfo(dtype).eps * magnitude


# Two float32 forwards of one tiny model that compute the same values along different code paths (a
# batch padded or alone, cached decode or whole, sdpa or eager, K/V injected by a runtime): each
# layer's matmuls may sum in another order (up to eps apart per rounding, relative), and the residual
# stream carries the difference to the output.  3 roundings per layer (attention, MLP, residual add)
# over the 32 layers of the deepest tiny model: 96 eps relative (1.1e-5), and as many eps absolute for
# entries near 0 (the tiny models' hidden states, K/V and logits are O(1)).  A wrong K/V, position or
# sink moves the logits by >= 1e-3 (the tests' "must differ" checks), ~100x more.
FORWARD32 = dict(rtol=rounding_tol(torch.float32, 3 * 32), atol=rounding_tol(torch.float32, 3 * 32))

# How far apart two runs of one training may end when they differ only in float evaluation
# order (a batch whole or as two DDP shards, one thread or several).  Under float32 the
# differences are summation-order rounding inside every matmul and gradient sum, carried
# through the steps: FLOAT32_RTOL (84 float32 eps).  Under a reduced autocast dtype each
# step's activations and gradients are in addition rounded to that dtype (eps/2 relative in
# either run, so up to eps apart), and the optimiser carries that relative difference into
# the weights and from there into the measured fit: AMP_EPS_FACTOR of its eps.  A factor of
# 1, one rounding's worth: the steps' roundings are independent, so they do not add up in one
# direction, and the fit is measured in float32; a real difference in what is trained
# (another batch, a missing or doubled gradient) moves the result by far more.
FLOAT32_RTOL = rounding_tol(torch.float32, 84)  # 1.0e-5
AMP_EPS_FACTOR = 1.0


def rtol_for(dtype: torch.dtype) -> float:
    """The relative tolerance between two orderings of one training run in autocast ``dtype`` (see above)."""
    if dtype == torch.float32:
        return FLOAT32_RTOL
    return max(FLOAT32_RTOL, AMP_EPS_FACTOR * torch.finfo(dtype).eps)


@pytest.fixture(autouse=True)
def _isolated_asset_cache(tmp_path_factory, monkeypatch):
    # Tests never touch the user's asset cache.
    monkeypatch.setenv("CED_CSA2_CACHE", str(tmp_path_factory.getbasetemp() / "asset-cache"))


def tiny_params(**sections) -> Params:
    """The tiny profile's params (:func:`compose`), with whole sections replaced via ``dataclasses.replace`` kwargs."""
    import yaml

    params = from_dict(Params, yaml.safe_load(compose(TINY_OVERRIDES)))
    for name, changes in sections.items():
        params = dataclasses.replace(params, **{name: dataclasses.replace(getattr(params, name), **changes)})
    return params


@pytest.fixture(scope="session")
def tiny_model():
    """The tiny Qwen3.5 (fp32, sdpa) and its byte-level tokenizer."""
    model, tok = load_model_and_tokenizer(tiny_params().model, dtype=torch.float32)
    return model, tok


@pytest.fixture
def frozen(tiny_model):
    """``tiny_model`` with every parameter frozen, as the trainers freeze it (restored afterwards)."""
    model, tok = tiny_model
    model.requires_grad_(False)
    yield model, tok
    model.requires_grad_(True)


def tiny_llama(attn_implementation="sdpa"):
    """A seeded random-init Llama with SmolLM2's structure at tiny width (all layers attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=6,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


TINY_GEMMA3_OVERRIDES = ["model=tiny_gemma3", "data=tiny", "plan=tiny_gemma3"]


def tiny_gemma3(attn_implementation="sdpa"):
    """The tiny Gemma-3 profile's model (conf/model/tiny_gemma3.yaml) at vocabulary 300.

    8 layers, full attention at 3 and 6, the others a window of 6 positions (tests run
    longer sequences, so the window bites); theta 1e4 on sliding layers, 1e6 on full ones.
    """
    import yaml

    cfg = from_dict(Params, yaml.safe_load(compose(TINY_GEMMA3_OVERRIDES))).model.tiny
    return build_tiny_model(cfg, vocab_size=300, attn_implementation=attn_implementation)


def study_corpus(root: Path, names=("eval",), records: int = 3) -> Path:
    """``root/data/corpus/{name}.jsonl``: ``records`` identical short English records each, as the studies read them."""
    import json

    folder = root / "data" / "corpus"
    folder.mkdir(parents=True, exist_ok=True)
    text = "The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 6
    for name in names:
        folder.joinpath(f"{name}.jsonl").write_text(
            "".join(json.dumps({"id": f"r{i}", "source": "t", "text": text, "n_tokens": 1}) + "\n" for i in range(records)))
    return folder


def read_curves(path) -> tuple[str, dict[tuple[str, str], list[tuple[int, float]]]]:
    """``(x name, {(series, quantity): [(x, value), ...]})`` of a stage's curve table, checking its layout.

    Header ``<x>\\tquantity\\tseries\\tvalue``, four columns per row, the rows of one
    ``(series, quantity)`` together, with integer, strictly increasing x.
    """
    header, *rows = [line.split("\t") for line in Path(path).read_text().splitlines()]
    assert header[1:] == ["quantity", "series", "value"], (path, header)
    assert all(len(r) == 4 for r in rows), path
    curves: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for (quantity, series), group in itertools.groupby(rows, key=lambda r: (r[1], r[2])):
        assert (series, quantity) not in curves, (path, series, quantity, "rows not together")
        curves[series, quantity] = [(int(x), float(v)) for x, _, _, v in group]
        xs = [x for x, _ in curves[series, quantity]]
        assert all(b > a for a, b in itertools.pairwise(xs)), (path, series, quantity, xs)
    return header[0], curves


ROOT = Path(__file__).resolve().parents[1]


HEADLINE_BLOCK = re.compile(r"<!-- headline: metrics/summary.json -->\n(.*?)\n<!-- /headline -->", re.S)


def staged_text(root: Path, rel: str) -> tuple[str, str]:
    """``(text, where)``: the file ``rel`` as git's index holds it in ``root`` (what is committed, or what the
    next commit will hold once staged), or the workspace file outside a git checkout or before it is added.

    ``make repro`` (and a study's ``dvc repro``) rewrites the workspace file with the figures of the CPU it ran
    on; the docs state the committed figures, so that is what they are checked against -- a user's own run
    must not turn the suite red.
    """
    shown = subprocess.run(["git", "show", f":{rel}"], cwd=root, capture_output=True, text=True)
    if shown.returncode == 0:
        return shown.stdout, "git's index"
    return (root / rel).read_text(), "the workspace"


def staged_summary(root: Path) -> tuple[dict, str]:
    """``(summary, where)``: ``metrics/summary.json`` as :func:`staged_text` reads it (the README's headline
    documents the committed figures, within the tolerances README states)."""
    text, where = staged_text(root, "metrics/summary.json")
    return json.loads(text), where


def readme_headline_problem(root: Path) -> str | None:
    """Why ``root``'s README headline is not :func:`~ced_csa2.eval.results.headline_table` of its committed
    ``metrics/summary.json`` (:func:`staged_summary`), or ``None`` when it is."""
    from ced_csa2.eval.results import headline_table

    block = HEADLINE_BLOCK.search((root / "README.md").read_text())
    if not block:
        return "README has no headline block"
    summary, where = staged_summary(root)
    expected = "\n".join(headline_table(summary))
    if block.group(1) != expected:
        return f"README's headline is stale against metrics/summary.json in {where}; it should read:\n{expected}"
    return None


def project_copy(dst: Path) -> Path:
    """The project's files (tracked and untracked-not-ignored) in a new git repo: no results, so neither
    lock file (the studies' one, the largest YAML in the project, would be parsed by every DVC command
    run in the copy, and it records runs the copy does not have)."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        if (ROOT / rel).is_file() and not rel.startswith(("metrics/", "reports/", "dvc.lock", "studies/dvc.lock")):
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst / rel)
    subprocess.run(["git", "init", "-q"], cwd=dst, check=True)
    return dst


# The longest files first (measured on a 2-core AVX2 EPYC: the e2e pipeline ~9 min, the torchrun
# stages ~3, the dump's faults and kills ~2.5, the sharing study ~2, the other faults ~1.2):
# `make test` hands whole files (--dist loadfile) to its two workers in collection order
# (--no-loadscope-reorder), so a long file collected last would run alone at the end.
LONGEST_FIRST = ("test_pipeline_e2e.py", "test_distributed.py", "test_faults_dump.py", "test_sharing_study.py",
                 "test_faults.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture
def in_tiny_folder(tmp_path, monkeypatch):
    """A scratch folder holding the tiny profile's params.yaml, as the working directory (no debug, no read log)."""
    from ced_csa2.pipeline.stage_runner import DEBUG_ENV

    (tmp_path / "params.yaml").write_text(compose(TINY_OVERRIDES))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    monkeypatch.delenv("CED_CSA2_RECORD_READS", raising=False)
    return tmp_path


# The tiny profile, shortened where it only costs time: the plumbing is what is tested here.
E2E_OVERRIDES = ["model=tiny_qwen3_5", "data=tiny", "plan=qwen3_5", "train_adapters.epochs=3",
             "train_projector.epochs=2", "eval_gsm8k.max_gen_toks=12", "eval_gsm8k.groups=[baseline,csa2,ced]",
             "eval_gsm8k.generate=[baseline,csa2]",
             "train.online.records=8", "train.online.val_records=2", "train.online.seq_len=32", "mode_a.train.records=8",
             f"train.objectives=[{','.join(OBJECTIVES)}]",  # every objective the registry has
             "eval_retrieval.length=320", "eval_retrieval.records=2",
             "eval_ppl.timing_records=2",  # Mode A's timing prefills each timed record again, both arms, several rounds
             # two short greedy continuations through every cache: its 16 labels run at setup and again in the ablation
             "eval_generation.prompts=2", "eval_generation.new_tokens=8",
             # a training mix, so that every stage that can read data.mix_rows does (the read log's check)
             "data.mix=[{domain:tiny,weight:3},{domain:reports_a,weight:1}]", "data.mix_rows=4000", "dump.records=0"]


def sh(cwd, *cmd, **env_extra):
    """Run ``cmd`` in ``cwd`` as a user would (this venv's tools first, this checkout's ``src``), asserting success."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               DVC_NO_ANALYTICS="1", PYTHONPATH=str(ROOT / "src"), **env_extra)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


def nearest_on_grid(v: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Each element of 1-D ``v`` to the nearest magnitude of ``grid`` (ascending, codes 0..len-1), saturating at the
    largest; a tie goes to the even code; the sign kept (``-0.0`` too).  A brute-force reference for the
    element encoders."""
    d = (v.abs().clamp(max=float(grid[-1]))[:, None] - grid[None]).abs()
    best = d == d.min(dim=1, keepdim=True).values
    codes = torch.arange(len(grid)).expand_as(best)
    chosen = torch.where(best & (codes % 2 == 0), codes, len(grid)).min(dim=1).values
    chosen = torch.where(chosen < len(grid), chosen, torch.where(best, codes, len(grid)).min(dim=1).values)
    return torch.where(torch.signbit(v), -grid[chosen], grid[chosen])
