"""Fault catalogue: integrity and provenance -- nothing is used unverified or made with other params.

* a checkpoint (a map file, ``models/ridge.pt``) whose bytes changed after it was written, or that
  another version of ced-csa2 wrote (another format version: said as such, not as a changed file);
* an artifact made with other params than the current ones, used by a stage run by itself
  (``python -m ced_csa2.stages.<stage>``, ``dvc repro --single-item``, a copied file): the
  dump (another ``model.dtype``), ``models/ridge.pt`` (another ``ridge.lambda``), a map file
  (another ``train_adapters.epochs``), a file of ``prepare``'s (another ``data.max_tokens``,
  ``data.math.n`` or ``data.mix``: each reader checks only the keys its file is made from),
  result files measured in another ``kv_format`` (the report);
* a file of ``prepare``'s changed after it was written, or without its record.

Each is refused in one line naming the file (and the key with both values) before the work.
The model-loading guard (a checkpoint that does not fill the model) is ``tests/test_model_loading.py``.
"""

import dataclasses
import json
import shutil

import pytest
import torch
from conftest import tiny_params
from tiny_dump import params, write_synthetic_dump
from torch import nn

from ced_csa2 import assets
from ced_csa2.ced_runtime import load_parts
from ced_csa2.config import MixEntry, ParamsError, check_provenance, provenance, replaced
from ced_csa2.data.records import check_prepared
from ced_csa2.maps.ridge import load_ridge, save_ridge
from ced_csa2.pipeline import paths
from ced_csa2.pipeline.atomic_files import write_json
from ced_csa2.pipeline.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ced_csa2.pipeline.map_roles import MAIN
from ced_csa2.plan import load_plan
from ced_csa2.stages import (
    dump,
    eval_gsm8k,
    eval_objectives,
    eval_ppl,
    gold_pairs,
    prepare,
    report,
    ridge,
    storage,
    train_adapters,
    train_projector,
    tune,
    tune_mode_a,
)

MARK = 1234.5  # a float32 value whose bytes occur once in the saved file
MADE_FOR = {"model": "m", "role": MAIN.as_meta()}  # a map file of the main branch, all else aside


def flip_inside(path, value: torch.Tensor) -> None:
    """Flip one bit inside the stored bytes of ``value`` (torch stores tensors uncompressed)."""
    blob = bytearray(path.read_bytes())
    needle = value.numpy().tobytes()
    at = blob.find(needle)
    assert at >= 0 and blob.find(needle, at + 1) < 0, "the marked tensor's bytes must occur exactly once"
    blob[at + len(needle) // 2] ^= 0x10
    path.write_bytes(bytes(blob))


def test_a_flipped_byte_in_a_map_file_is_refused_naming_it(tmp_path):
    linear = nn.Linear(4, 4)
    with torch.no_grad():
        linear.weight.fill_(MARK)
    path = save_checkpoint(tmp_path / "adapters.pt", "adapters", linear, MADE_FOR, ("model",))
    state, _ = load_checkpoint(path, "adapters", role=MAIN)  # intact: loads
    flip_inside(path, state["weight"])
    with pytest.raises(CheckpointError, match=rf"{path}: its tensors' sha256 is .* not the .* it was written "
                                              r"with: the file changed after it was written"):
        load_checkpoint(path, "adapters", role=MAIN)


def test_a_flipped_byte_in_ridge_maps_is_refused_naming_it(tmp_path):
    w = torch.full((4, 3), MARK)
    path = tmp_path / paths.RIDGE_PATH
    save_ridge(path, {"proj_1": {"W": w, "b": torch.zeros(3)}}, {"lambda": 1.0})
    assert torch.equal(load_ridge(path)[0]["proj_1"]["W"], w)
    flip_inside(path, w)
    with pytest.raises(CheckpointError, match=rf"{path}: its tensors are not the bytes it was written with"):
        load_ridge(path)


def test_a_map_file_of_an_older_format_is_another_version_not_a_changed_file(tmp_path):
    path = save_checkpoint(tmp_path / "adapters.pt", "adapters", nn.Linear(4, 4), MADE_FOR, ("model",))
    old = torch.load(path, weights_only=True)
    del old["sha256"]  # format 2 recorded no sha256: read as format 3, the file would look changed
    torch.save({**old, "format_version": 2}, path)
    with pytest.raises(CheckpointError, match=rf"^{path}: written by another version of ced-csa2 \(format 2, this "
                                              r"reads 3\): re-run its stage, `dvc repro -f train_adapters`$"):
        load_checkpoint(path, "adapters", role=MAIN)


def test_ridge_maps_without_a_format_version_are_another_version_not_a_changed_file(tmp_path):
    path = tmp_path / paths.RIDGE_PATH
    path.parent.mkdir(parents=True)
    torch.save({"maps": {"proj_1": {"W": torch.zeros(4, 3), "b": torch.zeros(3)}}, "meta": {}}, path)  # format 1
    with pytest.raises(CheckpointError, match=rf"^{path}: written by another version of ced-csa2 \(format 1, this "
                                              r"reads 2\): re-run its stage, `dvc repro -f ridge`$"):
        load_ridge(path)


def test_a_digest_mismatch_is_shown_up_to_where_the_two_differ(tmp_path):
    corpus = tmp_path / paths.TRAIN_JSONL
    corpus.parent.mkdir(parents=True)
    corpus.write_text('{"id": 0}\n')
    actual = assets.digest(corpus)
    recorded = actual[:20] + ("0" if actual[20] != "0" else "1") + actual[21:]  # equal in the first 20 digits
    write_json(tmp_path / paths.provenance_path(paths.TRAIN_JSONL), {"sha256": recorded, "provenance": {}})
    with pytest.raises(ValueError, match=rf": its sha256 is {actual[:21]}\.\.\., not the {recorded[:21]}\.\.\. "):
        check_prepared(tiny_params(), tmp_path, paths.TRAIN_JSONL)


def test_a_truncated_ridge_file_names_the_file(tmp_path):
    path = tmp_path / paths.RIDGE_PATH
    save_ridge(path, {"proj_1": {"W": torch.zeros(4, 3), "b": torch.zeros(3)}}, {})
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"{path}: not a readable ridge checkpoint \(truncated or corrupt\?\)"):
        load_ridge(path)


def test_provenance_names_the_first_key_that_differs():
    made = params()
    recorded = provenance(made, "seed", "ridge", "data.max_tokens")
    assert recorded["ridge.lambda"] == made.ridge.lam and "data.max_tokens" in recorded
    check_provenance("x.pt", recorded, made)  # the same params: accepted
    other = dataclasses.replace(made, ridge=replaced(made.ridge, lam=10.0))
    with pytest.raises(ParamsError, match=r"x.pt: was made with ridge.lambda = 1.0, params.yaml has 10.0: rebuild"):
        check_provenance("x.pt", recorded, other)


@pytest.fixture
def fitted(tmp_path):
    """A workdir whose dump records its provenance (as the dump stage writes it) and ``models/ridge.pt`` fitted on it."""
    p = params()
    write_synthetic_dump(tmp_path, p, provenance=json.dumps(provenance(p, "seed", "model")))
    return tmp_path, p


def test_a_dump_made_in_another_dtype_is_refused_by_a_stage_run_by_itself(fitted):
    workdir, p = fitted
    bf16 = dataclasses.replace(p, model=replaced(p.model, dtype="bfloat16"))
    for stage in (ridge, train_projector):
        with pytest.raises(ParamsError, match=rf"{workdir / paths.DUMP_PATH}: was made with model.dtype = "
                                              r"'float32', params.yaml has 'bfloat16'"):
            stage.run(bf16, workdir)


def test_ridge_maps_of_another_lambda_are_refused_before_training(fitted):
    workdir, p = fitted
    other = dataclasses.replace(p, ridge=replaced(p.ridge, lam=10.0))
    with pytest.raises(ParamsError, match=rf"{workdir / paths.RIDGE_PATH}: was made with ridge.lambda = 1.0, "
                                          r"params.yaml has 10.0"):
        train_adapters.run(other, workdir)
    assert not (workdir / paths.ADAPTERS_PATH).exists()


def test_map_files_of_other_training_params_are_refused_by_the_evaluation(fitted):
    """adapters.pt trained with 12 epochs, loaded for scoring with params that say 13: refused, naming file and key."""
    workdir, p = fitted
    train_projector.run(p, workdir)
    train_adapters.run(p, workdir)
    changed = dataclasses.replace(p, train_adapters=replaced(p.train_adapters, epochs=13))
    plan, geo = load_plan(changed.plan, changed.model)
    with pytest.raises(ParamsError, match=rf"{workdir / paths.ADAPTERS_PATH}: was made with train_adapters.epochs = "
                                          r"12, params.yaml has 13"):
        load_parts(workdir / "models", changed, plan, geo, extra_sources=False, role=MAIN)


def test_a_digest_mismatch_shows_the_digests_up_to_where_they_differ(tmp_path):
    """Digests that differ after the 16 digits shown would read as 'sha256 is abc..., not the abc...'."""
    path = save_checkpoint(tmp_path / "adapters.pt", "adapters", nn.Linear(4, 4), MADE_FOR, ("model",))
    blob = torch.load(path, weights_only=True)
    actual = blob["sha256"]
    blob["sha256"] = written = actual[:20] + ("1" if actual[20] == "0" else "0") + actual[21:]  # its 21st digit
    torch.save(blob, path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, "adapters", role=MAIN)
    assert f"{path}: its tensors' sha256 is {actual[:21]}..., not the {written[:21]}... it was written with" in str(
        err.value), str(err.value)


# ----------------------------------------------------------------------------- the corpus and the results

@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The tiny profile's corpus and math set as the prepare stage writes them, each file with its record."""
    workdir = tmp_path_factory.mktemp("prepared")
    prepare.run(tiny_params(), workdir)
    return workdir


def with_data(p, **changes):
    return dataclasses.replace(p, data=replaced(p.data, **changes))


FEWER_PROBLEMS = with_data(tiny_params(), math=replaced(tiny_params().data.math, n=5))
READERS = [  # (stage, its run's arguments after params and workdir, the file it reads, params of another corpus)
    (dump, (), paths.TRAIN_JSONL, "data.max_tokens = 96, params.yaml has 97"),
    (tune, ("attn_out",), paths.TRAIN_JSONL, "data.max_tokens = 96, params.yaml has 97"),
    (tune_mode_a, (), paths.TRAIN_JSONL, "data.max_tokens = 96, params.yaml has 97"),
    (eval_ppl, (), paths.EVAL_JSONL, "data.max_tokens = 96, params.yaml has 97"),
    (eval_objectives, (), paths.EVAL_JSONL, "data.max_tokens = 96, params.yaml has 97"),
    (gold_pairs, (), paths.GSM8K_JSONL, "data.math.n = 6, params.yaml has 5"),
    (eval_gsm8k, (), paths.GSM8K_JSONL, "data.math.n = 6, params.yaml has 5"),
]


@pytest.mark.parametrize("stage,args,file,differs", READERS, ids=[r[0].__name__.rsplit(".", 1)[1] for r in READERS])
def test_a_corpus_made_for_other_params_is_refused_by_every_stage_that_reads_it(prepared, stage, args, file, differs):
    """A stage run by itself after an edit of data.*: refused naming the file, the key and both values, before
    the model or any map is loaded (the folder holds none: a later check would fail on those instead)."""
    other = FEWER_PROBLEMS if file == paths.GSM8K_JSONL else with_data(tiny_params(), max_tokens=97)
    with pytest.raises(ParamsError, match=rf"^{prepared / file}: was made with {differs}: rebuild it with `dvc repro`"):
        stage.run(other, *args, prepared)


def test_a_mix_refuses_the_training_records_alone(prepared):
    """data.mix changes train.jsonl only: the evaluation records and the math set stay valid, the dump refuses."""
    mixed = with_data(tiny_params(dump={"records": 0}), mix=[MixEntry("tiny", 1.0)], mix_rows=500)
    evaluated = [paths.EVAL_JSONL, paths.GSM8K_JSONL, *(paths.domain_jsonl(d.name) for d in mixed.data.domains)]
    check_prepared(mixed, prepared, *evaluated)
    with pytest.raises(ParamsError, match=rf"{prepared / paths.TRAIN_JSONL}: was made with data.mix = \[\], "
                                          r"params.yaml has \[\{'domain': 'tiny', 'weight': 1.0\}\]"):
        dump.run(mixed, prepared)


def test_a_corpus_file_changed_after_prepare_or_without_its_record_is_refused(prepared, tmp_path):
    work = tmp_path / "work"
    shutil.copytree(prepared, work)
    train, record = work / paths.TRAIN_JSONL, work / paths.provenance_path(paths.TRAIN_JSONL)
    with train.open("a") as f:  # a copied or hand-edited file: one more record
        f.write(train.read_text().splitlines()[0] + "\n")
    with pytest.raises(ValueError, match=rf"^{train}: its sha256 is [0-9a-f]{{16}}\.\.\., not the [0-9a-f]{{16}}\.\.\. "
                                         rf"recorded in {record}: the file changed after prepare wrote it"):
        dump.run(tiny_params(), work)
    held_out, missing = work / paths.EVAL_JSONL, work / paths.provenance_path(paths.EVAL_JSONL)
    missing.unlink()
    with pytest.raises(FileNotFoundError, match=rf"^{held_out}: has no record of the params it was made from "
                                                rf"\({missing} is missing\): rebuild it with `dvc repro prepare`"):
        eval_ppl.run(tiny_params(), work)


def test_results_of_another_kv_format_are_refused_by_the_report(tmp_path):
    """The report reads no kv_format itself: ppl.json's protocol (to which gsm8k.json's and the objectives' are
    held) and storage.json must be params.yaml's, or the FP4 groups' figures are another format's."""
    nvfp4 = tiny_params()
    mxfp4 = dataclasses.replace(nvfp4, kv_format="mxfp4")

    def measured(fmt):
        for name in (paths.PPL_METRICS, paths.GSM8K_METRICS, paths.GENERATION_METRICS,  # the eval stages' protocols
                     paths.RETRIEVAL_METRICS):
            write_json(tmp_path / name, {"protocol": {"kv_format": fmt}})

    measured("nvfp4")
    storage.run(mxfp4, tmp_path)
    with pytest.raises(ParamsError, match=rf"^{tmp_path / paths.PPL_METRICS}: was made with kv_format = 'nvfp4', "
                                          r"params.yaml has 'mxfp4'"):
        report.run(mxfp4, tmp_path)
    measured("mxfp4")
    storage.run(nvfp4, tmp_path)  # its FP4 bytes counted in NVFP4's 16-channel blocks
    with pytest.raises(ParamsError, match=rf"^{tmp_path / paths.STORAGE_METRICS}: was made with kv_format = 'nvfp4', "
                                          r"params.yaml has 'mxfp4'"):
        report.run(mxfp4, tmp_path)
    storage.run(mxfp4, tmp_path)
    write_json(tmp_path / paths.GENERATION_METRICS, {"protocol": {"kv_format": "nvfp4"}})  # decoded in NVFP4
    with pytest.raises(ParamsError, match=rf"^{tmp_path / paths.GENERATION_METRICS}: was made with kv_format = "
                                          r"'nvfp4', params.yaml has 'mxfp4'"):
        report.run(mxfp4, tmp_path)
    write_json(tmp_path / paths.GENERATION_METRICS, {"protocol": {"kv_format": "mxfp4"}})
    write_json(tmp_path / paths.RETRIEVAL_METRICS, {"protocol": {"kv_format": "nvfp4"}})  # retrieved in NVFP4
    with pytest.raises(ParamsError, match=rf"^{tmp_path / paths.RETRIEVAL_METRICS}: was made with kv_format = "
                                          r"'nvfp4', params.yaml has 'mxfp4'"):
        report.run(mxfp4, tmp_path)
