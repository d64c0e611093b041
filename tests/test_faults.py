"""Nothing silently wrong, nothing lost: the bad-input and fault catalogue.

Three parts:

* **stage catalogue** -- a real ``python -m ced_csa2.stages.<stage>`` in a scratch folder
  per fault: exit status 2, ``error: <message>`` as the one line on stderr naming the file
  or key and what is wrong (no traceback), and every file already there (prior good
  outputs included) byte-identical afterwards, with no temporary file left behind (a
  ``kind: local`` model that is missing or differs from its pin among the faults);
* **params catalogue** -- every range and type check of ``load_params``, in process
  (every float leaf of the params as ``.inf``/``.nan``, seeds, learning rates, momentum,
  weight decay, warmup fractions, devices, numbers YAML reads as strings, unknown keys, the
  model's pins: ``kind: local`` and GGUFs joined from several wheels);
* **writes** -- strict JSON (no NaN/Infinity) and atomic writes that leave nothing behind;
* **dump integrity and I/O faults** -- bytes corrupted inside ``data/dump/dump.h5`` and
  non-finite values are refused by its consumers (ridge, train_projector, train_adapters)
  naming the file, dataset and rows; NaN, a full disk and a file-size limit while dumping
  are one line and a clean resume; any corrupted byte region is refused or harmless;
* **kills** -- ``dump`` SIGKILLed at three seeded points resumes to the uninterrupted
  datasets; ``train_projector`` killed mid-epoch leaves the complete old checkpoint and
  its rerun writes the uninterrupted bytes;
* **DVC cache** -- an in-place edit of an output is seen by ``dvc status`` and undone by
  ``dvc checkout -f`` (outputs are copies, not links into the cache);
* **asset cache** -- a bad cached wheel is fetched once more, then named with the remedy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml
from conftest import AMP_OVERRIDES, TINY_OVERRIDES, compose, project_copy, tiny_params

from ced_csa2 import assets
from ced_csa2.assets import AssetError, fetch_member
from ced_csa2.config import DEVICE_KEYS, ParamsError, WheelPin, load_params
from ced_csa2.data.h5store import BlockCrc, DumpError, DumpLayout, DumpReader, DumpWriter
from ced_csa2.pipeline import io_utils
from ced_csa2.pipeline.checkpoint import CheckpointError
from ced_csa2.pipeline.entry import DEBUG_ENV, error_line, run_stage
from ced_csa2.pipeline.io_utils import atomic_write_bytes, atomic_write_text, nonfinite_keys, write_json
from ced_csa2.pipeline.paths import (
    ADAPTERS_METRICS,
    ADAPTERS_PATH,
    DUMP_METRICS,
    DUMP_PARTIAL,
    DUMP_PATH,
    PPL_METRICS,
    PROJECTOR_CURVES,
    PROJECTOR_METRICS,
    PROJECTORS_EXTRA,
    RIDGE_METRICS,
    RIDGE_PATH,
    STORAGE_METRICS,
    projector_path,
)
from ced_csa2.plan import PlanError

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = compose(TINY_OVERRIDES)


# ----------------------------------------------------------------------------- stage catalogue

def edit(old: str, new: str):
    """A hand edit of ``params.yaml``: replace the one occurrence of ``old``."""
    def apply(workdir: Path) -> None:
        path = workdir / "params.yaml"
        text = path.read_text()
        assert text.count(old) == 1, f"anchor {old!r} must occur once in the tiny params.yaml"
        path.write_text(text.replace(old, new))
    return apply


def write(rel: str, content: bytes | str):
    def apply(workdir: Path) -> None:
        path = workdir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    return apply


def remove(rel: str):
    return lambda workdir: (workdir / rel).unlink()


def local_model(path: str, *before):
    """Hand edits of ``params.yaml``: the model becomes ``kind: local`` at ``path``, pinned to zeros."""
    steps = [*before, edit("  name: tiny_qwen3_5\n  kind: tiny\n", "  name: tiny_qwen3_5\n  kind: local\n"),
             edit("  local: null\n", f"  local:\n    path: {path}\n    sha256: '{ZEROS}'\n")]

    def apply(workdir: Path) -> None:
        for step in steps:
            step(workdir)
    return apply


PRIOR = {  # stand-ins for earlier good outputs of the stages that run on a fault below
    RIDGE_PATH: b"prior ridge maps", RIDGE_METRICS: b'{"prior": true}\n', PPL_METRICS: b'{"prior": true}\n',
}
NO_CUDA = "torch.cuda.is_available() is false"
ZEROS = "0" * 64

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
    ("local-model-absent", "storage", local_model("nowhere/my_model"),
     ["model.local.path nowhere/my_model does not exist"]),
    ("local-model-digest-differs", "storage", local_model("my_model", write("my_model/config.json", "{}")),
     ["my_model has digest", f"not the pinned model.local.sha256 {ZEROS}"]),
    ("dump-missing", "ridge", lambda workdir: None, [str(DUMP_PATH), "not found"]),
    ("dump-corrupt", "ridge", write(str(DUMP_PATH), b"not an HDF5 file"), [str(DUMP_PATH), "corrupt"]),
    ("checkpoint-corrupt", "eval_ppl", write("models/projector_k20v20.pt", b"garbage"),
     ["models/projector_k20v20.pt", "corrupt"]),
]
LOAD_TIME = {getattr(c, "values", c)[0] for c in STAGE_CASES} - {
    "plan-layer-absent", "dump-missing", "dump-corrupt", "checkpoint-corrupt"}


def run_module(workdir: Path, stage: str, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (DEBUG_ENV, "CED_CSA2_RECORD_READS")}
    env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1", **(extra_env or {}))
    return subprocess.run([sys.executable, "-m", f"ced_csa2.stages.{stage}"], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def snapshot(workdir: Path) -> dict[str, str]:
    """``{path: sha256}`` of every file under ``workdir`` but ``params.yaml`` (new files show too)."""
    return {p.relative_to(workdir).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(workdir.rglob("*")) if p.is_file() and p.name != "params.yaml"}


@pytest.fixture(scope="module")
def good_workdir(tmp_path_factory) -> Path:
    """A folder after a good ``storage`` run on the tiny profile, plus stand-ins for other stages' outputs."""
    workdir = tmp_path_factory.mktemp("good")
    (workdir / "params.yaml").write_text(TINY_YAML)
    done = run_module(workdir, "storage")
    assert done.returncode == 0, done.stderr
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


def test_the_good_params_still_run(good_workdir, tmp_path):
    """The catalogue's anchor file is itself valid: the same stage succeeds and rewrites its output."""
    workdir = tmp_path / "work"
    shutil.copytree(good_workdir, workdir)
    done = run_module(workdir, "storage")
    assert done.returncode == 0, done.stderr
    assert json.loads((workdir / STORAGE_METRICS).read_text()) == json.loads(
        (good_workdir / STORAGE_METRICS).read_text())


# ----------------------------------------------------------------------------- run_stage in process

@pytest.fixture
def in_tiny_folder(tmp_path, monkeypatch):
    (tmp_path / "params.yaml").write_text(TINY_YAML)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    monkeypatch.delenv("CED_CSA2_RECORD_READS", raising=False)
    return tmp_path


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
], ids=lambda e: f"OSError{e.errno}" if type(e) is OSError else type(e).__name__)
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


# ----------------------------------------------------------------------------- params catalogue

def tiny_raw() -> dict:
    return yaml.safe_load(TINY_YAML)


def _leaves(node, where=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{where}.{k}" if where else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, f"{where}.{i}")
    else:
        yield where, node


FLOAT_KEYS = [key for key, value in _leaves(tiny_raw()) if isinstance(value, float)]


def _set(raw: dict, key: str, value) -> dict:
    *parents, last = key.split(".")
    node = raw
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if value is _DROP:
        del node[last]
    else:
        node[last] = value
    return raw


_DROP = object()


def _load(tmp_path, raw=None, text=None):
    path = tmp_path / "params.yaml"
    path.write_text(text if text is not None else yaml.safe_dump(raw, sort_keys=False))
    return load_params(path)


def _refused(tmp_path, key, value, message, raw=None):
    with pytest.raises(ParamsError) as err:
        _load(tmp_path, _set(raw or tiny_raw(), key, value))
    text = str(err.value)
    assert text.startswith(str(tmp_path / "params.yaml") + ": ") and f"'{key}'" in text and message in text, text
    assert "\n" not in text


def test_every_float_param_is_listed():
    assert {"ridge.lambda", "split.val_fraction", "train_projector.lr", "train_adapters.momentum",
            "train.online.projector_lr", "eval_ppl.prefix_fraction"} <= set(FLOAT_KEYS)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_every_float_param_must_be_finite(tmp_path, key, value):
    _refused(tmp_path, key, value, "must be a finite number")


def test_non_finite_refused_when_built_in_code_too():
    with pytest.raises(ParamsError, match="'ridge.lambda' must be a finite number"):
        tiny_params(ridge={"lam": math.inf})
    with pytest.raises(ParamsError, match="'seed' must be >= 0"):
        dataclasses.replace(tiny_params(), seed=-1)


RANGE_CASES = [
    ("seed", -1, "must be >= 0"),
    ("data.seed", -1, "must be >= 0"),
    ("model.tiny.seed", -3, "must be >= 0"),
    ("model.tiny.hidden_size", 0, "must be positive"),
    ("train_projector.lr", 0.0, "must be positive"),
    ("train_projector.lr", -1.0e-3, "must be positive"),
    ("train_adapters.base_lr", 0.0, "must be positive"),
    ("train_adapters.refine_lr", -0.003, "must be positive"),
    ("train.online.projector_lr", -1.0e-5, "must be positive"),
    ("train.online.adapters_lr", 0.0, "must be positive"),
    ("train_adapters.momentum", 1.0, "must be in [0, 1)"),
    ("train_adapters.momentum", -0.1, "must be in [0, 1)"),
    ("train_projector.weight_decay", -0.01, "must be >= 0"),
    ("train.online.weight_decay", -1.0, "must be >= 0"),
    ("train_projector.warmup_fraction", 1.0, "must be in [0, 1)"),
    ("train_projector.warmup_fraction", -0.02, "must be in [0, 1)"),
    ("train.online.warmup_fraction", 1.5, "must be in [0, 1)"),
    ("train.online.temperature", 0.0, "must be positive"),
    ("train_projector.epochs", 0, "must be positive"),
    ("train_adapters.batch_size", -1, "must be positive"),
    ("ridge.lambda", -1.0, "must be >= 0"),
    ("ridge.block_rows", 0, "must be positive"),
    ("data.n_train", -1, "must be >= 0"),
    ("dump.batch_size", 0, "must be positive"),
    ("train_projector.init", "zeros", "must be one of ('random', 'ridge')"),
    ("train_adapters.input", "k", "must be one of ('kv', 'own')"),
    ("eval_gsm8k.fewshot_as_multiturn", True, "needs eval_gsm8k.apply_chat_template: true and num_fewshot > 0"),
]


@pytest.mark.parametrize("key,value,message", RANGE_CASES, ids=[f"{k}={v}" for k, v, _ in RANGE_CASES])
def test_out_of_range_param_is_refused(tmp_path, key, value, message):
    _refused(tmp_path, key, value, message)


@pytest.mark.parametrize("value", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda:-1", "mps", "cpu:0", ""])
@pytest.mark.parametrize("key", DEVICE_KEYS)
def test_device_must_be_a_known_form(tmp_path, key, value):
    _refused(tmp_path, key, value, f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {value!r}")


@pytest.mark.parametrize("value", ["cuda", "cuda:0"])
@pytest.mark.parametrize("key", DEVICE_KEYS)
def test_cuda_without_cuda_is_refused_at_load(tmp_path, monkeypatch, key, value):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _refused(tmp_path, key, value, f"is {value!r} but {NO_CUDA} on this machine")


def test_cuda_index_must_exist(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert _load(tmp_path, _set(tiny_raw(), "dump.device", "cuda:0")).dump.device == "cuda:0"
    _refused(tmp_path, "dump.device", "cuda:1", "but this machine has 1 CUDA device(s) (cuda:0 .. cuda:0)")


def test_auto_and_cpu_devices_load(tmp_path):
    for value in ("auto", "cpu"):
        assert _load(tmp_path, _set(tiny_raw(), "eval_gsm8k.device", value)).eval_gsm8k.device == value


NUMBER_STRINGS = [  # (line of the tiny params.yaml [+ context], value as typed by hand, key, hint)
    ("  lr: 0.002\n", "1e-3", "train_projector.lr", "write 1.0e-3"),
    ("  base_lr: 0.0003\n", "1E-3", "train_adapters.base_lr", "write 1.0e-3"),
    ("  adapters_lr: 0.0003\n    weight_decay", "3e-4", "train.online.adapters_lr", "write 3.0e-4"),
    ("  lambda: 1.0\n", "1.0e3", "ridge.lambda", "write 1.0e+3"),
    ("  lambda: 1.0\n", "1e+2", "ridge.lambda", "write 1.0e+2"),
    ("  momentum: 0.9\n", "'0.5'", "train_adapters.momentum", "write 0.5 without quotes"),
    ("  chunk_kib: 512\n", "'256'", "dump.chunk_kib", "write 256 without quotes"),
]


@pytest.mark.parametrize("line,typed,key,hint", NUMBER_STRINGS, ids=[t for _, t, _, _ in NUMBER_STRINGS])
def test_number_yaml_reads_as_a_string_is_refused_with_a_hint(tmp_path, line, typed, key, hint):
    assert TINY_YAML.count(line) == 1
    head, _, after = line.partition("\n")  # the key's line, then context that makes it unique
    name = head.split(":")[0]
    with pytest.raises(ParamsError) as err:
        _load(tmp_path, text=TINY_YAML.replace(line, f"{name}: {typed}\n{after}"))
    assert f"'{key}' must be " in str(err.value) and hint in str(err.value), str(err.value)
    fixed = hint.removeprefix("write ").removesuffix(" without quotes")
    assert isinstance(yaml.safe_load(f"x: {fixed}")["x"], (int, float))  # the hint is right: it loads
    assert _load(tmp_path, text=TINY_YAML.replace(line, f"{name}: {fixed}\n{after}")) is not None


def test_a_real_string_gets_no_number_hint(tmp_path):
    with pytest.raises(ParamsError) as err:
        _load(tmp_path, _set(tiny_raw(), "ridge.lambda", "big"))
    assert "must be a number, got 'big'" in str(err.value) and "write" not in str(err.value)


@pytest.mark.parametrize("key,message", [
    ("ridgee", "is not a known top-level section of params; did you mean 'ridge'?"),
    ("zzz", "is not a known top-level section of params; known: seed, kv_format, model"),
    ("ridge.lamda", "is not a known parameter of RidgeConfig; did you mean 'ridge.lambda'?"),
    ("train.online.lr", "is not a known parameter of OnlineConfig"),
])
def test_unknown_keys_are_named(tmp_path, key, message):
    _refused(tmp_path, key, 1, message)


def test_non_string_top_level_key_is_named(tmp_path):
    with pytest.raises(ParamsError, match=r"params key '1' is not a known top-level section"):
        _load(tmp_path, text=TINY_YAML + "1: x\n")


@pytest.mark.parametrize("key", ["seed", "ridge", "plan.source", "train.online.seq_len"])
def test_missing_key_is_named(tmp_path, key):
    default_ok = key == "train.online.seq_len"  # has a default: absent is fine
    if default_ok:
        assert _load(tmp_path, _set(tiny_raw(), key, _DROP)).train.online.seq_len == 256
    else:
        _refused(tmp_path, key, _DROP, "is missing")


@pytest.mark.parametrize("text,message", [
    ("ridge: [\n", "not valid YAML at line 2, column 1: expected the node content"),
    ("a: b: c\n", "not valid YAML at line 1, column"),
    ("seed: 0\nseed: 1\n", "not valid YAML at line 2, column 1: found duplicate key 'seed'"),
    ("", "is empty"),
    ("# only a comment\n", "is empty"),
    ("- 1\n- 2\n", "'<root>' must be a mapping, got list"),
])
def test_broken_files_are_one_line_errors(tmp_path, text, message):
    with pytest.raises(ParamsError) as err:
        _load(tmp_path, text=text)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


PART = {"package": "chunk-part1", "version": "1.0", "member": "chunk_part1/m.gguf.part00", "sha256": ZEROS,
        "python_version": None}
MODEL_CASES = [  # (id, changes to the tiny profile's model section, key, message)
    ("local-without-pin", {"kind": "local"}, "model.local", "is required for kind 'local'"),
    ("local-path-empty", {"kind": "local", "local": {"path": "", "sha256": ZEROS}}, "model.local.path",
     "must name a Hugging Face folder or a .gguf file"),
    ("local-sha256-short", {"kind": "local", "local": {"path": "m", "sha256": "abc"}}, "model.local.sha256",
     "must be 64 hex digits"),
    ("local-sha256-uppercase", {"kind": "local", "local": {"path": "m", "sha256": "A" * 64}}, "model.local.sha256",
     "must be 64 hex digits (lowercase"),
    ("local-misspelt-key", {"kind": "local", "local": {"path": "m", "sha": ZEROS}}, "model.local.sha",
     "is not a known parameter of LocalModel; did you mean 'model.local.sha256'?"),
    ("gguf-wheel-without-pin", {"kind": "gguf_wheel"}, "model.wheel",
     "or model.joined (exactly one of them) is required for kind 'gguf_wheel'"),
    ("gguf-wheel-and-joined", {"kind": "gguf_wheel", "wheel": PART,
                               "joined": {"name": "m.gguf", "sha256": ZEROS, "parts": [PART]}},
     "model.wheel", "or model.joined (exactly one of them)"),
    ("joined-without-parts", {"kind": "gguf_wheel", "joined": {"name": "m.gguf", "sha256": ZEROS, "parts": []}},
     "model.joined.parts", "must list the parts in order"),
    ("joined-name-a-path", {"kind": "gguf_wheel", "joined": {"name": "../m.gguf", "sha256": ZEROS, "parts": [PART]}},
     "model.joined.name", "must be a plain file name"),
    ("joined-part-sha256", {"kind": "gguf_wheel", "joined": {"name": "m.gguf", "sha256": ZEROS,
                                                             "parts": [{**PART, "sha256": "g" * 64}]}},
     "sha256", "must be 64 hex digits"),
]


@pytest.mark.parametrize("changes,key,message", [c[1:] for c in MODEL_CASES], ids=[c[0] for c in MODEL_CASES])
def test_model_pins_are_refused(tmp_path, changes, key, message):
    raw = tiny_raw()
    raw["model"].update(changes)
    with pytest.raises(ParamsError) as err:
        _load(tmp_path, raw)
    assert f"'{key}' " in str(err.value) and message in str(err.value), str(err.value)


# ----------------------------------------------------------------------------- strict JSON

def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name) if folder.exists() else []


@pytest.mark.parametrize("bad,where", [
    (math.nan, "'ppl.ced' = nan"), (math.inf, "'ppl.ced' = inf"), (-math.inf, "'ppl.ced' = -inf")])
def test_write_json_refuses_non_finite_naming_file_and_key(tmp_path, bad, where):
    path = tmp_path / "metrics" / "ppl.json"
    with pytest.raises(ValueError) as err:
        write_json(path, {"ppl": {"baseline": 20.9, "ced": bad}})
    assert str(path) in str(err.value) and where in str(err.value)
    assert not path.exists() and _leftovers(path.parent) == []


def test_write_json_refusal_keeps_the_prior_file(tmp_path):
    path = tmp_path / "ridge.json"
    write_json(path, {"k": {"r2": 0.61}})
    prior = path.read_bytes()
    with pytest.raises(ValueError, match=r"'k.r2' = nan, 'layers.1.cos' = inf"):
        write_json(path, {"k": {"r2": math.nan}, "layers": [{"cos": 1.0}, {"cos": math.inf}]})
    assert path.read_bytes() == prior and _leftovers(tmp_path) == []


def test_write_json_never_writes_bare_nan_tokens(tmp_path):
    path = tmp_path / "m.json"
    write_json(path, {"a": [1.0, 2], "b": {"c": None, "d": "NaN"}})  # a string "NaN" is fine
    text = path.read_text()
    assert json.loads(text) == {"a": [1.0, 2], "b": {"c": None, "d": "NaN"}} and text.endswith("}\n")
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c}")) is not None


def test_nonfinite_keys_walks_nested_containers():
    assert [k for k, _ in nonfinite_keys({"a": [1.0, {"b": math.nan}], "c": (math.inf,)})] == ["a.1.b", "c.0"]
    assert nonfinite_keys(math.nan)[0][0] == "<root>" and nonfinite_keys({"x": 1, "y": "nan"}) == []


def test_write_json_unencodable_object_names_the_file_and_writes_nothing(tmp_path):
    path = tmp_path / "m.json"
    path.write_text('{"prior": true}\n')
    with pytest.raises(TypeError, match=rf"{path}: Object of type object is not JSON serializable"):
        write_json(path, {"x": object()})
    assert path.read_text() == '{"prior": true}\n' and _leftovers(tmp_path) == []


# ----------------------------------------------------------------------------- atomic writes

@pytest.fixture
def prior_file(tmp_path):
    path = tmp_path / "out" / "model.pt"
    atomic_write_bytes(path, b"prior good bytes")
    assert path.read_bytes() == b"prior good bytes" and _leftovers(path.parent) == []
    return path


@pytest.mark.parametrize("where,exc", [
    ("replace", KeyboardInterrupt()), ("replace", OSError(28, "No space left on device")),
    ("fsync", OSError(28, "No space left on device")), ("fsync", KeyboardInterrupt()),
], ids=["ctrl-c-at-rename", "enospc-at-rename", "enospc-at-fsync", "ctrl-c-at-fsync"])
def test_failed_atomic_write_leaves_no_temp_and_the_destination_unchanged(prior_file, monkeypatch, where, exc):
    def fail(*args, **kwargs):
        assert _leftovers(prior_file.parent), "the temp file exists while writing"
        raise exc

    monkeypatch.setattr(io_utils.os, where, fail)
    with pytest.raises(type(exc)):
        atomic_write_bytes(prior_file, b"new bytes that must not land")
    monkeypatch.undo()
    assert prior_file.read_bytes() == b"prior good bytes"
    assert _leftovers(prior_file.parent) == []


def test_write_onto_a_directory_leaves_no_temp(tmp_path):
    (tmp_path / "metrics.json").mkdir()
    with pytest.raises(OSError):
        atomic_write_text(tmp_path / "metrics.json", "{}\n")
    assert (tmp_path / "metrics.json").is_dir() and _leftovers(tmp_path) == []


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_write_into_read_only_folder_fails_cleanly(prior_file):
    folder = prior_file.parent
    folder.chmod(0o555)
    try:
        with pytest.raises(PermissionError):
            atomic_write_bytes(prior_file, b"new")
        assert prior_file.read_bytes() == b"prior good bytes" and _leftovers(folder) == []
    finally:
        folder.chmod(0o755)


def test_successful_atomic_write_replaces_and_cleans_up(prior_file):
    atomic_write_bytes(prior_file, b"new")
    assert prior_file.read_bytes() == b"new" and _leftovers(prior_file.parent) == []


def test_a_killed_writers_temp_file_is_removed_by_the_next_write(prior_file):
    """SIGKILL cannot be caught: the temp file of a killed writer goes at the next write of that file."""
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)  # a process that has exited
    stale = prior_file.with_name(f".{prior_file.name}.tmp{dead}")
    busy = prior_file.with_name(f".{prior_file.name}.tmp{os.getppid()}")  # a live writer: not ours to remove
    stale.write_bytes(b"half a checkpoint")
    busy.write_bytes(b"being written")
    atomic_write_bytes(prior_file, b"new")
    assert prior_file.read_bytes() == b"new" and not stale.exists() and busy.read_bytes() == b"being written"


# ----------------------------------------------------------------------------- dump integrity and I/O faults

DUMP, PARTIAL = str(DUMP_PATH), str(DUMP_PARTIAL)
DUMP_PRIOR = {  # stand-ins for the trainers' earlier good outputs
    projector_path(20): b"prior projector", PROJECTORS_EXTRA: b"prior extra projectors",
    ADAPTERS_PATH: b"prior adapters", PROJECTOR_METRICS: b'{"prior": true}\n', ADAPTERS_METRICS: b'{"prior": true}\n',
}


def stage_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (DEBUG_ENV, "CED_CSA2_RECORD_READS")}
    env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    return env


def run_stage_process(workdir: Path, stage: str, prelude: str = "") -> subprocess.CompletedProcess:
    """``python -m ced_csa2.stages.<stage>``, or with ``prelude`` (a fault injected) run before its ``main()``."""
    cmd = [sys.executable, "-m", f"ced_csa2.stages.{stage}"] if not prelude else [
        sys.executable, "-c", f"{prelude}\nimport ced_csa2.stages.{stage} as stage_module\nstage_module.main()\n"]
    return subprocess.run(cmd, cwd=workdir, env=stage_env(), capture_output=True, text=True, timeout=600,
                          check=False)


def one_error_line(done: subprocess.CompletedProcess) -> str:
    """The stage ended with exit status 2 and exactly one ``error:`` line, last, no traceback or crash noise."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, f"exit {done.returncode}:\n{done.stderr[-3000:]}"
    for noise in ("Traceback", "Exception ignored", "Segmentation fault"):
        assert noise not in done.stderr, done.stderr[-3000:]
    assert lines and lines[-1].startswith("error: "), done.stderr[-3000:]
    assert sum(line.startswith("error:") for line in lines) == 1, done.stderr[-3000:]
    return lines[-1]


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def dump_contents(path: Path) -> dict:
    """Every dataset (dtype, shape, sha256 of its bytes) and every attribute of a dump file."""
    def plain(v):
        return np.asarray(v).tolist() if not isinstance(v, (str, bytes)) else v

    with h5py.File(path, "r") as f:
        out = {f"@{k}": plain(v) for k, v in f.attrs.items()}
        for name, ds in f.items():
            data = ds[()]
            out[name] = (str(ds.dtype), ds.shape, hashlib.sha256(data.tobytes()).hexdigest())
            out.update({f"{name}@{k}": plain(v) for k, v in ds.attrs.items()})
    return out


@pytest.fixture(scope="module")
def dumped_workdir(tmp_path_factory) -> Path:
    """A folder after good ``prepare``, ``dump`` and ``ridge`` runs (tiny profile), plus trainer stand-ins."""
    workdir = tmp_path_factory.mktemp("dumped")
    (workdir / "params.yaml").write_text(TINY_YAML)
    for stage in ("prepare", "dump", "ridge"):
        done = run_stage_process(workdir, stage)
        assert done.returncode == 0, done.stderr[-3000:]
    for rel, content in DUMP_PRIOR.items():
        write(str(rel), content)(workdir)
    with h5py.File(workdir / DUMP_PATH, "r") as f:  # the geometry the cases below rely on
        assert f.attrs["checksum_rows"] == 4096 and f["h_split"].chunks[0] == 2048 and f["k_24"].shape == (4601, 32)
    return workdir


def flip_bytes(name: str, chunk: int, at: int = 1000, n: int = 64):
    """Invert ``n`` bytes at offset ``at`` inside chunk ``chunk`` of dataset ``name``, in place."""
    def apply(workdir: Path) -> None:
        path = workdir / DUMP_PATH
        with h5py.File(path, "r") as f:
            offset = f[name].id.get_chunk_info(chunk).byte_offset + at
        with open(path, "r+b") as fh:
            fh.seek(offset)
            data = fh.read(n)
            fh.seek(offset)
            fh.write(bytes(b ^ 0xFF for b in data))
    return apply


def nan_with_valid_checksum(name: str, row: int):
    """A NaN written into the dump with its block's checksum recomputed: only the finiteness check can see it."""
    def apply(workdir: Path) -> None:
        with h5py.File(workdir / DUMP_PATH, "r+") as f:
            ds, block = f[name], int(f.attrs["checksum_rows"])
            data = ds[row:row + 1]
            data[0, 3] = np.nan
            ds[row:row + 1] = data
            covered, crcs = BlockCrc.decode(ds.attrs["checksums"])
            j = row // block
            crcs = crcs.copy()
            crcs[j] = zlib.crc32(np.ascontiguousarray(ds[j * block:min((j + 1) * block, covered)]))
            ds.attrs["checksums"] = np.array([covered, *crcs], dtype=np.uint64)
    return apply


def h5_edit(fn):
    def apply(workdir: Path) -> None:
        with h5py.File(workdir / DUMP_PATH, "r+") as f:
            fn(f)
    return apply


def truncate_to(rel: str, fraction: float):
    def apply(workdir: Path) -> None:
        path = workdir / rel
        path.write_bytes(path.read_bytes()[:int(path.stat().st_size * fraction)])
    return apply


def nothing(workdir: Path) -> None:
    pass


def fsize_limit(nbytes: int) -> str:
    """A file-size limit (RLIMIT_FSIZE): a write past it fails with EFBIG, as a full disk fails with ENOSPC."""
    return f"import resource\nresource.setrlimit(resource.RLIMIT_FSIZE, ({nbytes}, {nbytes}))"


# h5py writes 9 datasets + input_ids + record_offsets per append: fail from the 2nd write of the 4th append on.
ENOSPC_PRELUDE = f"""
import errno, h5py
_setitem, _calls = h5py.Dataset.__setitem__, [0]
def _full_disk(self, key, value):
    _calls[0] += 1
    if _calls[0] >= {3 * 11 + 2}:
        raise OSError(errno.ENOSPC, "No space left on device")
    return _setitem(self, key, value)
h5py.Dataset.__setitem__ = _full_disk
"""
NAN_PRELUDE = """
import numpy as np
import ced_csa2.data.dumping as _dump
_forward, _calls = _dump.forward_batch, [0]
def _forward_nan(*args, **kwargs):
    out = _forward(*args, **kwargs)
    _calls[0] += 1
    if _calls[0] == 2:  # the second batch of 8 records: row 5 of record 8
        out["k_24"][5, 3] = np.nan
    return out
_dump.forward_batch = _forward_nan
"""


def row_of_record_8(workdir: Path) -> str:
    with h5py.File(workdir / DUMP_PATH, "r") as f:
        row = int(f["record_offsets"][8]) + 5
    return f"rows [{row}, {row + 1})"


# (id, stage, fault applied to a copy of dumped_workdir, prelude run before the stage, pieces of the one error line)
DUMP_CASES = [
    # bytes corrupted inside the dump: each consumer names the file, the dataset and the rows
    ("k24-bytes-flipped", "ridge", flip_bytes("k_24", 0), "",
     [DUMP, "dataset 'k_24' rows [0, 4096) fail their crc32 checksum", "dvc checkout -f"]),
    ("h_split-bytes-flipped", "train_projector", flip_bytes("h_split", 2), "",
     [DUMP, "dataset 'h_split' rows [4096, 4601) fail their crc32 checksum"]),
    ("v28-bytes-flipped", "train_adapters", flip_bytes("v_28", 0), "",
     [DUMP, "dataset 'v_28' rows [0, 4096) fail their crc32 checksum"]),
    ("input-ids-flipped", "ridge", flip_bytes("input_ids", 0), "",
     [DUMP, "dataset 'input_ids' rows [0, 4096) fail their crc32 checksum"]),
    ("record-offsets-flipped", "train_projector", flip_bytes("record_offsets", 0, at=8, n=16), "",
     [DUMP, "dataset 'record_offsets' rows [0, 49) fail their crc32 checksum"]),
    ("nan-with-valid-checksum", "ridge", nan_with_valid_checksum("v_28", 123), "",
     [DUMP, "dataset 'v_28' holds non-finite values (NaN/Inf) at rows [123, 124)"]),
    ("checksums-stripped", "train_adapters", h5_edit(lambda f: f["k_20"].attrs.__delitem__("checksums")), "",
     [DUMP, "dataset 'k_20' has no readable 'checksums' attribute"]),
    ("format-1-dump", "ridge", h5_edit(lambda f: f.attrs.__setitem__("format_version", 1)), "",
     [DUMP, "format_version 1, expected 2"]),
    ("dump-truncated", "ridge", truncate_to(DUMP, 0.5), "", [DUMP, "not a readable HDF5 file"]),
    # faults while writing: one line, prior outputs kept, and a clean resume
    ("nan-at-dump-time", "dump", nothing, NAN_PRELUDE,
     [DUMP, "refusing to write non-finite values (NaN/Inf) to dataset 'k_24'", row_of_record_8, "(records 8..8)",
      f"the partial dump {PARTIAL} was removed"]),
    ("enospc-in-dump", "dump", nothing, ENOSPC_PRELUDE,
     [DUMP, f"writing {PARTIAL} failed: [Errno 28] No space left on device", "keeps 24 complete records"]),
    ("fsize-limit-in-dump", "dump", nothing, fsize_limit(6_000_000),
     [DUMP, f"writing {PARTIAL} failed: [Errno 27] File too large"]),
    ("fsize-limit-at-checkpoint", "ridge", nothing, fsize_limit(4096),
     ["[Errno 27] File too large", f"'{RIDGE_PATH}'"]),
]


@pytest.mark.parametrize("case,stage,fault,prelude,expected", DUMP_CASES, ids=[c[0] for c in DUMP_CASES])
def test_dump_fault_is_one_line_exit_2_and_loses_nothing(dumped_workdir, tmp_path, case, stage, fault, prelude,
                                                        expected):
    workdir = tmp_path / "work"
    shutil.copytree(dumped_workdir, workdir)
    fault(workdir)
    before = snapshot(workdir)

    line = one_error_line(run_stage_process(workdir, stage, prelude))

    for piece in expected:
        piece = piece(dumped_workdir) if callable(piece) else piece
        assert piece in line, f"{piece!r} not in {line!r}"
    after = snapshot(workdir)
    kept = after.pop(PARTIAL, None)  # a partial dump that still opens is kept for the resume
    assert after == before  # prior outputs byte-identical, nothing new, no temp file
    assert (kept is not None) == ("keeps" in line), line
    if stage == "dump":  # the next run (fault gone) resumes or starts over and ends with the same datasets
        again = run_stage_process(workdir, "dump")
        assert again.returncode == 0, again.stderr[-3000:]
        assert ("resuming" in again.stderr) == (kept is not None), again.stderr[-3000:]
        assert dump_contents(workdir / DUMP_PATH) == dump_contents(dumped_workdir / DUMP_PATH)
        assert not (workdir / DUMP_PARTIAL).exists()


FUZZ = r"""
import sys, shutil, numpy as np
from ced_csa2.data.h5store import DumpError, DumpReader
good_path, offsets = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
def contents(path):
    with DumpReader(path) as r:
        r.verify()
        return {name: r.rows(name, 0, r.n_tokens).tobytes() for name in r.layout.widths()} | {
            "input_ids": r.f["input_ids"][:].tobytes(), "record_offsets": r.record_offsets.tobytes()}
good = contents(good_path)
for offset in offsets:
    shutil.copy(good_path, "fuzz.h5")
    with open("fuzz.h5", "r+b") as f:
        f.seek(offset); data = f.read(16); f.seek(offset); f.write(bytes(b ^ 0x5A for b in data))
    try:
        print(offset, "same" if contents("fuzz.h5") == good else "DIFFERENT", flush=True)
    except DumpError as exc:
        print(offset, "refused", str(exc).split(":")[1][:60], flush=True)
    except Exception as exc:
        print(offset, "OTHER", type(exc).__name__, str(exc)[:200], flush=True)
"""


def test_any_corrupted_byte_region_is_refused_or_harmless(dumped_workdir, tmp_path):
    """16 bytes inverted anywhere (metadata every 256 B of the first 4 KiB, then 48 seeded offsets): the reader
    refuses the file with a DumpError or reads exactly the good data (unused chunk space) -- never other data,
    never another exception, never a crash (a subprocess, so a segfault would show as its exit status)."""
    size = (dumped_workdir / DUMP_PATH).stat().st_size
    offsets = [*range(0, 4096, 256), *sorted(np.random.default_rng(16).integers(4096, size - 16, 48).tolist())]
    done = subprocess.run([sys.executable, "-c", FUZZ, str(dumped_workdir / DUMP_PATH), ",".join(map(str, offsets))],
                          cwd=tmp_path, env=stage_env(), capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = [line.split(" ", 2) for line in done.stdout.splitlines()]
    assert len(outcomes) == len(offsets), done.stdout
    assert all(o[1] in ("refused", "same") for o in outcomes), done.stdout
    assert sum(o[1] == "refused" for o in outcomes) >= len(offsets) // 2, done.stdout  # most bytes matter


# ----------------------------------------------------------------------------- the dump writer, in process

LAYOUT = DumpLayout(hidden_size=8, kv_dim=4, kv_layers=(1,))


def batches(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        lengths = [int(x) for x in rng.integers(5, 40, 3)]
        rows = sum(lengths)
        arrays = {"h_split": rng.standard_normal((rows, 8), dtype=np.float32),
                  "k_1": rng.standard_normal((rows, 4), dtype=np.float32),
                  "v_1": rng.standard_normal((rows, 4), dtype=np.float32)}
        yield arrays, rng.integers(0, 100, rows).astype(np.int32), lengths


def writer(tmp_path: Path, name: str, storage_dtype: str = "float32") -> DumpWriter:
    layout = dataclasses.replace(LAYOUT, storage_dtype=storage_dtype)
    return DumpWriter(tmp_path / name / "dump.h5", tmp_path / name / "dump.partial.h5", layout, chunk_kib=1,
                      attrs={"fingerprint": "f"})


@pytest.fixture
def reference_dump(tmp_path) -> dict:
    w = writer(tmp_path, "ref")
    for batch in batches(8):
        w.append(*batch)
    return dump_contents(w.finalize())


def test_resume_after_a_kill_between_checksums_and_record_count(tmp_path, reference_dump):
    """The checksums of a batch are written before ``n_records``: a kill in between leaves them covering rows
    that the resume drops; the block those rows fall in is recomputed and the end result is the same file."""
    w = writer(tmp_path, "run")
    assert w.block == 64  # 64 rows: several batches per block, so the partial block is exercised
    for batch in list(batches(8))[:5]:
        w.append(*batch)
    w.f.attrs["n_records"] = 12  # as if killed after the 5th batch's checksums, before its record count
    w.close()
    w = writer(tmp_path, "run")
    assert w.n_records == 12
    for batch in list(batches(8))[4:]:
        w.append(*batch)
    assert dump_contents(w.finalize()) == reference_dump


def test_a_partial_dump_that_fails_its_checksums_is_started_over(tmp_path, reference_dump, caplog):
    w = writer(tmp_path, "run")
    for batch in list(batches(8))[:5]:
        w.append(*batch)
    w.f["h_split"][3, 0] += 1.0  # bytes changed on disk behind the writer's back
    w.close()
    caplog.set_level("WARNING")
    w = writer(tmp_path, "run")
    assert w.n_records == 0 and "fails its checksums" in caplog.text and "'h_split' rows [0, 64)" in caplog.text
    for batch in batches(8):
        w.append(*batch)
    assert dump_contents(w.finalize()) == reference_dump


@pytest.mark.parametrize("storage_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_rows_are_refused_before_anything_is_written(tmp_path, storage_dtype, bad):
    w = writer(tmp_path, "run", storage_dtype)
    first, second = list(batches(2))
    to_disk = {"float32": lambda a: a, "float16": lambda a: a.astype(np.float16),
               "bfloat16": lambda a: (a.view(np.uint32) >> 16).astype(np.uint16)}[storage_dtype]
    w.append({k: to_disk(v) for k, v in first[0].items()}, *first[1:])
    arrays = {k: v.copy() for k, v in second[0].items()}
    arrays["v_1"][7, 2] = bad
    start, record = sum(first[2]), 3 + int(np.searchsorted(np.cumsum(second[2]), 7, side="right"))
    with pytest.raises(DumpError) as err:
        w.append({k: to_disk(v) for k, v in arrays.items()}, *second[1:])
    assert (f"refusing to write non-finite values (NaN/Inf) to dataset 'v_1' at rows [{start + 7}, {start + 8}) "
            f"(records {record}..{record})") in str(err.value), str(err.value)
    assert not w.partial_path.exists() and w.f is None  # nothing written, nothing left


def test_reader_verifies_each_block_once_and_names_the_rows(tmp_path):
    w = writer(tmp_path, "run")
    for batch in batches(8):
        w.append(*batch)
    path = w.finalize()
    with DumpReader(path) as r:
        assert r.checksum_rows == r.block_rows == 64 and not r._verified["k_1"].any()
        r.rows("k_1", 70, 75)  # an unaligned read verifies the whole block it falls in
        assert r._verified["k_1"].tolist()[:2] == [False, True]
        r.verify()
        assert all(v.all() for v in r._verified.values())
    with h5py.File(path, "r+") as f:
        f["v_1"][65, 0] = 1.0e3  # changed without updating the checksum
    with DumpReader(path) as r:
        r.rows("v_1", 0, 64)  # the first block is intact
        with pytest.raises(DumpError, match=r"dataset 'v_1' rows \[64, 128\) fail their crc32 checksum"):
            r.rows("v_1", 64, 128)
    with DumpReader(path, verify=False) as r:  # the benchmarks' switch: corrupt bytes get through
        assert r.rows("v_1", 65, 66)[0, 0] == 1.0e3


# ----------------------------------------------------------------------------- kills

def start_stage(workdir: Path, stage: str, log: Path) -> subprocess.Popen:
    with open(log, "w") as err:
        return subprocess.Popen([sys.executable, "-m", f"ced_csa2.stages.{stage}"], cwd=workdir, env=stage_env(),
                                stdout=subprocess.DEVNULL, stderr=err)


def wait_until(proc: subprocess.Popen, log: Path, seen, what: str, timeout: float = 900):
    """Poll ``log`` (the stderr of the running ``proc``) until ``seen(text)`` is truthy; return that value.

    Kill points are states the test observes in the log, not times: however loaded the
    machine, the process is where the test means it to be when the signal goes out.  The
    timeout only catches a hang, so it is generous: a loaded machine is slow, not wrong.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = seen(log.read_text(errors="replace"))
        if found:
            return found
        assert proc.poll() is None, f"ended (exit {proc.returncode}) before {what}:\n{log.read_text()[-3000:]}"
        time.sleep(0.002)
    raise AssertionError(f"{what} did not happen in {timeout} s")


def wait_for(proc: subprocess.Popen, log: Path, pattern: str, timeout: float = 900) -> re.Match:
    """Wait until ``pattern`` appears in ``log``; its first match."""
    return wait_until(proc, log, lambda text: re.search(pattern, text), f"{pattern!r} appeared", timeout)


COMMITTED = re.compile(r"(\S+): (\d+) of (\d+) records committed")  # the dump's line after each batch


def committed(text: str) -> dict[str, tuple[int, int]]:
    """``{partial file: (records committed, records of that file)}``: the latest dump line per file (per rank)."""
    return {m.group(1): (int(m.group(2)), int(m.group(3))) for m in COMMITTED.finditer(text)}


def test_dump_killed_at_three_seeded_points_resumes_to_the_same_datasets(dumped_workdir, tmp_path):
    one_record_batches = edit("  batch_size: 8\n  storage_dtype", "  batch_size: 1\n  storage_dtype")
    ref, work = tmp_path / "ref", tmp_path / "work"
    for folder in (ref, work):
        shutil.copytree(dumped_workdir / "data" / "corpus", folder / "data" / "corpus")
        shutil.copy(dumped_workdir / "params.yaml", folder / "params.yaml")
        one_record_batches(folder)
    done = run_stage_process(ref, "dump")  # uninterrupted
    assert done.returncode == 0, done.stderr[-3000:]

    rng, resumed_from = np.random.default_rng(16), []
    for kill in range(3):
        log = tmp_path / f"run{kill}.log"
        proc = start_stage(work, "dump", log)
        todo, done_before = map(int, wait_for(proc, log, r"dumping (\d+) records \((\d+) already done\)").groups())
        resumed_from.append(done_before)
        # A seeded point inside the writing loop: this run has committed that many more records.
        kill_at = done_before + max(1, round(rng.uniform(0.1, 0.7) * todo))
        wait_until(proc, log, lambda text: any(n >= kill_at for n, _ in committed(text).values()),
                   f"record {kill_at} committed")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL, f"run {kill} finished before its kill point"
        assert not (work / DUMP_PATH).exists()
    done = run_stage_process(work, "dump")
    assert done.returncode == 0, done.stderr[-3000:]
    resumed_from.append(json.loads((work / DUMP_METRICS).read_text())["resumed_from_record"])

    print(f"dump runs started from record {resumed_from} (48 records)")
    assert any(n > 0 for n in resumed_from), f"no run resumed real progress: {resumed_from}"
    assert dump_contents(work / DUMP_PATH) == dump_contents(ref / DUMP_PATH), resumed_from
    assert sorted(p.relative_to(work).as_posix() for p in (work / "data").rglob("*") if p.is_file()) == [
        "data/corpus/eval.jsonl", "data/corpus/train.jsonl", "data/dump/dump.h5"]


def test_train_projector_killed_mid_epoch_keeps_the_old_checkpoint_then_writes_the_same_bytes(dumped_workdir,
                                                                                               tmp_path):
    anchor = "  epochs: 12\n  batch_size: 256\n"  # train_projector
    base, ref, work = tmp_path / "base", tmp_path / "ref", tmp_path / "work"
    shutil.copytree(dumped_workdir, base)
    edit(anchor, "  epochs: 1\n  batch_size: 256\n")(base)
    assert run_stage_process(base, "train_projector").returncode == 0  # the old, complete output
    (base / "params.yaml").write_text(TINY_YAML)
    edit(anchor, "  epochs: 3\n  batch_size: 4\n")(base)
    shutil.copytree(base, ref)
    shutil.copytree(base, work)
    ckpt = projector_path(20)
    done = run_stage_process(ref, "train_projector")  # uninterrupted
    assert done.returncode == 0, done.stderr[-3000:]
    old, new = sha(base / ckpt), sha(ref / ckpt)
    assert old != new

    seen, stop = set(), threading.Event()

    def watch():  # what a reader of the output sees at every point
        while not stop.is_set():
            try:
                seen.add(sha(work / ckpt))
            except FileNotFoundError:
                seen.add(None)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        log = tmp_path / "killed.log"
        proc = start_stage(work, "train_projector", log)
        wait_for(proc, log, r"train_projector epoch 1/3")
        # A seeded step inside epoch 2, as the trainer's progress bar (steps of all 3 epochs) counts it.
        total = int(wait_for(proc, log, r"\d+/(\d+) \[").group(1))
        per_epoch = total // 3
        kill_at = per_epoch + max(1, round(np.random.default_rng(16).uniform(0.2, 0.7) * per_epoch))
        wait_until(proc, log, lambda text: any(int(n) >= kill_at for n in re.findall(r"(\d+)/\d+ \[", text)),
                   f"step {kill_at} of {total}")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
        assert "epoch 2/3" not in log.read_text(), "killed after epoch 2, not in it"
        assert sha(work / ckpt) == old and seen == {old}
        rerun = run_stage_process(work, "train_projector")
        assert rerun.returncode == 0, rerun.stderr[-3000:]
    finally:
        stop.set()
        watcher.join()
    assert seen <= {old, new} and new in seen  # complete old or complete new, never anything else
    for rel in (ckpt, PROJECTORS_EXTRA, *(p.relative_to(ref) for p in (ref / PROJECTOR_CURVES).iterdir())):
        assert (work / rel).read_bytes() == (ref / rel).read_bytes(), rel
    assert not [p for p in work.rglob("*") if ".tmp" in p.name]


# ----------------------------------------------------------------------------- DVC cache

def sh(cwd: Path, *cmd: str) -> str:
    env = dict(stage_env(), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               DVC_NO_ANALYTICS="1")
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow
def test_dvc_cache_survives_in_place_edits_of_outputs(tmp_path):
    """Outputs are copies (``cache.type = reflink,copy``), not hard links into ``.dvc/cache``: patching the dump
    and truncating a checkpoint in place leave the cache intact, ``dvc status`` reports both and
    ``dvc checkout -f`` restores the good bytes."""
    repo = project_copy(tmp_path / "repo")
    sh(repo, sys.executable, "-m", "ced_csa2.compose", *TINY_OVERRIDES, *AMP_OVERRIDES)
    sh(repo, "dvc", "repro", "ridge")  # prepare, dump, ridge
    outs = [DUMP_PATH, RIDGE_PATH]
    good = {rel: sha(repo / rel) for rel in outs}
    for rel in outs:  # a copy of the cached file, not the cached file itself
        assert not (repo / rel).is_symlink() and (repo / rel).stat().st_nlink == 1, rel

    flip_bytes("k_24", 0)(repo)  # in place, same size
    line = one_error_line(run_stage_process(repo, "ridge"))  # the consumer refuses the patched dump
    assert f"{DUMP_PATH}: dataset 'k_24' rows [0, 4096) fail their crc32 checksum" in line
    with open(repo / RIDGE_PATH, "r+b") as f:
        f.truncate(100)
    status = json.loads(sh(repo, "dvc", "status", "--json", "--with-deps", "ridge"))  # ridge and its upstream
    assert {"changed outs": {"data/dump": "modified"}} in status["dump"], status
    assert {"changed outs": {str(RIDGE_PATH): "modified"}} in status["ridge"], status

    sh(repo, "dvc", "checkout", "-f", "ridge", "dump")
    assert {rel: sha(repo / rel) for rel in outs} == good
    assert json.loads(sh(repo, "dvc", "status", "--json", "--with-deps", "ridge")) == {}
    with DumpReader(repo / DUMP_PATH) as reader:
        reader.verify()


# ----------------------------------------------------------------------------- asset cache

ASSET_MEMBER = "demo_pkg/data/blob.bin"
ASSET_BLOB = b"pinned payload\n" * 200
ASSET_WHEEL = "demo_pkg-1.0-py3-none-any.whl"


def wheel_bytes(member: bytes | None = ASSET_BLOB, *, stored: bool = False) -> bytes:
    """A real minimal wheel of demo-pkg 1.0 (zip), holding ``member`` at ASSET_MEMBER unless ``None``."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("demo_pkg/__init__.py", "")
        if member is not None:
            zf.writestr(ASSET_MEMBER, member)
        zf.writestr("demo_pkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: demo-pkg\nVersion: 1.0\n")
        zf.writestr("demo_pkg-1.0.dist-info/WHEEL",
                    "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("demo_pkg-1.0.dist-info/RECORD", "")
    return buf.getvalue()


def _crc_broken() -> bytes:
    data = bytearray(wheel_bytes(stored=True))
    data[data.index(ASSET_BLOB[:64]) + 100] ^= 0xFF  # the member's bytes, not its CRC
    return bytes(data)


GOOD_WHEEL = wheel_bytes()
BAD_WHEELS = {
    "truncated": GOOD_WHEEL[:len(GOOD_WHEEL) // 2],
    "not-a-zip": b"<html>503 Service Unavailable</html>\n",
    "member-sha256-wrong": wheel_bytes(b"a re-published payload\n"),
    "member-crc-broken": _crc_broken(),
    "member-missing": wheel_bytes(None),
}
UNRELATED_WHEELS = {  # other packages, versions and names that are not wheel names: never read, never touched
    "junk.whl": b"not a wheel", "other_pkg-2.0-py3-none-any.whl": GOOD_WHEEL,
    "demo_pkg-9.9-py3-none-any.whl": b"corrupt", "demo_pkg.whl": b"x", "demo_pkg-1.0.whl": b"y",
}
STILL_BAD = ["{wheel}", "was downloaded again and is still bad: delete it and retry with network access to PyPI"]
# (id, wheel already in the cache or None, what each fetch delivers (None: the fetch fails), error pieces or None)
ASSET_CASES = [
    *[(f"cached-{kind}-refetched", bad, [GOOD_WHEEL], None) for kind, bad in BAD_WHEELS.items()],
    *[(f"cached-{kind}-still-bad", bad, [bad], STILL_BAD) for kind, bad in BAD_WHEELS.items()],
    ("cached-bad-fetch-fails", BAD_WHEELS["truncated"], [None],
     ["Could not download the wheel of demo-pkg==1.0", "The cached wheel {wheel} was bad and has been deleted",
      "Check the network"]),
    ("downloaded-bad-then-good", None, [BAD_WHEELS["member-crc-broken"], GOOD_WHEEL], None),
    ("no-cached-wheel", None, [GOOD_WHEEL], None),
]


class FakePip:
    """Stands in for ``pip download``: each call delivers the next wheel into ``-d`` (no network)."""

    def __init__(self, deliveries):
        self.deliveries, self.calls = list(deliveries), 0

    def __call__(self, cmd):
        self.calls += 1
        data = self.deliveries.pop(0)
        if data is None:
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for demo-pkg==1.0")
        (Path(cmd[cmd.index("-d") + 1]) / ASSET_WHEEL).write_bytes(data)
        return subprocess.CompletedProcess(cmd, 0, "Saved", "")


@pytest.mark.parametrize("case,cached,deliveries,expected", ASSET_CASES, ids=[c[0] for c in ASSET_CASES])
def test_bad_cached_wheel_is_fetched_once_more_then_named(in_tiny_folder, tmp_path, monkeypatch, capsys, case,
                                                          cached, deliveries, expected):
    cache = tmp_path / "cache"
    monkeypatch.setenv("CED_CSA2_CACHE", str(cache))
    wheels, target = cache / "wheels", cache / "files" / "demo-pkg-1.0" / ASSET_MEMBER
    wheels.mkdir(parents=True)
    for name, data in UNRELATED_WHEELS.items():
        (wheels / name).write_bytes(data)
    if cached is not None:
        (wheels / ASSET_WHEEL).write_bytes(cached)
    before = {name: sha(wheels / name) for name in UNRELATED_WHEELS}
    pip = FakePip(deliveries)
    monkeypatch.setattr(assets, "_run_pip", pip)
    pin = WheelPin(package="demo-pkg", version="1.0", member=ASSET_MEMBER,
                   sha256=hashlib.sha256(ASSET_BLOB).hexdigest())

    if expected is None:
        got = []
        run_stage(lambda params: got.append(fetch_member(pin)))
        assert got == [target] and target.read_bytes() == ASSET_BLOB
        assert (wheels / ASSET_WHEEL).read_bytes() == GOOD_WHEEL
    else:
        with pytest.raises(SystemExit) as end:
            run_stage(lambda params: fetch_member(pin))
        assert end.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: "), err
        for piece in expected:
            assert piece.format(wheel=wheels / ASSET_WHEEL) in err, (piece, err)
        assert not target.exists()
    assert pip.calls == len(deliveries) and not pip.deliveries  # one more fetch at most, no loop
    assert {name: sha(wheels / name) for name in UNRELATED_WHEELS} == before
    assert not [p for p in cache.rglob("*") if ".tmp" in p.name]
