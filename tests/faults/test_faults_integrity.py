"""Fault catalogue: integrity and provenance -- nothing is used unverified or made with other params.

* a checkpoint (a map file, ``models/ridge.pt``) whose bytes changed after it was written;
* an artifact made with other params than the current ones, used by a stage run by itself
  (``python -m ced_csa2.stages.<stage>``, ``dvc repro --single-item``, a copied file): the
  dump (another ``model.dtype``), ``models/ridge.pt`` (another ``ridge.lambda``), a map file
  (another ``train_adapters.epochs``).

Each is refused in one line naming the file (and the key with both values) before the work.
The model-loading guard (a checkpoint that does not fill the model) is ``tests/test_model_loading.py``.
"""

import dataclasses
import json

import pytest
import torch
from tiny_dump import params, write_synthetic_dump
from torch import nn

from ced_csa2.ced_runtime import load_parts
from ced_csa2.config import ParamsError, check_provenance, provenance, replaced
from ced_csa2.maps.ridge import load_ridge, save_ridge
from ced_csa2.pipeline import paths
from ced_csa2.pipeline.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ced_csa2.plan import load_plan
from ced_csa2.stages import ridge, train_adapters, train_projector

MARK = 1234.5  # a float32 value whose bytes occur once in the saved file


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
    path = save_checkpoint(tmp_path / "adapters.pt", "adapters", linear, {"model": "m"}, ("model",))
    state, _ = load_checkpoint(path, "adapters")  # intact: loads
    flip_inside(path, state["weight"])
    with pytest.raises(CheckpointError, match=rf"{path}: its tensors' sha256 is .* not the .* it was written "
                                              r"with: the file changed after it was written"):
        load_checkpoint(path, "adapters")


def test_a_flipped_byte_in_ridge_maps_is_refused_naming_it(tmp_path):
    w = torch.full((4, 3), MARK)
    path = tmp_path / paths.RIDGE_PATH
    save_ridge(path, {"proj_1": {"W": w, "b": torch.zeros(3)}}, {"lambda": 1.0})
    assert torch.equal(load_ridge(path)[0]["proj_1"]["W"], w)
    flip_inside(path, w)
    with pytest.raises(CheckpointError, match=rf"{path}: its tensors are not the bytes it was written with"):
        load_ridge(path)


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
        load_parts(workdir / "models", changed, plan, geo, extra_sources=False)


def test_a_digest_mismatch_shows_the_digests_up_to_where_they_differ(tmp_path):
    """Digests that differ after the 16 digits shown would read as 'sha256 is abc..., not the abc...'."""
    path = save_checkpoint(tmp_path / "adapters.pt", "adapters", nn.Linear(4, 4), {"model": "m"}, ("model",))
    blob = torch.load(path, weights_only=True)
    actual = blob["sha256"]
    blob["sha256"] = written = actual[:20] + ("1" if actual[20] == "0" else "0") + actual[21:]  # its 21st digit
    torch.save(blob, path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, "adapters")
    assert f"{path}: its tensors' sha256 is {actual[:21]}..., not the {written[:21]}... it was written with" in str(
        err.value), str(err.value)
