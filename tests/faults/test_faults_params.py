"""Every range and type check of ``load_params``, in process: every float leaf as
``.inf``/``.nan``, seeds, learning rates, devices, numbers YAML reads as strings, unknown
keys, the model's pins.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import yaml
from conftest import tiny_params
from faults_common import (
    NO_CUDA,
    TINY_YAML,
    ZEROS,
)

from ced_csa2.config import DEVICE_KEYS, ParamsError, load_params, to_dict

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
    # lists a stage needs, and too few records for a statistic: refused at load, not after the work
    ("eval_ppl.groups", [], "must list at least one group"),
    ("eval_gsm8k.groups", [], "must list at least one group"),
    ("dump.records", 1, "must be 0 (all) or at least 2 (a training and a validation record)"),
    ("eval_ppl.records", 1, "must be 0 (all) or at least 2 (intervals are bootstrapped over records)"),
]


@pytest.mark.parametrize("key,value,message", RANGE_CASES, ids=[f"{k}={v}" for k, v, _ in RANGE_CASES])
def test_out_of_range_param_is_refused(tmp_path, key, value, message):
    _refused(tmp_path, key, value, message)


def _lists(node, where=""):
    """``(dotted key, list)`` of every list under ``node``, nested ones included."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _lists(v, f"{where}.{k}" if where else str(k))
    elif isinstance(node, list):
        yield where, node
        for i, v in enumerate(node):
            yield from _lists(v, f"{where}.{i}")


LIST_KEYS = [key for key, value in _lists(tiny_raw()) if value]  # the ones the tiny profile fills


def test_every_list_param_is_listed():
    assert {"eval_ppl.groups", "eval_gsm8k.groups", "eval_gsm8k.generate", "train.objectives", "train.eval_groups",
            "plan.targets", "data.domains"} <= set(LIST_KEYS)


@pytest.mark.parametrize("key", LIST_KEYS)
def test_a_repeated_list_entry_is_refused_naming_key_and_value(tmp_path, key):
    """``eval_gsm8k.generate: [baseline, baseline]`` generated twice: every list param lists each entry once."""
    raw = tiny_raw()
    entries = dict(_lists(raw))[key]
    entries.append(entries[-1])
    n = len(entries) - 1
    _refused(tmp_path, key, entries, f"lists {entries[-1]!r} twice (entries {n - 1} and {n}): list each entry once",
             raw=raw)


def test_a_repeat_is_refused_in_a_list_the_tiny_profile_leaves_empty(tmp_path):
    _refused(tmp_path, "plan.extra_sources", [22, 23, 22], "lists 22 twice (entries 0 and 2)")


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


@pytest.mark.parametrize("key", ["seed", "ridge", "plan.source", "train.online.seq_len", "model.device_map",
                                 "data.math.wheel"])
def test_missing_key_is_named(tmp_path, key):
    # the dataclasses hold no values (conf/ is their one home): every key, a null one too, must be there
    _refused(tmp_path, key, _DROP, "is missing")


@pytest.mark.parametrize("text,message", [
    ("ridge: [\n", "not valid YAML at line 2, column 1: expected the node content"),
    ("a: b: c\n", "not valid YAML at line 1, column"),
    ("seed: 0\nseed: 1\n", "not valid YAML at line 2, column 1: found duplicate key 'seed'"),
    # beside a merge key, a key written twice is still a repeat, and so is the merge key
    ("ridge:\n  <<: {lambda: 2.0}\n  lambda: 1.0\n  lambda: 3.0\n",
     "not valid YAML at line 4, column 3: found duplicate key 'lambda'"),
    ("ridge:\n  <<: {lambda: 2.0}\n  <<: {block_rows: 64}\n",
     "not valid YAML at line 3, column 3: found duplicate key '<<'"),
    ("", "is empty"),
    ("# only a comment\n", "is empty"),
    ("- 1\n- 2\n", "'<root>' must be a mapping, got list"),
])
def test_broken_files_are_one_line_errors(tmp_path, text, message):
    with pytest.raises(ParamsError) as err:
        _load(tmp_path, text=text)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


RIDGE = "ridge:\n  lambda: 1.0\n  block_rows: 8192\n"  # sections of the tiny params.yaml
DOMAINS = ("  domains:\n  - name: reports_a\n    kind: tiny\n    'n': 4\n    files: []\n"
           "  - name: reports_b\n    kind: tiny\n    'n': 4\n    files: []\n")
MERGES = [  # (id, a section of the tiny params.yaml, the same written with YAML merge keys, keys it must load as)
    ("written-key-overrides-merged", RIDGE, "ridge:\n  <<: {lambda: 2.0}\n  lambda: 1.0\n  block_rows: 8192\n",
     {"ridge.lambda": 1.0, "ridge.block_rows": 8192}),
    ("merged-key-fills-in", RIDGE, "ridge:\n  <<: {lambda: 2.0, block_rows: 64}\n  lambda: 1.0\n",
     {"ridge.lambda": 1.0, "ridge.block_rows": 64}),
    ("first-listed-mapping-wins", RIDGE, "ridge:\n  <<: [{block_rows: 64}, {lambda: 3.0, block_rows: 32}]\n",
     {"ridge.lambda": 3.0, "ridge.block_rows": 64}),
    # an anchored mapping that overrides a merged key, merged in turn: it brings its own value, not the overridden one
    ("merge-of-a-merge", DOMAINS, "  domains:\n  - &reports\n    <<: {name: x, kind: tiny, 'n': 3, files: []}\n"
                                  "    name: reports_a\n    'n': 4\n  - <<: *reports\n    name: reports_b\n",
     {"data.domains.0.n": 4, "data.domains.1.name": "reports_b", "data.domains.1.n": 4}),
]


@pytest.mark.parametrize("section,merged,expected", [m[1:] for m in MERGES], ids=[m[0] for m in MERGES])
def test_yaml_merge_keys_load_as_dvc_reads_them(tmp_path, section, merged, expected):
    """A merge key is YAML, not a repeated key: the keys written beside it win, as DVC reads the file."""
    from dvc.utils.serialize import parse_yaml

    assert TINY_YAML.count(section) == 1
    text = TINY_YAML.replace(section, merged)
    loaded, read_by_dvc = to_dict(_load(tmp_path, text=text)), parse_yaml(text, "params.yaml")
    for key, value in expected.items():
        for tree in (loaded, read_by_dvc):
            node = tree
            for part in key.split("."):
                node = node[int(part)] if isinstance(node, list) else node[part]
            assert node == value, (key, tree is loaded)


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
