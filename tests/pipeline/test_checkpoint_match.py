"""Map files say what they are for; every consumer refuses one of another branch, or made for another layer, plan,
model or geometry."""

import dataclasses
import os

import pytest
import torch
from conftest import tiny_params
from tiny_maps import TINY_GEO, TINY_PARAMS, TINY_PLAN, save_maps

from ced_csa2 import ced_runtime, csa2, projector
from ced_csa2.ced_runtime import load_parts
from ced_csa2.data.corpus import write_prepared
from ced_csa2.pipeline import paths
from ced_csa2.pipeline.checkpoint import CheckpointError
from ced_csa2.pipeline.map_roles import MAIN, MODE_A, PAIRS, SEED_INIT_ROLE, objective
from ced_csa2.plan import LayerPlan
from ced_csa2.stages import eval_gsm8k, eval_ppl, gold_pairs, prepare

def test_the_matching_maps_load(tmp_path):
    saved = save_maps(tmp_path)
    parts = load_parts(tmp_path, TINY_PARAMS, TINY_PLAN, TINY_GEO, role=MAIN)
    assert torch.equal(parts.projector.proj.weight, saved["projector"].proj.weight.half().float())
    assert parts.adapters.layers == TINY_PLAN.targets and parts.adapters.meta["hidden_size"] == TINY_GEO.hidden_size
    assert parts.adapters.meta["plan"] == {"split": 16, "source": 20, "targets": [24, 28, 32], "extra_sources": []}


def test_the_extra_sources_file_is_checked_for_a_covering_plan(tmp_path):
    covering = LayerPlan(12, 20, (24, 28, 32), (16,))
    save_maps(tmp_path, plan=covering)
    assert sorted(load_parts(tmp_path, TINY_PARAMS, covering, TINY_GEO, role=MAIN).extra) == [16]
    save_maps(tmp_path, plan=dataclasses.replace(covering, extra_sources=(12,)), only=("projectors",))
    with pytest.raises(CheckpointError, match=r"projectors_extra\.pt: 'layers' is \[12\] in the checkpoint, "
                                              r"expected \[16\]"):
        load_parts(tmp_path, TINY_PARAMS, covering, TINY_GEO, role=MAIN)


# (what the files were made for, the one sentence that refuses them)
MISMATCHES = {
    "the seed-literal projector": ({"role": SEED_INIT_ROLE, "only": ("projector",)},
                                   (r"projector_k20v20\.pt: holds the projector of branch 'seed_init', asked for the "
                                    r"projector of branch 'main' \(another branch's file\?\): rebuild it with "
                                    r"`dvc repro train_projector`$")),
    "an objective's adapters": ({"role": objective("attn_out", "csa2"), "only": ("adapters",)},
                                (r"adapters\.pt: holds the adapters of branch 'objective:attn_out', pair 'csa2', asked "
                                 r"for the adapters of branch 'main' \(another branch's file\?\): rebuild it with "
                                 r"`dvc repro train_adapters`$")),
    "Mode A's adapters": ({"role": MODE_A, "only": ("adapters",)},
                          (r"adapters\.pt: holds the adapters of branch 'mode_a', asked for the adapters of branch "
                           r"'main' \(another branch's file\?\): rebuild it with `dvc repro train_adapters`$")),
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
    "another kv_dim": ({"geo": dataclasses.replace(TINY_GEO, head_dim=8)},
                       r"adapters\.pt: 'kv_dim' is 16 in the checkpoint, expected 32$"),
    "another hidden size": ({"geo": dataclasses.replace(TINY_GEO, hidden_size=48)},
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
        load_parts(tmp_path, TINY_PARAMS, TINY_PLAN, TINY_GEO, role=MAIN)
    message = str(err.value)
    assert message.startswith(f"{tmp_path}/") and "\n" not in message  # one sentence, naming the file
    assert message[len(f"{tmp_path}/"):].split(":")[0] not in weights_read  # refused before its weights were used


def test_the_eval_ppl_stage_refuses_a_projector_for_another_layer(tmp_path, tiny_model):
    save_maps(tmp_path / "models")
    save_maps(tmp_path / "models", plan=LayerPlan(16, 24, (28, 32)), only=("projector",))
    prepare.run(TINY_PARAMS, tmp_path)  # the eval records, checked first
    with pytest.raises(CheckpointError, match=r"projector_k20v20\.pt: 'layer' is 24 in the checkpoint, expected 20"):
        eval_ppl.run(TINY_PARAMS, tmp_path, model_and_tok=tiny_model)


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
    for pair in PAIRS:  # the ced/csa2 pair and ced_csa2's own pair
        save_maps(tmp_path / paths.objective_pair_models("ridge", pair), role=objective("ridge", pair),
                  only=("projector", "adapters"))
    parts = ced_runtime.load_objective_parts(tmp_path, "ridge", TINY_PARAMS, TINY_PLAN, TINY_GEO, "cpu")
    assert parts["csa2"].adapters is not None
    folder = tmp_path / paths.objective_models("ridge")
    save_maps(folder / "ced_csa2", role=objective("distill", "ced_csa2"), only=("adapters",))
    with pytest.raises(CheckpointError, match=r"ced_csa2/adapters\.pt: holds the adapters of branch 'objective:"
                                              r"distill', pair 'ced_csa2', asked for the adapters of branch "
                                              r"'objective:ridge', pair 'ced_csa2' .*`dvc repro tune@ridge`$"):
        ced_runtime.load_objective_parts(tmp_path, "ridge", TINY_PARAMS, TINY_PLAN, TINY_GEO, "cpu")
    save_maps(folder / "ced_csa2", role=objective("ridge", "ced_csa2"), only=("adapters",))
    save_maps(folder, plan=LayerPlan(16, 24, (28, 32)), role=objective("ridge", "csa2"), only=("projector",))
    with pytest.raises(CheckpointError, match=r"projector_k20v20\.pt: 'layer' is 24 in the checkpoint, expected 20"):
        ced_runtime.load_objective_parts(tmp_path, "ridge", TINY_PARAMS, TINY_PLAN, TINY_GEO, "cpu")


def test_an_objective_s_two_adapter_pairs_swapped_are_refused(tmp_path):
    """Both pairs' adapters map the same source to the same targets: only their role tells them apart."""
    for pair in PAIRS:
        save_maps(tmp_path / paths.objective_pair_models("attn_out", pair), role=objective("attn_out", pair),
                  only=("projector", "adapters"))
    csa2_file, ced_csa2_file = (tmp_path / paths.objective_pair_models("attn_out", pair) / "adapters.pt"
                                for pair in PAIRS)
    os.replace(csa2_file, tmp_path / "swap.pt")
    os.replace(ced_csa2_file, csa2_file)
    os.replace(tmp_path / "swap.pt", ced_csa2_file)
    with pytest.raises(CheckpointError) as err:
        ced_runtime.load_objective_parts(tmp_path, "attn_out", TINY_PARAMS, TINY_PLAN, TINY_GEO, "cpu")
    assert str(err.value) == (f"{csa2_file}: holds the adapters of branch 'objective:attn_out', pair 'ced_csa2', "
                              "asked for the adapters of branch 'objective:attn_out', pair 'csa2' (another branch's "
                              "file?): rebuild it with `dvc repro tune@attn_out`")


def test_a_map_file_without_a_role_is_refused_naming_the_stage_that_rewrites_it(tmp_path):
    """A file written before map files recorded their branch (its meta has no role) cannot say which it is."""
    save_maps(tmp_path)
    path = tmp_path / paths.ADAPTERS_PATH.name
    blob = torch.load(path, weights_only=True)
    del blob["meta"]["role"]  # the sha256 covers the tensors alone: the file is intact otherwise
    torch.save(blob, path)
    with pytest.raises(CheckpointError) as err:
        load_parts(tmp_path, TINY_PARAMS, TINY_PLAN, TINY_GEO, role=MAIN)
    assert str(err.value) == (f"{path}: records no role (written before map files named their branch): rebuild it "
                              "with `dvc repro train_adapters`")


@pytest.mark.parametrize("branch,pair", [("main", "csa2"), ("seed_init", "bogus"), ("objective:attn_out", None),
                                         ("objective:attn_out", "ced"), ("objective:", "csa2"), ("tuned", None)])
def test_a_role_outside_the_vocabulary_is_refused(branch, pair):
    from ced_csa2.pipeline.map_roles import Role

    with pytest.raises(ValueError, match=r"(unknown map branch|an objective branch names one of)"):
        Role(branch, pair)
