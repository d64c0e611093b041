"""The resource estimate: its dump bytes are the real dump's, exactly; the full profile's needs no network."""

import dataclasses
import json
import re

import h5py
import pytest
import yaml
from conftest import ROOT, compose, tiny_params

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
