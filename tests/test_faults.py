"""Nothing silently wrong, nothing lost: the bad-input and fault catalogue (issue 16).

Three parts:

* **stage catalogue** -- a real ``python -m ced_csa2.stages.<stage>`` in a scratch folder
  per fault: exit status 2, ``error: <message>`` as the one line on stderr naming the file
  or key and what is wrong (no traceback), and every file already there (prior good
  outputs included) byte-identical afterwards, with no temporary file left behind;
* **params catalogue** -- every range and type check of ``load_params``, in process
  (every float leaf of the params as ``.inf``/``.nan``, seeds, learning rates, momentum,
  weight decay, warmup fractions, devices, numbers YAML reads as strings, unknown keys);
* **writes** -- strict JSON (no NaN/Infinity) and atomic writes that leave nothing behind.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import TINY_OVERRIDES, tiny_params

from ced_csa2 import io_utils
from ced_csa2.assets import AssetError
from ced_csa2.checkpoint import CheckpointError
from ced_csa2.compose import compose
from ced_csa2.config import DEVICE_KEYS, ParamsError, load_params
from ced_csa2.entry import DEBUG_ENV, error_line, run_stage
from ced_csa2.h5store import DumpError
from ced_csa2.io_utils import atomic_write_bytes, atomic_write_text, nonfinite_keys, write_json
from ced_csa2.paths import DUMP_PATH, PPL_METRICS, RIDGE_METRICS, RIDGE_PATH, STORAGE_METRICS
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


PRIOR = {  # stand-ins for earlier good outputs of the stages that run on a fault below
    RIDGE_PATH: b"prior ridge maps", RIDGE_METRICS: b'{"prior": true}\n', PPL_METRICS: b'{"prior": true}\n',
}
NO_CUDA = "torch.cuda.is_available() is false"

# (id, stage, fault, substrings the one error line must contain)
STAGE_CASES = [
    # param ranges
    ("lambda-inf", "storage", edit("  lambda: 1.0\n", "  lambda: .inf\n"),
     ["params.yaml", "'ridge.lambda'", "must be a finite number, got inf"]),
    ("lambda-nan", "storage", edit("  lambda: 1.0\n", "  lambda: .nan\n"),
     ["params.yaml", "'ridge.lambda'", "must be a finite number, got nan"]),
    ("lambda-negative", "storage", edit("  lambda: 1.0\n", "  lambda: -1.0\n"),
     ["params.yaml", "'ridge.lambda'", "must be >= 0, got -1.0"]),
    ("seed-negative", "storage", edit("\nseed: 0\n", "\nseed: -1\n"),
     ["params.yaml", "'seed'", "must be >= 0, got -1"]),
    ("lr-negative", "storage", edit("  lr: 0.002\n", "  lr: -0.002\n"),
     ["params.yaml", "'train_projector.lr'", "must be positive, got -0.002"]),
    ("online-lr-zero", "storage", edit("  adapters_lr: 0.0001\n", "  adapters_lr: 0.0\n"),
     ["params.yaml", "'train.online.adapters_lr'", "must be positive, got 0.0"]),
    ("momentum-one", "storage", edit("  momentum: 0.9\n", "  momentum: 1.0\n"),
     ["params.yaml", "'train_adapters.momentum'", "must be in [0, 1), got 1.0"]),
    # devices
    ("device-gpu", "storage", edit("  device: auto\nsplit:", "  device: gpu\nsplit:"),
     ["params.yaml", "'dump.device'", "must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'gpu'"]),
    pytest.param("device-cuda-without-cuda", "storage", edit("  device: auto\nsplit:", "  device: cuda\nsplit:"),
                 ["params.yaml", "'dump.device' is 'cuda'", NO_CUDA],
                 marks=pytest.mark.skipif("__import__('torch').cuda.is_available()", reason="this machine has CUDA")),
    ("device-cuda-index-absent", "storage", edit("  device: auto\neval_gsm8k:", "  device: cuda:64\neval_gsm8k:"),
     ["params.yaml", "'eval_ppl.device' is 'cuda:64' but"]),
    # types and numbers YAML reads as strings
    ("float-as-string-1e-3", "storage", edit("  lr: 0.002\n", "  lr: 1e-3\n"),
     ["params.yaml", "'train_projector.lr'", "must be a number, got '1e-3'", "write 1.0e-3"]),
    ("wrong-type", "storage", edit("  batch_size: 8\n  storage_dtype", "  batch_size: eight\n  storage_dtype"),
     ["params.yaml", "'dump.batch_size'", "must be of type int, got 'eight'"]),
    ("int-as-quoted-string", "storage", edit("  epochs: 12\n", "  epochs: '12'\n"),
     ["params.yaml", "'train_projector.epochs'", "must be of type int, got '12'", "write 12 without quotes"]),
    # keys
    ("unknown-top-level-key", "storage", edit("\nseed: 0\n", "\nseed: 0\nridgee:\n  lambda: 2.0\n"),
     ["params.yaml", "'ridgee'", "is not a known top-level section", "did you mean 'ridge'"]),
    ("misspelt-nested-key", "storage", edit("  lambda: 1.0\n", "  lamda: 1.0\n"),
     ["params.yaml", "'ridge.lamda'", "is not a known parameter", "did you mean 'ridge.lambda'"]),
    ("missing-key", "storage", edit("  source: 20\n", ""), ["params.yaml", "'plan.source'", "is missing"]),
    ("missing-section", "storage", edit("ridge:\n  lambda: 1.0\n  block_rows: 8192\n", ""),
     ["params.yaml", "'ridge'", "is missing"]),
    # the file itself
    ("params-absent", "storage", remove("params.yaml"), ["params.yaml", "parameter file not found"]),
    ("params-empty", "storage", write("params.yaml", ""), ["params.yaml", "is empty"]),
    ("invalid-yaml", "storage", edit("ridge:\n", "ridge: [\n"), ["params.yaml", "not valid YAML at line"]),
    ("duplicate-key", "storage", edit("  lambda: 1.0\n", "  lambda: 1.0\n  lambda: 100.0\n"),
     ["params.yaml", "found duplicate key 'lambda'"]),
    ("not-utf8", "storage", write("params.yaml", b"seed: \xff\n"), ["params.yaml", "not UTF-8"]),
    # valid params, bad world: the plan, missing and corrupt artifacts
    ("plan-layer-absent", "storage", edit("  - 32\n", "  - 36\n"), ["layer 36 does not exist", "1..32"]),
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
], ids=lambda e: type(e).__name__)
def test_input_errors_exit_2_with_one_line(in_tiny_folder, capsys, exc):
    with pytest.raises(SystemExit) as end:
        run_stage(_raiser(exc))
    assert end.value.code == 2
    err = capsys.readouterr().err
    assert err == error_line(exc) + "\n" and "\n" not in error_line(exc)


def test_multi_line_message_becomes_one_line():
    assert error_line(ValueError("first\n  second\n")) == "error: first second"
    assert error_line(ValueError()) == "error: ValueError"


@pytest.mark.parametrize("exc", [RuntimeError("a bug"), KeyError("k"), TypeError("t")], ids=lambda e: type(e).__name__)
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


NUMBER_STRINGS = [  # (line of the tiny params.yaml, value as typed by hand, key, hint)
    ("  lr: 0.002\n", "1e-3", "train_projector.lr", "write 1.0e-3"),
    ("  base_lr: 0.0003\n", "1E-3", "train_adapters.base_lr", "write 1.0e-3"),
    ("  adapters_lr: 0.0001\n", "3e-4", "train.online.adapters_lr", "write 3.0e-4"),
    ("  lambda: 1.0\n", "1.0e3", "ridge.lambda", "write 1.0e+3"),
    ("  lambda: 1.0\n", "1e+2", "ridge.lambda", "write 1.0e+2"),
    ("  momentum: 0.9\n", "'0.5'", "train_adapters.momentum", "write 0.5 without quotes"),
    ("  chunk_kib: 512\n", "'256'", "dump.chunk_kib", "write 256 without quotes"),
]


@pytest.mark.parametrize("line,typed,key,hint", NUMBER_STRINGS, ids=[t for _, t, _, _ in NUMBER_STRINGS])
def test_number_yaml_reads_as_a_string_is_refused_with_a_hint(tmp_path, line, typed, key, hint):
    assert TINY_YAML.count(line) == 1
    name = line.split(":")[0]
    with pytest.raises(ParamsError) as err:
        _load(tmp_path, text=TINY_YAML.replace(line, f"{name}: {typed}\n"))
    assert f"'{key}' must be " in str(err.value) and hint in str(err.value), str(err.value)
    fixed = hint.removeprefix("write ").removesuffix(" without quotes")
    assert isinstance(yaml.safe_load(f"x: {fixed}")["x"], (int, float))  # the hint is right: it loads
    assert _load(tmp_path, text=TINY_YAML.replace(line, f"{name}: {fixed}\n")) is not None


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
