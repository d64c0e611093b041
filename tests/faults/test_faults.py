"""A real ``python -m ced_csa2.stages.<stage>`` per fault, and ``run_stage`` in process: exit
status 2, one ``error:`` line naming the file or key (no traceback), every prior output
byte-identical, no temporary file left.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import TINY_GEMMA3_OVERRIDES, TINY_OVERRIDES, compose, tiny_params
from faults_common import (
    NO_CUDA,
    ROOT,
    TINY_YAML,
    INTERRUPTED_LINE,
    ZEROS,
    edit,
    local_model,
    one_error_line,
    remove,
    run_stage_here,
    snapshot,
    stage_env,
    write,
)
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from ced_csa2 import assets
from ced_csa2.assets import AssetError
from ced_csa2.config import LocalModel, ModelConfig, Params, ParamsError, from_dict, replaced
from ced_csa2.data.dump_file import DumpError
from ced_csa2.model_utils import ModelLoadError, build_tiny_model, load_tokenizer, tiny_tokenizer
from ced_csa2.pipeline.checkpoint import CheckpointError
from ced_csa2.pipeline.paths import (
    DUMP_PATH,
    PPL_METRICS,
    RIDGE_METRICS,
    RIDGE_PATH,
    STORAGE_METRICS,
)
from ced_csa2.pipeline.stage_runner import DEBUG_ENV, error_line, run_stage
from ced_csa2.plan import PlanError
from ced_csa2.stages import check_params

# ----------------------------------------------------------------------------- stage catalogue

PRIOR = {  # stand-ins for earlier good outputs of the stages that run on a fault below
    RIDGE_PATH: b"prior ridge maps", RIDGE_METRICS: b'{"prior": true}\n', PPL_METRICS: b'{"prior": true}\n',
}

# (id, stage, fault, substrings the one error line must contain).  The params cases run
# check_params, the stage `dvc repro` runs first after any edit (its imports take 0.2 s, a
# model stage's 3 s); two of them also run storage, as every stage validates the same way.
STAGE_CASES = [
    # param ranges
    ("lambda-inf", "check_params", edit("  lambda: 1.0\n", "  lambda: .inf\n"),
     ["params.yaml", "'ridge.lambda'", "must be a finite number, got inf"]),
    ("lambda-nan", "check_params", edit("  lambda: 1.0\n", "  lambda: .nan\n"),
     ["params.yaml", "'ridge.lambda'", "must be a finite number, got nan"]),
    ("lambda-negative", "storage", edit("  lambda: 1.0\n", "  lambda: -1.0\n"),
     ["params.yaml", "'ridge.lambda'", "must be >= 0, got -1.0"]),
    ("seed-negative", "check_params", edit("\nseed: 0\n", "\nseed: -1\n"),
     ["params.yaml", "'seed'", "must be >= 0, got -1"]),
    ("lr-negative", "check_params", edit("  lr: 0.002\n", "  lr: -0.002\n"),
     ["params.yaml", "'train_projector.lr'", "must be positive, got -0.002"]),
    ("online-lr-zero", "check_params", edit("  adapters_lr: 0.0003\n    weight_decay", "  adapters_lr: 0.0\n    weight_decay"),
     ["params.yaml", "'train.online.adapters_lr'", "must be positive, got 0.0"]),
    ("momentum-one", "check_params", edit("  momentum: 0.9\n", "  momentum: 1.0\n"),
     ["params.yaml", "'train_adapters.momentum'", "must be in [0, 1), got 1.0"]),
    # devices
    ("device-gpu", "check_params", edit("  chunk_kib: 512\n  device: auto\n", "  chunk_kib: 512\n  device: gpu\n"),
     ["params.yaml", "'dump.device'", "must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'gpu'"]),
    pytest.param("device-cuda-without-cuda", "check_params", edit("  chunk_kib: 512\n  device: auto\n", "  chunk_kib: 512\n  device: cuda\n"),
                 ["params.yaml", "'dump.device' is 'cuda'", NO_CUDA],
                 marks=pytest.mark.skipif("__import__('torch').cuda.is_available()", reason="this machine has CUDA")),
    ("device-cuda-index-absent", "check_params", edit("  prefix_fraction: 0.5\n  device: auto\n", "  prefix_fraction: 0.5\n  device: cuda:64\n"),
     ["params.yaml", "'eval_ppl.device' is 'cuda:64' but"]),
    # types and numbers YAML reads as strings
    ("float-as-string-1e-3", "check_params", edit("  lr: 0.002\n", "  lr: 1e-3\n"),
     ["params.yaml", "'train_projector.lr'", "must be a number, got '1e-3'", "write 1.0e-3"]),
    ("wrong-type", "check_params", edit("  batch_size: 8\n  storage_dtype", "  batch_size: eight\n  storage_dtype"),
     ["params.yaml", "'dump.batch_size'", "must be of type int, got 'eight'"]),
    ("int-as-quoted-string", "check_params", edit("  epochs: 12\n", "  epochs: '12'\n"),
     ["params.yaml", "'train_projector.epochs'", "must be of type int, got '12'", "write 12 without quotes"]),
    # keys
    ("unknown-top-level-key", "check_params", edit("\nseed: 0\n", "\nseed: 0\nridgee:\n  lambda: 2.0\n"),
     ["params.yaml", "'ridgee'", "is not a known top-level section", "did you mean 'ridge'"]),
    ("misspelt-nested-key", "check_params", edit("  lambda: 1.0\n", "  lamda: 1.0\n"),
     ["params.yaml", "'ridge.lamda'", "is not a known parameter", "did you mean 'ridge.lambda'"]),
    ("missing-key", "storage", edit("  source: 20\n", ""), ["params.yaml", "'plan.source'", "is missing"]),
    ("missing-section", "check_params", edit("ridge:\n  lambda: 1.0\n  block_rows: 8192\n", ""),
     ["params.yaml", "'ridge'", "is missing"]),
    # the file itself
    ("params-absent", "check_params", remove("params.yaml"), ["params.yaml", "parameter file not found"]),
    ("params-empty", "check_params", write("params.yaml", ""), ["params.yaml", "is empty"]),
    ("invalid-yaml", "check_params", edit("ridge:\n", "ridge: [\n"), ["params.yaml", "not valid YAML at line"]),
    ("duplicate-key", "check_params", edit("  lambda: 1.0\n", "  lambda: 1.0\n  lambda: 100.0\n"),
     ["params.yaml", "found duplicate key 'lambda'"]),
    ("not-utf8", "check_params", write("params.yaml", b"seed: \xff\n"), ["params.yaml", "not UTF-8"]),
    # valid params, bad world: the plan, missing and corrupt artifacts
    ("plan-layer-absent", "storage", edit("  - 32\n", "  - 36\n"), ["layer 36 does not exist", "1..32"]),
    # ... the plan refused by check_params too, before `dvc repro` deletes any stage's outputs (the dump's)
    ("plan-layer-absent-at-check-params", "check_params", edit("  - 32\n", "  - 36\n"),
     ["plan target layer 36 does not exist", "1..32"]),
    ("plan-layer-without-attention-at-check-params", "check_params", edit("  - 24\n", "  - 22\n"),
     ["plan target layer 22 is not a softmax-attention layer", "attention layers are [4, 8,"]),
    ("local-model-absent", "storage", local_model("nowhere/my_model"),
     ["model.local.path nowhere/my_model does not exist"]),
    ("local-model-digest-differs", "storage", local_model("my_model", write("my_model/config.json", "{}")),
     ["my_model has digest", f"not the pinned model.local.sha256 {ZEROS}"]),
    ("dump-missing", "ridge", lambda workdir: None, [str(DUMP_PATH), "not found"]),
    ("dump-corrupt", "ridge", write(str(DUMP_PATH), b"not an HDF5 file"), [str(DUMP_PATH), "corrupt"]),
    ("checkpoint-corrupt", "eval_ppl", write("models/adapters.pt", b"garbage"),
     ["models/adapters.pt", "corrupt"]),
]
LOAD_TIME = {getattr(c, "values", c)[0] for c in STAGE_CASES} - {
    "plan-layer-absent", "dump-missing", "dump-corrupt", "checkpoint-corrupt"}


def run_module(workdir: Path, stage: str, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (DEBUG_ENV, "CED_CSA2_RECORD_READS")}
    env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1", **(extra_env or {}))
    return subprocess.run([sys.executable, "-m", f"ced_csa2.stages.{stage}"], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def good_workdir(tmp_path_factory) -> Path:
    """A folder after good ``storage`` and ``prepare`` runs on the tiny profile (the eval stages check the corpus
    first), plus stand-ins for other stages' outputs."""
    workdir = tmp_path_factory.mktemp("good")
    (workdir / "params.yaml").write_text(TINY_YAML)
    for stage in ("storage", "prepare"):
        run_stage_here(workdir, stage)
    for rel, content in PRIOR.items():
        write(str(rel), content)(workdir)
    return workdir


@pytest.mark.parametrize("case,stage,fault,expected", STAGE_CASES, ids=[
    getattr(c, "values", c)[0] for c in STAGE_CASES])
def test_stage_fault_is_one_line_exit_2_and_loses_nothing(good_workdir, tmp_path, case, stage, fault, expected):
    workdir = tmp_path / "work"
    shutil.copytree(good_workdir, workdir)
    fault(workdir)
    before = snapshot(workdir)
    assert str(STORAGE_METRICS) in before  # the prior good output under test

    done = run_module(workdir, stage)

    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert lines and lines[-1].startswith("error: "), done.stderr
    assert sum(line.startswith("error:") for line in lines) == 1, done.stderr
    if case in LOAD_TIME:  # refused before the stage did anything: the error is all there is
        assert len(lines) == 1, done.stderr
    for piece in expected:
        assert piece in lines[-1], f"{piece!r} not in {lines[-1]!r}"
    assert snapshot(workdir) == before  # prior outputs byte-identical, nothing new, no temp file


def test_debug_env_shows_the_traceback(good_workdir, tmp_path):
    workdir = tmp_path / "work"
    shutil.copytree(good_workdir, workdir)
    edit("  lambda: 1.0\n", "  lambda: .inf\n")(workdir)
    done = run_module(workdir, "storage", {DEBUG_ENV: "1"})
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "ParamsError" in done.stderr and "'ridge.lambda'" in done.stderr


PLAN_FAULTS = [  # (profile, plan changes, the refusal): each way LayerPlan.validate refuses a plan
    ("qwen3_5", {"targets": [24, 28, 36]}, r"plan target layer 36 does not exist: the model has layers 1\.\.32"),
    ("qwen3_5", {"targets": []}, r"plan has no target layers"),
    ("qwen3_5", {"targets": [20, 28, 32]}, r"plan names a layer twice: source 20, targets \[20, 28, 32\]"),
    ("qwen3_5", {"split": 20}, r"plan source layer 20 must come after split layer 20"),
    ("qwen3_5", {"source": 28, "targets": [24, 32]}, r"plan target layer 24 must come after source layer 28"),
    ("qwen3_5", {"extra_sources": [12]}, r"plan extra source layer 12 must come after split layer 16"),
    ("qwen3_5", {"targets": [22, 28, 32]}, r"plan target layer 22 is not a softmax-attention layer"),
    ("gemma3", {"source": 4, "extra_sources": [7]},
     r"plan source layer 4 is a sliding-window layer \(window 6\).* target layer 6 has full attention"),
]


@pytest.mark.parametrize("profile,changes,message", PLAN_FAULTS, ids=[
    f"{p}-" + "-".join(f"{k}={v}" for k, v in c.items()) for p, c, _ in PLAN_FAULTS])
def test_check_params_refuses_every_plan_the_model_cannot_take(tmp_path, profile, changes, message):
    """The stage `dvc repro` runs first refuses what the dump would refuse only after DVC deleted data/dump:
    the plan against the tiny model's geometry (Qwen3.5: 32 layers, softmax attention every 4th; Gemma-3:
    full attention at 3 and 6, a window of 6 elsewhere), from its config alone; nothing is written."""
    overrides = {"qwen3_5": TINY_OVERRIDES, "gemma3": TINY_GEMMA3_OVERRIDES}[profile]
    params = from_dict(Params, yaml.safe_load(compose(overrides)))
    with pytest.raises(PlanError, match=message):
        check_params.run(dataclasses.replace(params, plan=replaced(params.plan, **changes)), tmp_path)
    assert not list(tmp_path.iterdir())
    check_params.run(params, tmp_path)  # the profile's own plan passes


def test_the_good_params_still_run(good_workdir, tmp_path):
    """The catalogue's anchor file is itself valid: the same stage succeeds and rewrites its output."""
    workdir = tmp_path / "work"
    shutil.copytree(good_workdir, workdir)
    done = run_module(workdir, "storage")
    assert done.returncode == 0, done.stderr
    assert json.loads((workdir / STORAGE_METRICS).read_text()) == json.loads(
        (good_workdir / STORAGE_METRICS).read_text())


# ----------------------------------------------------------------------------- run_stage in process

def _raiser(exc):
    def run(params):
        logging.getLogger("stage").info("working")
        raise exc
    return run


@pytest.mark.parametrize("exc", [
    ParamsError("params.yaml: bad"), ValueError("bad value"), FileNotFoundError(2, "No such file", "x.pt"),
    CheckpointError("models/a.pt: corrupt"), DumpError("data/dump/dump.h5: truncated"),
    AssetError("wheel sha256 mismatch"), PlanError("layer 99"),
    OSError(28, "No space left on device", "models/ridge.pt"), OSError(27, "File too large", "data/dump.partial.h5"),
    PermissionError(13, "Permission denied", "metrics/.ppl.json.tmp7"),
    PermissionError(1, "Operation not permitted", "reports/ppl_by_group.png"),
], ids=lambda e: f"{type(e).__name__}{e.errno}" if isinstance(e, OSError) and e.errno != 2 else type(e).__name__)
def test_input_errors_exit_2_with_one_line(in_tiny_folder, capsys, exc):
    with pytest.raises(SystemExit) as end:
        run_stage(_raiser(exc))
    assert end.value.code == 2
    err = capsys.readouterr().err
    assert err == error_line(exc) + "\n" and "\n" not in error_line(exc)


def test_multi_line_message_becomes_one_line():
    assert error_line(ValueError("first\n  second\n")) == "error: first second"
    assert error_line(ValueError()) == "error: ValueError"


@pytest.mark.parametrize("exc", [RuntimeError("a bug"), KeyError("k"), TypeError("t"), OSError(9, "Bad file descriptor")],
                         ids=lambda e: type(e).__name__)
def test_unexpected_errors_keep_their_traceback(in_tiny_folder, exc):
    with pytest.raises(type(exc)):
        run_stage(_raiser(exc))


def test_debug_env_re_raises_input_errors(in_tiny_folder, monkeypatch):
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(ValueError, match="bad value"):
        run_stage(_raiser(ValueError("bad value")))


def test_ctrl_c_is_one_line_exit_130(in_tiny_folder, capsys):
    with pytest.raises(SystemExit) as end:
        run_stage(_raiser(KeyboardInterrupt()))
    assert end.value.code == 130
    assert capsys.readouterr().err == INTERRUPTED_LINE.format(stage="test_faults") + "\n"


def test_debug_env_re_raises_ctrl_c(in_tiny_folder, monkeypatch):
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(KeyboardInterrupt):
        run_stage(_raiser(KeyboardInterrupt()))


# ----------------------------------------------------------------------------- a model folder without its tokenizer

def save_tiny_model(rel: str, tokenizer=None):
    """A step: the tiny profile's model saved at ``rel`` as ``save_pretrained`` writes it, ``tokenizer`` beside it."""
    def apply(workdir: Path) -> None:
        model = build_tiny_model(tiny_params().model.tiny, len(tiny_tokenizer()))
        model.save_pretrained(workdir / rel)
        if tokenizer is not None:
            tokenizer.save_pretrained(workdir / rel)
    return apply


def pinned_local(folder: Path) -> ModelConfig:
    """The tiny profile's model section as ``kind: local`` at ``folder``, pinned to its digest."""
    return replaced(tiny_params().model, kind="local", local=LocalModel(path=str(folder), sha256=assets.digest(folder)))


def empty_vocabulary() -> PreTrainedTokenizerFast:
    """A tokenizer whose files are all there but hold no vocabulary (its end-of-text token only)."""
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab={}, merges=[])),
                                   eos_token="<|endoftext|>")


def test_a_model_folder_without_tokenizer_files_is_refused_before_the_work(tmp_path):
    """transformers loads such a folder as an empty tokenizer (every text -> no tokens): refused, naming the folder."""
    (tmp_path / "params.yaml").write_text(TINY_YAML)
    local_model("my_model", save_tiny_model("my_model"), pinned=True)(tmp_path)
    before = snapshot(tmp_path)

    line = one_error_line(run_module(tmp_path, "prepare"))

    assert line == ("error: model 'tiny_qwen3_5' (local): the folder my_model has no tokenizer (none of "
                    "tokenizer.json, tokenizer.model, vocab.json + merges.txt is there): copy the model's tokenizer "
                    "files into it and pin its new digest"), line
    assert snapshot(tmp_path) == before  # refused before the corpus was written


def test_a_tokenizer_with_an_empty_vocabulary_is_refused(tmp_path):
    save_tiny_model("empty", empty_vocabulary())(tmp_path)
    with pytest.raises(ModelLoadError) as err:
        load_tokenizer(pinned_local(tmp_path / "empty"))
    assert str(err.value) == ("model 'tiny_qwen3_5' (local): its tokenizer encodes text to no tokens (a vocabulary "
                              "of 1: its tokenizer files hold none)")


def test_a_model_folder_with_its_tokenizer_loads_it(tmp_path):
    save_tiny_model("good", tiny_tokenizer())(tmp_path)
    text = "the tokenizer saved beside the model"
    assert load_tokenizer(pinned_local(tmp_path / "good"))(text).input_ids == tiny_tokenizer()(text).input_ids


# ----------------------------------------------------------------------------- the CLIs

@pytest.mark.parametrize("args,missing", [([], "params.yaml"), (["--workdir", "elsewhere"], "elsewhere/params.yaml")],
                         ids=["here", "workdir"])
def test_estimate_without_params_yaml_says_so_in_one_line(tmp_path, args, missing):
    (tmp_path / "elsewhere").mkdir()
    done = subprocess.run([sys.executable, "-m", "ced_csa2.estimate", *args], cwd=tmp_path, env=stage_env(),
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1 and done.stdout == "", done.stderr[-3000:]
    assert done.stderr == f"error: {missing}: parameter file not found (run from the repository root)\n"
