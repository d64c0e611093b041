"""The dump stores exactly what a direct forward computes, resumes after a kill, and rejects bad files."""

import json
import shutil

import h5py
import numpy as np
import pytest
import torch
from conftest import FORWARD32, tiny_params
from tiny_dump import TEXTS

from ced_csa2.data.corpus import write_prepared
from ced_csa2.data.dump_file import DumpError, DumpReader
from ced_csa2.model_utils import load_model_and_tokenizer
from ced_csa2.pipeline import paths
from ced_csa2.stages import dump


def write_corpus(workdir, tok, max_tokens=96):
    lines = []
    for i, text in enumerate(TEXTS):
        n = len(tok(text, truncation=True, max_length=max_tokens)["input_ids"])
        lines.append(json.dumps({"id": f"r{i}", "source": "test", "text": text, "n_tokens": n}))
    write_prepared(params(), workdir, paths.TRAIN_JSONL, "\n".join(lines) + "\n")


def params(batch_size=4, storage_dtype="float32"):
    # 512 KiB chunks would hold the whole tiny dump in one chunk; 64 KiB gives several.
    return tiny_params(dump={"batch_size": batch_size, "storage_dtype": storage_dtype, "chunk_kib": 64})


@pytest.fixture
def workdir(tmp_path, tiny_model):
    write_corpus(tmp_path, tiny_model[1])
    return tmp_path


def datasets(path):
    with h5py.File(path, "r") as f:
        return {name: f[name][:] for name in f}


def test_dump_equals_direct_forward_without_pads(workdir):
    p = params()
    metrics = dump.run(p, workdir)
    model, tok = load_model_and_tokenizer(p.model)
    with DumpReader(workdir / paths.DUMP_PATH) as reader:
        offs = reader.record_offsets
        assert reader.n_records == len(TEXTS) and metrics["tokens"] == reader.n_tokens
        assert reader.attrs["pre_norm"] and reader.attrs["pre_rope"]
        for r, text in enumerate(TEXTS):
            ids = tok(text, truncation=True, max_length=96, return_tensors="pt")["input_ids"]
            assert offs[r + 1] - offs[r] == ids.shape[1]  # no pad position stored
            np.testing.assert_array_equal(reader.f["input_ids"][offs[r]:offs[r + 1]], ids[0].numpy())
            with torch.no_grad():
                out = model(ids, output_hidden_states=True)
            from ced_csa2 import kv_hooks
            with torch.no_grad(), kv_hooks.capture(model, [20, 24, 28, 32]) as store:
                model(ids)
            rows = slice(offs[r], offs[r + 1])
            # batched with right padding vs alone: equal up to fp32 reduction order
            torch.testing.assert_close(torch.from_numpy(reader.rows("h_split", rows.start, rows.stop)),
                                       out.hidden_states[16][0], **FORWARD32)
            for layer in (20, 24, 28, 32):
                for kind in "kv":
                    torch.testing.assert_close(torch.from_numpy(reader.rows(f"{kind}_{layer}", rows.start, rows.stop)),
                                               store[kind][layer][0], **FORWARD32)


def test_batch_of_one_is_bit_exact(workdir):
    dump.run(params(batch_size=1), workdir)
    model, tok = load_model_and_tokenizer(tiny_params().model)
    from ced_csa2 import kv_hooks
    with DumpReader(workdir / paths.DUMP_PATH) as reader:
        r = 5
        ids = tok(TEXTS[r], truncation=True, max_length=96, return_tensors="pt")["input_ids"]
        with torch.no_grad(), kv_hooks.capture(model, [20], [16]) as store:
            model.model(ids)
        a, b = reader.record_offsets[r:r + 2]
        assert torch.equal(torch.from_numpy(reader.rows("k_20", a, b)), store["k"][20][0])
        assert torch.equal(torch.from_numpy(reader.rows("h_split", a, b)), store["h"][16][0])


def test_interrupted_dump_resumes_to_the_same_datasets(workdir, tmp_path_factory):
    clean = tmp_path_factory.mktemp("clean")
    shutil.copytree(workdir / "data", clean / "data")
    dump.run(params(), clean)

    assert dump.run(params(), workdir, max_batches=2) is None  # "killed" after 2 of 3 batches
    assert (workdir / paths.DUMP_PARTIAL).exists() and not (workdir / paths.DUMP_PATH).exists()
    with pytest.raises(DumpError, match="incomplete"):
        DumpReader(workdir / paths.DUMP_PARTIAL)
    metrics = dump.run(params(), workdir)
    assert metrics["resumed_from_record"] == 8
    assert not (workdir / paths.DUMP_PARTIAL).exists()
    a, b = datasets(clean / paths.DUMP_PATH), datasets(workdir / paths.DUMP_PATH)
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_partial_dump_from_other_params_or_corrupt_restarts(workdir, caplog):
    dump.run(params(), workdir, max_batches=1)
    caplog.set_level("WARNING")
    assert dump.run(params(storage_dtype="bfloat16"), workdir)["resumed_from_record"] == 0
    assert "made with other inputs or params; starting over" in caplog.text
    dump.run(params(), workdir, max_batches=1)
    partial = workdir / paths.DUMP_PARTIAL
    partial.write_bytes(partial.read_bytes()[:1000])  # killed mid-write, file torn
    assert dump.run(params(), workdir)["resumed_from_record"] == 0
    assert "is unreadable" in caplog.text


def test_bfloat16_storage_round_trips(workdir, tmp_path_factory):
    dump.run(params(storage_dtype="bfloat16"), workdir)
    other = tmp_path_factory.mktemp("fp32")
    shutil.copytree(workdir / "data" / "corpus", other / "data" / "corpus")
    dump.run(params(), other)
    with DumpReader(workdir / paths.DUMP_PATH) as bf, DumpReader(other / paths.DUMP_PATH) as fp:
        x = torch.from_numpy(fp.rows("v_24", 0, 50))
        assert torch.equal(torch.from_numpy(bf.rows("v_24", 0, 50)), x.to(torch.bfloat16).float())


def test_truncated_or_corrupt_dump_is_a_clear_error(workdir):
    dump.run(params(), workdir)
    path = workdir / paths.DUMP_PATH
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(DumpError, match="not a readable HDF5 file"):
        DumpReader(path)
    path.write_bytes(b"\0" * 4096)
    with pytest.raises(DumpError, match="not a readable HDF5 file"):
        DumpReader(path)
    path.write_bytes(good)
    with h5py.File(path, "r+") as f:
        f["k_24"].resize(3, axis=0)
    with pytest.raises(DumpError, match="dataset 'k_24' has 3 rows"):
        DumpReader(path)
    with pytest.raises(DumpError, match="dump file not found"):
        DumpReader(workdir / "nope.h5")


def test_chunks_are_power_of_two_rows_across_full_width(workdir):
    dump.run(params(), workdir)
    with DumpReader(workdir / paths.DUMP_PATH) as reader:
        for name, width in reader.layout.widths().items():
            rows, w = reader.f[name].chunks
            assert w == width and rows & (rows - 1) == 0 and rows * width * 4 <= 64 * 1024
            assert reader.f[name].compression is None and reader.f[name].maxshape == (None, width)
            assert reader.block_rows % rows == 0


def test_corpus_from_another_tokenizer_is_refused(workdir):
    path = workdir / paths.TRAIN_JSONL
    lines = path.read_text().splitlines()
    rec = json.loads(lines[0])
    rec["n_tokens"] += 1
    write_prepared(params(), workdir, paths.TRAIN_JSONL, "\n".join([json.dumps(rec), *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match="record 'r0': tokenizes to"):
        dump.run(params(), workdir)
