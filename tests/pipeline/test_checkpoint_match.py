"""Map files say what they are for; every consumer refuses one made for another layer, plan, model or geometry."""

import dataclasses

import pytest
import torch
from conftest import tiny_params

from ced_csa2 import ced_runtime, csa2, projector
from ced_csa2.ced_runtime import load_parts
from ced_csa2.data.corpus import write_prepared
from ced_csa2.pipeline import paths
from ced_csa2.pipeline.checkpoint import CheckpointError, checkpoint_meta
from ced_csa2.plan import LayerPlan, load_plan
from ced_csa2.stages import eval_gsm8k, eval_ppl, gold_pairs, prepare

PARAMS = tiny_params()
PLAN, GEO = load_plan(PARAMS.plan, PARAMS.model)  # split 16, source 20, targets 24/28/32; hidden 64, kv_dim 32
KINDS = ("projector", "projectors", "adapters")


def save_maps(models, *, params=PARAMS, plan=PLAN, geo=GEO, only=KINDS, also=None):
    """Random maps of ``plan`` on ``geo``, saved as the stages save them, under the names ``PLAN`` reads.

    Returns ``{kind: module}`` of what was written.
    """
    torch.manual_seed(0)
    meta = {k: {**m, **(also or {})} for k, m in checkpoint_meta(params, plan, geo, params.model, params.plan).items()}
    out = {}
    if "projector" in only:
        out["projector"] = projector.KVProjector(geo.hidden_size, geo.kv_dim)
        projector.save_projector(paths.projector_path(PLAN.source, models), out["projector"], meta["projector"])
    if "projectors" in only:
        extra = {e: projector.KVProjector(geo.hidden_size, geo.kv_dim) for e in plan.extra_sources}
        projector.save_projectors(models / paths.PROJECTORS_EXTRA.name, extra, meta["projectors"])
    if "adapters" in only:
        out["adapters"] = csa2.CSA2Adapters(plan.targets, geo.kv_dim)
        csa2.save_adapters(models / paths.ADAPTERS_PATH.name, out["adapters"], meta["adapters"])
    return out


def test_the_matching_maps_load(tmp_path):
    saved = save_maps(tmp_path)
    parts = load_parts(tmp_path, PARAMS, PLAN, GEO)
    assert torch.equal(parts.projector.proj.weight, saved["projector"].proj.weight.half().float())
    assert parts.adapters.layers == PLAN.targets and parts.adapters.meta["hidden_size"] == GEO.hidden_size
    assert parts.adapters.meta["plan"] == {"split": 16, "source": 20, "targets": [24, 28, 32], "extra_sources": []}


def test_the_extra_sources_file_is_checked_for_a_covering_plan(tmp_path):
    covering = LayerPlan(12, 20, (24, 28, 32), (16,))
    save_maps(tmp_path, plan=covering)
    assert sorted(load_parts(tmp_path, PARAMS, covering, GEO).extra) == [16]
    save_maps(tmp_path, plan=dataclasses.replace(covering, extra_sources=(12,)), only=("projectors",))
    with pytest.raises(CheckpointError, match=r"projectors_extra\.pt: 'layers' is \[12\] in the checkpoint, "
                                              r"expected \[16\]"):
        load_parts(tmp_path, PARAMS, covering, GEO)


# (what the files were made for, the one sentence that refuses them)
MISMATCHES = {
    "projector for another layer": ({"plan": LayerPlan(16, 24, (28, 32)), "only": ("projector",)},
                                    r"projector_k20v20\.pt: 'layer' is 24 in the checkpoint, expected 20$"),
    "projector for another plan": ({"plan": LayerPlan(16, 20, (24, 28)), "only": ("projector",)},
                                   (r"projector_k20v20\.pt: 'plan' is \{.*'targets': \[24, 28\].*\} in the "
                                    r"checkpoint, expected \{.*'targets': \[24, 28, 32\].*\}$")),
    "adapters for other targets": ({"plan": LayerPlan(16, 20, (24, 28)), "only": ("adapters",)},
                                   r"adapters\.pt: 'layers' is \[24, 28\] in the checkpoint, expected \[24, 28, 32\]$"),
    "adapters for another source": ({"plan": LayerPlan(16, 24, (28, 32)), "only": ("adapters",)},
                                    r"adapters\.pt: 'source' is 24 in the checkpoint, expected 20$"),
    "another model": ({"params": tiny_params(model={"name": "other_model"})},
                      r"adapters\.pt: 'model' is 'other_model' in the checkpoint, expected 'tiny_qwen3_5'$"),
    "another kv_dim": ({"geo": dataclasses.replace(GEO, head_dim=8)},
                       r"adapters\.pt: 'kv_dim' is 16 in the checkpoint, expected 32$"),
    "another hidden size": ({"geo": dataclasses.replace(GEO, hidden_size=48)},
                            r"adapters\.pt: 'hidden_size' is 48 in the checkpoint, expected 64$"),
}


@pytest.mark.parametrize("case", MISMATCHES)
def test_load_parts_refuses_maps_made_for_something_else(tmp_path, monkeypatch, case):
    made_for, sentence = MISMATCHES[case]
    save_maps(tmp_path)  # the matching maps, then the mismatched file(s) over them
    save_maps(tmp_path, **made_for)
    weights_read = []

    def spy(load_state):
        def recording(path, module, state):  # every file whose weights reach a module
            weights_read.append(path.name)
            load_state(path, module, state)
        return recording

    for module in (projector, csa2):
        monkeypatch.setattr(module, "load_state", spy(module.load_state))
    with pytest.raises(CheckpointError, match=sentence) as err:
        load_parts(tmp_path, PARAMS, PLAN, GEO)
    message = str(err.value)
    assert message.startswith(f"{tmp_path}/") and "\n" not in message  # one sentence, naming the file
    assert message[len(f"{tmp_path}/"):].split(":")[0] not in weights_read  # refused before its weights were used


def test_the_eval_ppl_stage_refuses_a_projector_for_another_layer(tmp_path, tiny_model):
    save_maps(tmp_path / "models")
    save_maps(tmp_path / "models", plan=LayerPlan(16, 24, (28, 32)), only=("projector",))
    prepare.run(PARAMS, tmp_path)  # the eval records, checked first
    with pytest.raises(CheckpointError, match=r"projector_k20v20\.pt: 'layer' is 24 in the checkpoint, expected 20"):
        eval_ppl.run(PARAMS, tmp_path, model_and_tok=tiny_model)


def test_the_eval_gsm8k_stage_refuses_adapters_for_another_model(tmp_path, tiny_model):
    save_maps(tmp_path / "models")
    save_maps(tmp_path / "models", params=tiny_params(model={"name": "other_model"}), only=("adapters",))
    params = tiny_params(eval_gsm8k={"groups": ["csa2"], "generate": ["csa2"], "max_gen_toks": 2})
    write_prepared(params, tmp_path, paths.GSM8K_JSONL, '{"question": "1 + 1?", "answer": "#### 2"}\n')
    gold_pairs.run(params, tmp_path)
    with pytest.raises(CheckpointError, match=r"adapters\.pt: 'model' is 'other_model' in the checkpoint"):
        # one short group, so that without the check the test fails in seconds, not minutes
        eval_gsm8k.run(params, tmp_path, model_and_tok=tiny_model)


def test_eval_objectives_refuses_another_objective_s_or_another_layer_s_maps(tmp_path):
    folder = tmp_path / paths.objective_models("ridge")
    for sub in (folder, folder / "ced_csa2"):  # the ced/csa2 pair and ced_csa2's own pair
        save_maps(sub, also={"objective": "ridge"}, only=("projector", "adapters"))
    assert ced_runtime.load_objective_parts(tmp_path, "ridge", PARAMS, PLAN, GEO, "cpu")["csa2"].adapters is not None
    save_maps(folder / "ced_csa2", also={"objective": "distill"}, only=("adapters",))
    with pytest.raises(CheckpointError, match=r"ced_csa2/adapters\.pt: 'objective' is 'distill' in the checkpoint"):
        ced_runtime.load_objective_parts(tmp_path, "ridge", PARAMS, PLAN, GEO, "cpu")
    save_maps(folder / "ced_csa2", also={"objective": "ridge"}, only=("adapters",))
    save_maps(folder, also={"objective": "distill"}, only=("adapters",))
    with pytest.raises(CheckpointError, match=r"adapters\.pt: 'objective' is 'distill' in the checkpoint, "
                                              r"expected 'ridge'"):
        ced_runtime.load_objective_parts(tmp_path, "ridge", PARAMS, PLAN, GEO, "cpu")
    save_maps(folder, also={"objective": "ridge"}, only=("adapters",))
    save_maps(folder, plan=LayerPlan(16, 24, (28, 32)), also={"objective": "ridge"}, only=("projector",))
    with pytest.raises(CheckpointError, match=r"projector_k20v20\.pt: 'layer' is 24 in the checkpoint, expected 20"):
        ced_runtime.load_objective_parts(tmp_path, "ridge", PARAMS, PLAN, GEO, "cpu")
