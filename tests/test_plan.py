"""The layer plan is validated against the model before any heavy work."""

import pytest
from conftest import tiny_params

from ced_csa2.config import PlanConfig
from ced_csa2.model_utils import Geometry, geometry, load_config
from ced_csa2.plan import LayerPlan, PlanError, load_plan

QWEN = Geometry(n_layers=32, hidden_size=2560, n_kv_heads=4, head_dim=256,
                attention_layers=tuple(range(4, 33, 4)))
SMOL = Geometry(n_layers=30, hidden_size=576, n_kv_heads=3, head_dim=64, attention_layers=tuple(range(1, 31)))


def plan(split=16, source=20, targets=(24, 28, 32), extra=()):
    return LayerPlan(split, source, tuple(targets), tuple(extra))


def test_seed_plan_is_valid_and_covering_on_qwen():
    p = plan().validate(QWEN)
    assert p.kv_layers == (20, 24, 28, 32)
    assert p.uncovered(QWEN) == []


@pytest.mark.parametrize("bad,message", [
    (plan(source=18), "plan source layer 18 is not a softmax-attention layer"),
    (plan(targets=(24, 33)), "plan target layer 33 does not exist: the model has layers 1..32"),
    (plan(split=20), "plan source layer 20 must come after split layer 20"),
    (plan(targets=(16, 24)), "plan target layer 16 must come after source layer 20"),
    (plan(targets=(24, 24)), "names a layer twice"),
    (plan(targets=()), "no target layers"),
    (plan(split=0), "plan split layer 0 does not exist"),
])
def test_invalid_plans_name_the_layer(bad, message):
    with pytest.raises(PlanError, match=message):
        bad.validate(QWEN)


def test_mode_a_needs_a_covering_plan():
    default = LayerPlan(15, 18, (22, 26, 30)).validate(SMOL)
    with pytest.raises(PlanError, match=r"does not cover attention layers \[16, 17, 19, 20, 21, 23, 24, 25, 27, 28, "
                                        r"29\] above split layer 15"):
        default.require_covering(SMOL)
    covering = LayerPlan(15, 18, (22, 26, 30), (16, 17, 19, 20, 21, 23, 24, 25, 27, 28, 29)).validate(SMOL)
    assert covering.require_covering(SMOL) is covering
    with pytest.raises(PlanError, match="does not cover attention layers \\[28\\]"):
        plan(targets=(24, 32)).validate(QWEN).require_covering(QWEN)


def test_tiny_profile_has_qwen3_5_4b_layer_pattern():
    geo = geometry(load_config(tiny_params().model))
    assert geo.n_layers == 32 and geo.attention_layers == QWEN.attention_layers
    p, _ = load_plan(tiny_params().plan, tiny_params().model)
    assert p == plan()
    with pytest.raises(PlanError, match="layer 18 is not a softmax-attention layer"):
        load_plan(PlanConfig("bad", 15, 18, [22, 26, 30], []), tiny_params().model)


# Gemma-3-270M's pattern: 18 layers, full attention at 6, 12, 18, the others a window of 512.
GEMMA = Geometry(n_layers=18, hidden_size=640, n_kv_heads=1, head_dim=256, attention_layers=tuple(range(1, 19)),
                 windows=tuple((la, 512) for la in range(1, 19) if la not in (6, 12, 18)))


def test_full_attention_source_may_feed_sliding_and_full_readers():
    assert plan(9, 12, (14, 16, 18)).validate(GEMMA).kv_layers == (12, 14, 16, 18)


def test_sliding_source_feeds_only_readers_within_its_window():
    assert plan(7, 8, (9, 10)).validate(GEMMA)  # all windows of 512
    with pytest.raises(PlanError, match=r"plan source layer 8 is a sliding-window layer \(window 512\): its cache "
                                        r"keeps only the last 511 positions, but target layer 12 has full attention"):
        plan(7, 8, (10, 12)).validate(GEMMA)
    narrow = Geometry(**{**vars(GEMMA), "windows": ((8, 128), (10, 512))})
    with pytest.raises(PlanError, match="target layer 10 has a sliding window of 512"):
        plan(7, 8, (10,)).validate(narrow)


# ----------------------------------------------------------------------------- plans with many readers (issue 67)

def test_committed_share_all_plan_makes_every_layer_above_the_cut_a_reader():
    import yaml
    from conftest import ROOT

    cfg = PlanConfig(**yaml.safe_load((ROOT / "conf" / "plan" / "smollm2_135m_share_all.yaml").read_text()))
    p = LayerPlan.from_config(cfg).validate(SMOL)
    assert (p.split, p.source, p.targets) == (15, 16, tuple(range(17, 31)))
    assert p.require_covering(SMOL) is p  # Mode A runs on it without extra sources


@pytest.mark.parametrize("model,plan_cfg", [
    ("tiny_qwen3_5", PlanConfig("all_readers", 16, 20, [24, 28, 32], [])),  # every attention layer above 16
    ("tiny_gemma3", PlanConfig("all_readers", 2, 3, [4, 5, 6, 7, 8], [])),  # a full source, sliding and full readers
])
def test_a_plan_with_every_layer_above_the_cut_as_a_reader_loads_on_the_tiny_profiles(model, plan_cfg):
    import yaml
    from conftest import TINY_GEMMA3_OVERRIDES, TINY_OVERRIDES, compose

    from ced_csa2.config import Params, from_dict

    overrides = {"tiny_qwen3_5": TINY_OVERRIDES, "tiny_gemma3": TINY_GEMMA3_OVERRIDES}[model]
    p, geo = load_plan(plan_cfg, from_dict(Params, yaml.safe_load(compose(overrides))).model)
    assert p.uncovered(geo) == [] and set(p.targets) == {la for la in geo.attention_layers if la > p.source}


@pytest.mark.parametrize("plan_cfg,message", [
    (PlanConfig("twice", 16, 20, [24, 28, 24], []), r"plan names a layer twice: source 20, targets \[24, 28, 24\]"),
    (PlanConfig("twice", 16, 20, [20, 24], []), r"plan names a layer twice: source 20, targets \[20, 24\]"),  # the source reads itself
    (PlanConfig("twice", 16, 20, [24, 28], [28]), r"plan names a layer twice: .*extra sources \[28\]$"),  # a reader also projected
    (PlanConfig("gdn", 16, 20, [21, 24, 28, 32], []),
     r"^plan target layer 21 is not a softmax-attention layer \(it has no K/V\); attention layers are \[4, 8, "),
])
def test_a_reader_named_twice_or_without_attention_is_refused_in_one_line_from_the_config(plan_cfg, message):
    # load_plan reads the model's config alone: the refusal comes before any weight is loaded
    with pytest.raises(PlanError, match=message) as err:
        load_plan(plan_cfg, tiny_params().model)
    assert "\n" not in str(err.value)
