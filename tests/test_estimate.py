"""The resource estimate: its dump bytes are the real dump's, exactly; the full profile's needs no network."""

import dataclasses
import json
import re
from pathlib import Path

import h5py
import pytest
import yaml
from conftest import ROOT, TINY_OVERRIDES, compose, tiny_params

from ced_csa2 import estimate
from ced_csa2.config import Params, from_dict, load_params, to_dict
from ced_csa2.data.dump_file import DumpReader
from ced_csa2.pipeline import paths
from ced_csa2.stages import dump, prepare

FULL = ["model=qwen3_5_4b", "data=wikitext", "plan=qwen3_5", "budget=recipe"]


def file_bytes(path) -> tuple[int, int, int]:
    """``(rows, Σ nbytes, Σ allocated storage)`` of a dump file's datasets."""
    with h5py.File(path, "r") as f:
        return (f["input_ids"].shape[0], sum(f[n].nbytes for n in f), sum(f[n].id.get_storage_size() for n in f))


@pytest.mark.parametrize("storage_dtype,records", [("float32", 0), ("bfloat16", 20)])
def test_dump_bytes_equal_a_real_tiny_dump(tmp_path, storage_dtype, records):
    # 64 KiB chunks: several per dataset, the last one partly filled (allocated > payload)
    params = tiny_params(dump={"storage_dtype": storage_dtype, "records": records, "chunk_kib": 64})
    prepare.run(params, tmp_path)
    dump.run(params, tmp_path)
    s = estimate.setup(params, "cpu", tmp_path)
    assert s.dump.exact and "exact" in s.dump.source
    layout = estimate.dump_layout(s)
    rows, nbytes, stored = file_bytes(tmp_path / paths.DUMP_PATH)
    assert s.dump.total == rows and len(s.dump.tokens) == (records or params.data.n_train)
    assert layout.nbytes(rows, len(s.dump.tokens), params.dump.chunk_kib) == (nbytes, stored)
    assert estimate.est_dump(s).disk == stored > nbytes


def test_workspace_dump_of_the_embedded_default():
    """The committed profile's own dump, when this workspace has one (geometry from the file, rows from the corpus)."""
    params = load_params(ROOT / "params.yaml")
    path = ROOT / paths.DUMP_PATH
    if not (path.is_file() and estimate.prepared_for(params, ROOT)):
        pytest.skip("no data/dump/dump.h5 of the committed params in this workspace (run `dvc repro dump`)")
    lengths = estimate.dump_lengths(params, ROOT)
    with DumpReader(path, verify=False) as reader:
        made = (reader.n_records, json.loads(reader.attrs["plan"]), reader.layout.storage_dtype)
        if made != (len(lengths.tokens), to_dict(params.plan), params.dump.storage_dtype):
            pytest.skip(f"data/dump/dump.h5 holds another sample, plan or dtype: {made}")
        layout = reader.layout
    rows, nbytes, stored = file_bytes(path)
    assert lengths.exact and lengths.total == rows
    assert layout.nbytes(lengths.total, len(lengths.tokens), params.dump.chunk_kib) == (nbytes, stored)


def test_without_a_corpus_rows_are_an_upper_bound(tmp_path):
    params = tiny_params(dump={"records": 20})
    lengths = estimate.dump_lengths(params, tmp_path)
    assert not lengths.exact and "upper bound" in lengths.source
    assert lengths.total == 20 * params.data.max_tokens
    embedded = load_params(ROOT / "params.yaml")  # how many records the Wikipedia sample yields: only prepare knows
    everything = dataclasses.replace(embedded, dump=dataclasses.replace(embedded.dump, records=0))
    with pytest.raises(ValueError, match=r"known only after `dvc repro prepare`"):
        estimate.dump_lengths(everything, tmp_path)


def test_a_mix_s_rows_are_exact_before_and_after_prepare_and_another_mix_s_corpus_is_not_used(tmp_path):
    from ced_csa2.config import MixEntry

    mixed = tiny_params(dump={"records": 0})
    mixed = dataclasses.replace(mixed, data=dataclasses.replace(
        mixed.data, mix=[MixEntry("tiny", 1.0), MixEntry("reports_a", 1.0)], mix_rows=1234))
    assert estimate.dump_lengths(mixed, tmp_path).total == 1234  # before prepare: the mix fixes the rows
    prepare.run(tiny_params(), tmp_path)  # the tiny corpus without a mix: not the mix's
    assert not estimate.prepared_for(mixed, tmp_path)
    prepare.run(mixed, tmp_path)
    lengths = estimate.dump_lengths(mixed, tmp_path)
    assert estimate.prepared_for(mixed, tmp_path) and lengths.exact and lengths.total == 1234


def test_a_corpus_prepared_for_another_profile_is_not_used(tmp_path):
    prepare.run(tiny_params(), tmp_path)  # the tiny corpus; estimated here: the full profile
    params = from_dict(Params, yaml.safe_load(compose(FULL)))
    assert not estimate.prepared_for(params, tmp_path)
    assert estimate.dump_lengths(params, tmp_path).total == 2400 * 512


def test_full_profile_offline_and_the_gpu_guide_shows_its_output(tmp_path, capsys):
    """Qwen3.5-4B from the built-in config (no download); docs/gpu.md prints what the command prints."""
    params = from_dict(Params, yaml.safe_load(compose(FULL)))
    s = estimate.setup(params, "cuda", tmp_path)
    assert s.model.params == 4_205_751_296 and s.model.geo.kv_dim == 1024
    layout = estimate.dump_layout(s)
    assert sum(layout.widths().values()) * 4 == 43_008  # fp32 bytes per token: H_16 + K/V of 20, 24, 28, 32
    bf16 = dataclasses.replace(params, dump=dataclasses.replace(params.dump, storage_dtype="bfloat16"))
    assert estimate.est_dump(estimate.setup(bf16, "cuda", tmp_path)).disk * 2 == pytest.approx(
        # float64 byte estimates: bf16 halves every dumped byte; the rest is integer metadata (<1e-4)
        estimate.est_dump(s).disk, rel=1e-4)
    stages = {e.stage: e for e in estimate.estimate(s)}
    train_rows = int(s.dump.tokens[s.split[0]].sum())  # 2,280 of 2,400 records, 512 tokens each at most
    # the main projector and the seed-literal reference (random init, last epoch), each 12 epochs at batch 256
    assert stages["train_projector"].steps == 2 * 12 * -(-train_rows // 256)
    assert stages["train_adapters"].steps == 120 * 9  # 2,280 train records x 256 pairs in batches of 65,536

    command = "python -m ced_csa2.estimate " + " ".join(FULL) + " --device cuda"
    guide = (ROOT / "docs" / "gpu.md").read_text()
    shown = re.search(rf"\$ {re.escape(command)}\n(.*?)\n```", guide, re.DOTALL)
    assert shown, f"docs/gpu.md shows no `$ {command}` block"
    estimate.main([*FULL, "--device", "cuda", "--workdir", str(tmp_path)])
    assert capsys.readouterr().out.rstrip("\n") == shown.group(1)


def test_rates_scale_to_this_cpu_s_probe_cached_per_cpu_flags_cores_and_threads(tmp_path):
    import os

    import torch

    key = estimate.cpu_key()
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.is_file() else set()
    assert key["flags"] == [f for f in estimate.PROBE_FLAGS if f in flags]
    assert (key["cores"], key["torch_threads"]) == (os.cpu_count(), torch.get_num_threads())
    fitted, cache = estimate.RATES["cpu"], tmp_path / "cpu_probe.json"
    # this CPU's cached probe at half the fitted CPU's: its compute rates halve (exactly: a power of two), disk's stay
    cache.write_text(json.dumps({json.dumps(key, sort_keys=True): {
        "flops": estimate.PROBE_REFERENCE_FLOPS / 2, "when": "2026-12-06 08:00", "load": None}}))
    rates = estimate.calibrated_rates(cache=cache)
    assert (rates.model_flops, rates.map_flops, rates.f64_flops, rates.logits) == (
        fitted.model_flops / 2, fitted.map_flops / 2, fitted.f64_flops / 2, fitted.logits / 2)
    assert rates.decode_step_s == 2 * fitted.decode_step_s and rates.read_bytes == fitted.read_bytes
    assert rates.basis.startswith("calibrated here: 0.50x") and "2026-12-06 08:00" in rates.basis
    # another machine's entry (one core more) is not this one's: probed afresh, kept only from a quiet machine
    other = json.dumps({**key, "cores": key["cores"] + 1}, sort_keys=True)
    cache.write_text(json.dumps({other: {"flops": 1.0, "when": "then", "load": None}}))
    rates = estimate.calibrated_rates(cache=cache)
    saved = json.loads(cache.read_text())
    assert saved[other]["flops"] == 1.0 and rates.model_flops != fitted.model_flops / estimate.PROBE_REFERENCE_FLOPS
    assert (json.dumps(key, sort_keys=True) in saved) == ("not cached" not in rates.basis)


@pytest.mark.parametrize("argv,message", [
    (["plan.targets=[99]"], "plan target layer 99 does not exist"),
    (["-S", "ridge.lamda=3"], "'ridge.lamda=3']: Could not override 'ridge.lamda'"),  # as `dvc exp run -S` takes it
    (["--workdir", "{tmp}"], "{tmp}/params.yaml: params key 'ridge_lambda' is not a"),
])
def test_cli_answers_a_bad_param_in_one_line(tmp_path, argv, message):
    text = (ROOT / "params.yaml").read_text()
    (tmp_path / "params.yaml").write_text(text + "ridge_lambda: 10.0\n")  # meant: ridge.lambda
    tiny = [] if "--workdir" in argv else TINY_OVERRIDES
    with pytest.raises(SystemExit) as exc:
        estimate.main([*tiny, *(a.format(tmp=tmp_path) for a in argv)])
    text = str(exc.value)
    assert text.startswith("error: ") and message.format(tmp=tmp_path) in text and "\n" not in text


def test_an_asset_cache_that_is_a_file_is_one_line(tmp_path, monkeypatch):
    """``CED_CSA2_CACHE`` naming a file (ENOTDIR when the probe's cache is written): a stage's one line, not a
    traceback."""
    cache = tmp_path / "afile"
    cache.write_text("")
    monkeypatch.setenv("CED_CSA2_CACHE", str(cache))
    with pytest.raises(SystemExit) as exc:
        estimate.main(TINY_OVERRIDES)
    text = str(exc.value)
    assert text.startswith(f"error: CED_CSA2_CACHE={cache}: ") and "is a file, not a folder" in text and "\n" not in text


# Two stages as dvc.yaml's read params.yaml: `a` one key, `b` another and `a`'s output.
DVC_YAML = """stages:
  a:
    cmd: echo a > a.txt
    params: [ridge.lambda]
    outs: [a.txt]
  b:
    cmd: cat a.txt > b.txt
    deps: [a.txt]
    params: [kv_format]
    outs: [b.txt]
"""
PARAMS = "ridge:\n  lambda: 1.0\nkv_format: nvfp4\n"


def test_changed_previews_a_composition_without_writing_params_yaml(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys

    def sh(*args):
        done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True,
                              env=dict(os.environ, DVC_NO_ANALYTICS="1"))
        assert done.returncode == 0, done.stderr

    dvc = str(Path(sys.executable).parent / "dvc")
    monkeypatch.chdir(tmp_path)  # DVC names stages relative to where it runs, as the command line runs
    sh("git", "init", "-q")
    sh(dvc, "init", "-q")
    (tmp_path / "dvc.yaml").write_text(DVC_YAML)
    params = tmp_path / "params.yaml"
    params.write_text(PARAMS)
    sh(dvc, "repro", "-q")
    assert estimate.rerun_plan(tmp_path) == [] == estimate.rerun_plan(tmp_path, PARAMS)
    mxfp4 = PARAMS.replace("nvfp4", "mxfp4")
    assert estimate.rerun_plan(tmp_path, mxfp4) == [("b", "changed: changed deps")]
    assert estimate.rerun_plan(tmp_path, PARAMS.replace("1.0", "2.0")) == [
        ("a", "changed: changed deps"), ("b", "downstream of a")]
    assert params.read_text() == PARAMS  # previewed, not written
    # hand edits of params.yaml are not what `dvc exp run -S` runs: the composition's values decide
    params.write_text(PARAMS.replace("1.0", "5.0"))
    assert estimate.rerun_plan(tmp_path) == [("a", "changed: changed deps"), ("b", "downstream of a")]
    assert estimate.rerun_plan(tmp_path, PARAMS) == []
    # a composition DVC has run before comes from the run cache
    params.write_text(mxfp4)
    sh(dvc, "repro", "-q")
    params.write_text(PARAMS)
    sh(dvc, "repro", "-q")
    assert estimate.rerun_plan(tmp_path, mxfp4) == [("b", "run cache")]
