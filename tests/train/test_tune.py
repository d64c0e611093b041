"""tune@<objective>: the ridge start exported exactly; a short distillation lowers the held-out KL."""

import dataclasses
import json

import pytest
import torch
from conftest import FORWARD32, read_curves, tiny_params

from ced_csa2 import ced_runtime
from ced_csa2.config import OnlineConfig, ParamsError
from ced_csa2.csa2 import KVAdapter
from ced_csa2.data.corpus import write_prepared
from ced_csa2.maps.ridge import save_ridge
from ced_csa2.pipeline import paths
from ced_csa2.plan import load_plan
from ced_csa2.stages import tune
from ced_csa2.train.objective_registry import OBJECTIVES
from ced_csa2.train.tuning import train_branch

ONLINE = OnlineConfig(records=12, val_records=4, seq_len=32, batch_size=4, epochs=3, projector_lr=1e-2,
                      adapters_lr=1e-2, weight_decay=0.0, warmup_fraction=0.0, temperature=2.0, kv_weight=0.0)


def write_inputs(workdir, params, tok, n_records=40, seed=0):
    """A random ridge file for the plan's maps and a train corpus of random-word records (made for ``params``)."""
    plan, geo = load_plan(params.plan, params.model)
    g = torch.Generator().manual_seed(seed)
    maps = {f"proj_{plan.source}": {"W": 0.1 * torch.randn(geo.hidden_size, 2 * geo.kv_dim, generator=g),
                                     "b": 4 * torch.randn(2 * geo.kv_dim, generator=g)}}
    for t in plan.targets:
        for kind in "kv":
            for prefix in ("", "ced_"):  # ced_*: the maps fitted on the projected source
                maps[f"{prefix}{kind}_{t}_from_kv"] = {  # train_adapters.input: kv reads [K ‖ V]
                    "W": 0.2 * torch.randn(2 * geo.kv_dim, geo.kv_dim, generator=g), "b": torch.zeros(geo.kv_dim)}
    save_ridge(workdir / "models/ridge.pt", maps, {})
    words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "tau"]
    lines = []
    for i in range(n_records):
        text = " ".join(words[(i * 7 + j * j) % len(words)] for j in range(12 + i % 9))
        n = len(tok(text, truncation=True, max_length=params.data.max_tokens)["input_ids"])
        lines.append(json.dumps({"id": f"r{i}", "source": "test", "text": text, "n_tokens": n}))
    write_prepared(params, workdir, paths.TRAIN_JSONL, "\n".join(lines) + "\n")
    return maps


def with_online(params, **changes):
    train = dataclasses.replace(params.train, online=dataclasses.replace(ONLINE, **changes),
                                objectives=list(OBJECTIVES))
    return dataclasses.replace(params, train=train)


@pytest.mark.parametrize("start", ["csa2", "projected"])
def test_ridge_objective_exports_the_closed_form_maps(tmp_path, tiny_model, start):
    model, tok = tiny_model
    params = tiny_params()
    params = dataclasses.replace(params, train=dataclasses.replace(params.train, ced_csa2_start=start))
    maps = write_inputs(tmp_path, params, tok)
    stale = tmp_path / paths.objective_curves("ridge")
    stale.parent.mkdir(parents=True)
    stale.write_text("step\tquantity\tseries\tvalue\n1\ttrain_loss\tced\t1.0\n")
    m = tune.run(params, "ridge", tmp_path)
    assert m["objective"] == "ridge" and m["phases"] == {}
    # ridge trains nothing: its (declared) curve table is the header alone, no rows left from before
    assert read_curves(stale) == ("step", {})
    assert [p.name for p in (tmp_path / paths.CURVES).rglob("*") if p.is_file()] == ["ridge.tsv"]
    assert not (tmp_path / paths.objective_metrics("ridge") / "curve.csv").exists()

    plan, geo = load_plan(params.plan, params.model)
    served = ced_runtime.load_objective_parts(tmp_path, "ridge", params, plan, geo, "cpu")
    assert set(served) == set(params.train.eval_groups) and served["ced"] is served["csa2"]
    ridge = maps[f"proj_{plan.source}"]
    # csa2's adapters are the ridge maps fitted on the true source; ced_csa2's own pair starts
    # from them or from the maps fitted on the projected source (ced_*); one ridge projector.
    for group, prefix in (("csa2", ""), ("ced_csa2", "ced_" if start == "projected" else "")):
        parts = served[group]
        # Checkpoints hold FP16 weights: the exported map is the ridge map rounded to FP16.
        assert torch.equal(parts.projector.proj.weight, ridge["W"].T.half().float())
        assert torch.equal(parts.projector.proj.bias, ridge["b"].half().float())
        for t in plan.targets:
            adapter: KVAdapter = parts.adapters.adapter("v", t)
            assert torch.equal(adapter.base.weight, maps[f"{prefix}v_{t}_from_kv"]["W"].T.half().float())
            x = torch.randn(5, 2 * geo.kv_dim)  # train_adapters.input: kv
            assert torch.equal(adapter(x), adapter.base(x))  # the MLP starts at exactly zero


def test_objectives_outside_the_list_are_refused(tmp_path):
    params = dataclasses.replace(tiny_params(), train=dataclasses.replace(tiny_params().train, objectives=["ridge"]))
    with pytest.raises(ValueError, match=r"'distill' is not in params.yaml train.objectives \['ridge'\]"):
        tune.run(params, "distill", tmp_path)
    with pytest.raises(ValueError, match=r"'distill' is not in params.yaml train.objectives \['ridge'\]"):
        ced_runtime.load_objective_parts(tmp_path, "distill", params, None, None, "cpu")
    with pytest.raises(ParamsError, match=r"train.objectives.*kv_mse is the main"):
        dataclasses.replace(params.train, objectives=["kv_mse"])


def test_phases_out_of_the_branch_s_order_are_refused_before_any_work():
    # the pipeline's order (its curves count steps across the phases in it): another order is no branch it runs
    with pytest.raises(ValueError, match=r"phases must be a subset of \('ced', 'csa2', 'ced_csa2'\) in that order"):
        train_branch("attn_out", None, None, {}, None, None, None, phases=("ced_csa2", "csa2"))


def test_a_short_distillation_lowers_the_held_out_kl(tmp_path, frozen):
    model, tok = frozen
    params = with_online(tiny_params())
    write_inputs(tmp_path, params, tok)
    m = tune.run(params, "distill", tmp_path, model_and_tok=(model, tok))

    # On the random-init tiny model H_16 -> KV_20 has little to gain (3 random GatedDeltaNet
    # layers in between); the adapters' KL drops by a good fraction in 9 steps, and the joint
    # ced_csa2 phase (projector and ced_csa2's own adapters) lowers its group's KL too.
    for group, factor in (("ced", 1.0), ("csa2", 0.8), ("ced_csa2", 1.0)):
        phase = m["phases"][group]
        assert phase["steps"] == ONLINE.epochs * 3 and phase["tokens"] > 0
        assert phase["val_after"]["kl"] < factor * phase["val_before"]["kl"], phase
    saved = json.loads((tmp_path / paths.objective_metrics("distill") / "train.json").read_text())
    assert saved == json.loads(json.dumps(m))
    # one series per phase, one optimizer-step counter across the three phases
    x, curves = read_curves(tmp_path / paths.objective_curves("distill"))
    phases = ("ced", "csa2", "ced_csa2")
    assert sorted(curves) == sorted((g, q) for g in phases for q in ("train_loss", "val_loss", "val_kl"))
    assert x == "step"
    n = ONLINE.epochs * 3
    steps = {key: [s for s, _ in points] for key, points in curves.items()}
    for i, group in enumerate(phases):
        assert steps[group, "train_loss"] == list(range(i * n + 1, (i + 1) * n + 1))
    for group, (first, last) in (("ced", (0, n)), ("csa2", (n, 2 * n)), ("ced_csa2", (2 * n, 3 * n))):
        phase = m["phases"][group]
        for key in ("loss", "kl"):
            (s0, before), (s1, after) = curves[group, f"val_{key}"]
            assert (s0, s1) == (first, last)
            # the curve table keeps 8 significant digits (5e-8 relative); otherwise the same float
            assert (before, after) == pytest.approx((phase["val_before"][key], phase["val_after"][key]), rel=1e-6)
    assert not (tmp_path / paths.objective_metrics("distill") / "curve.csv").exists()
    assert all(not p.requires_grad for p in model.parameters())


def test_attn_out_lowers_every_phase_s_held_out_loss(tmp_path, frozen):
    """Each attn_out phase, the joint ced_csa2 one included, ends below its held-out loss at the start."""
    model, tok = frozen
    params = with_online(tiny_params())
    write_inputs(tmp_path, params, tok)
    m = tune.run(params, "attn_out", tmp_path, model_and_tok=(model, tok))
    assert set(m["phases"]) == {"ced", "csa2", "ced_csa2"}
    for group, phase in m["phases"].items():
        assert phase["val_after"]["loss"] < phase["val_before"]["loss"], (group, phase)


def llama_params(tmp_path):
    """The tiny profile's params with a tiny Llama (all attention, SmolLM2's structure) saved to disk as
    a user's model (``kind: local``), its covering plan: cut after 2, source 3, targets 5 and 6, extra 4."""
    from conftest import tiny_llama

    from ced_csa2 import assets
    from ced_csa2.config import LocalModel
    from ced_csa2.model_utils import tiny_tokenizer

    folder = tmp_path / "llama"
    tiny_llama().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    params = tiny_params(plan=dict(name="tiny_llama", split=2, source=3, targets=[5, 6], extra_sources=[4]))
    model = dataclasses.replace(params.model, name="tiny_llama", kind="local", tiny=None,
                                local=LocalModel(path=str(folder), sha256=assets.digest(folder)))
    return dataclasses.replace(params, model=model)


@pytest.mark.parametrize("profile, head_width, rank", [("qwen3_5", 0, 0), ("gemma3", 0, 0), ("llama", 0, 0),
                                                       ("qwen3_5", 16, 0), ("gemma3", 0, 4)])
def test_mode_a_objective_lowers_its_held_out_kl(tmp_path, profile, head_width, rank):
    """tune_mode_a trains every map Mode A reads through the skip itself: hybrid Qwen3.5 (zero DeltaNet
    state above the cut), Gemma-3 (sliding and full layers, extra sources) and Llama (all attention,
    SmolLM2's structure, loaded from disk); with ``head_width`` the projectors as ridge maps plus
    residual MLPs; with ``rank`` as one bank (source and extra sources)."""
    import yaml
    from conftest import TINY_GEMMA3_OVERRIDES, compose

    from ced_csa2.ced_runtime import load_mode_a_parts
    from ced_csa2.config import Params, from_dict
    from ced_csa2.model_utils import load_model_and_tokenizer
    from ced_csa2.stages import tune_mode_a

    params = {"qwen3_5": tiny_params, "llama": lambda: llama_params(tmp_path),
              "gemma3": lambda: from_dict(Params, yaml.safe_load(compose(TINY_GEMMA3_OVERRIDES)))}[profile]()
    params = dataclasses.replace(
        params, train=dataclasses.replace(params.train, online=dataclasses.replace(ONLINE, records=8, epochs=1)),
        mode_a=dataclasses.replace(params.mode_a, maps="trained", train=dataclasses.replace(
            params.mode_a.train, records=8, epochs=4, projector_lr=3e-3, adapters_lr=3e-3, head_width=head_width,
            head_lr=3e-3, rank=rank)))
    model, tok = load_model_and_tokenizer(params.model, dtype=torch.float32)
    maps = write_inputs(tmp_path, params, tok)
    plan, geo = load_plan(params.plan, params.model)
    g = torch.Generator().manual_seed(1)
    for e in plan.extra_sources:  # the extra sources' ridge maps
        maps[f"proj_{e}"] = {"W": 0.1 * torch.randn(geo.hidden_size, 2 * geo.kv_dim, generator=g),
                             "b": torch.zeros(2 * geo.kv_dim)}
    save_ridge(tmp_path / "models/ridge.pt", maps, {})
    m = tune_mode_a.run(params, tmp_path, model_and_tok=(model, tok))
    assert m["covered"] and m["steps"] == 4 * 2
    assert m["val_after"]["kl"] < 0.9 * m["val_before"]["kl"]
    x, curves = read_curves(tmp_path / paths.MODE_A_CURVES)
    assert x == "step" and sorted(curves) == [("mode_a", "train_loss"), ("mode_a", "val_kl")]
    assert [s for s, _ in curves["mode_a", "train_loss"]] == list(range(1, 9))
    assert curves["mode_a", "val_kl"] == [(0, pytest.approx(m["val_before"]["kl"])), (8, pytest.approx(m["val_after"]["kl"]))]
    parts = load_mode_a_parts(tmp_path, params, plan, geo)  # what eval_ppl / eval_gsm8k run Mode A with
    if rank:
        assert parts.projector is None and not parts.extra and parts.bank.layers == plan.projected
        assert m["rank"] == parts.bank.rank == rank and m["protocol"]["projector_head"].startswith(f"bank of rank {rank}")
        return
    assert parts.bank is None and sorted(parts.extra) == sorted(plan.extra_sources)
    assert not torch.equal(parts.projector.proj.weight, maps[f"proj_{plan.source}"]["W"].T.half().float())
    assert m["protocol"]["projector_head"] == (f"ridge + residual MLP {head_width}" if head_width else "linear")
    for p in (parts.projector, *parts.extra.values()):
        assert p.mlp_width == head_width
        if head_width:  # trained off its zero start, and standardising by the prompts' spread
            assert p.mlp.down.weight.abs().max() > 0 and bool((p.h_std > 0).all())


def test_mode_a_kl_of_records_stacked_is_the_mean_of_their_own(tiny_model):
    """tune_mode_a runs the records of one length in one forward: the loss (and so the gradient) is the
    mean of the per-record losses it replaced, to float32 rounding."""
    from ced_csa2.ced_runtime import CEDModeARuntime
    from ced_csa2.train.mode_a_training import length_groups
    from ced_csa2.train.objectives import mode_a_kl

    model, tok = tiny_model
    params = tiny_params()
    plan, geo = load_plan(params.plan, params.model)
    from tiny_maps import random_parts
    parts = random_parts(geo, plan, seed=3)
    runtime = CEDModeARuntime(model, plan, geo, parts)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 200, (1, n), generator=g) for n in (24, 24, 17, 24)]
    assert length_groups(rows) == [[0, 1, 3], [2]]
    with torch.no_grad():
        one = [mode_a_kl(model, runtime, r, 0.5) for r in rows[:2] + rows[3:]]
        together = mode_a_kl(model, runtime, torch.cat(rows[:2] + rows[3:]), 0.5)
    assert one[0] > 0
    # Batching changes summation order only: each token's KL sums p·(log p − log q) over log-probabilities of
    # magnitude ~log(vocab), each carrying float32 rounding, so the tolerance is absolute, a few dozen eps.
    assert together.item() == pytest.approx(sum(one).item() / 3, rel=0, abs=32 * torch.finfo(torch.float32).eps)


@pytest.mark.parametrize("name", ["llama", "qwen3_5", "gemma3"])
def test_mode_a_kl_runs_only_the_layers_above_the_cut_and_is_the_whole_forwards_loss(name, tiny_model):
    """mode_a_kl continues from the teacher's H_split through the layers above the cut alone; its loss and the
    maps' gradients are those of the definition -- the whole model on the skip-prefilled cache against the whole
    model on the row -- to float32 rounding, on an all-attention, a hybrid and a sliding-window model."""
    from conftest import tiny_gemma3, tiny_llama
    from tiny_maps import GEMMA_PLAN, LLAMA_PLAN, QWEN_PLAN, random_parts

    from ced_csa2 import kv_hooks
    from ced_csa2.ced_runtime import CEDModeARuntime, prompt_tokens
    from ced_csa2.model_utils import decoder_layer, geometry
    from ced_csa2.plan import LayerPlan
    from ced_csa2.train.objectives import kl_distill, mode_a_kl, mode_a_teacher

    # the tiny Llama's plan, covering for Mode A with extra source 4
    llama_plan = LayerPlan(LLAMA_PLAN.split, LLAMA_PLAN.source, LLAMA_PLAN.targets, (4,))
    model, plan = {"llama": lambda: (tiny_llama(), llama_plan),
                   "qwen3_5": lambda: (tiny_model[0], QWEN_PLAN), "gemma3": lambda: (tiny_gemma3(), GEMMA_PLAN)}[name]()
    geo = geometry(model.config)
    plan = plan.validate(geo)
    model.requires_grad_(False)
    try:
        parts = random_parts(geo, plan, seed=3)
        maps = [w for m in parts.maps() for w in m.parameters()]
        runtime = CEDModeARuntime(model, plan, geo, parts)
        row = torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(5))
        cut = prompt_tokens(row.shape[1], 0.5)
        with torch.no_grad():
            teacher_logits = model(input_ids=row).logits[:, cut - 1:-1]
        cache = runtime.prefill_with_grad(row[:, :cut - 1])
        student = model(input_ids=row[:, cut - 1:-1], cache=cache, use_cache=True).logits
        ref = kl_distill(student, teacher_logits, torch.ones(row[:, cut:].shape), 1.0)
        ref_grads = torch.autograd.grad(ref, maps)

        teacher = mode_a_teacher(model, plan, row, 0.5)
        calls = [0] * (geo.n_layers + 1)
        hooks = [decoder_layer(model, i).register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
                 for i in range(1, geo.n_layers + 1)]
        try:
            got = mode_a_kl(model, runtime, row, 0.5, teacher)
        finally:
            for h in hooks:
                h.remove()
        got_grads = torch.autograd.grad(got, maps)
    finally:
        model.requires_grad_(True)
    # Below the cut the skip's prefill of the prompt ran, and on the continuation only the layers before the
    # first layer of the last kind seen above the cut (the hybrid's three DeltaNet layers before its first
    # attention layer; none on the others), where the forward handing the upper layers their arguments stops.
    stop = kv_hooks.kinds_seen_by(model, range(plan.split + 1, geo.n_layers + 1))
    assert stop == {"llama": 1, "qwen3_5": 4, "gemma3": 3}[name]
    assert calls[1:] == [2] * (stop - 1) + [1] * (geo.n_layers - stop + 1)
    assert ref > 0
    # Each token's KL sums p·(log p − log q) over log-probabilities of magnitude ~log(vocab): absolute rounding.
    eps = torch.finfo(torch.float32).eps
    assert got.item() == pytest.approx(ref.item(), rel=0, abs=64 * eps)
    for g, r in zip(got_grads, ref_grads):
        # float32 gradients through another grouping of the same sums: ~800 eps32 relative, plus 1e-8 for all-zero
        # gradients
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4 * float(r.abs().max()) + 1e-8)


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_mean_sink_is_the_mean_of_each_rows_own_first_position(name, tiny_model):
    """One forward over the first tokens gives, per layer, the mean of what each row's own forward puts at position 0."""
    from conftest import tiny_llama
    from tiny_maps import LLAMA_PLAN, QWEN_PLAN, true_kv

    from ced_csa2.model_utils import geometry
    from ced_csa2.train.mode_a_training import mean_sink

    model, plan = (tiny_llama(), LLAMA_PLAN) if name == "llama" else (tiny_model[0], QWEN_PLAN)
    geo = geometry(model.config)
    rows = [torch.randint(0, 250, (1, n)) for n in (5, 9, 7)]
    sink = mean_sink(model, plan, geo, rows)
    own = [true_kv(model, row, plan.kv_layers) for row in rows]  # each row alone, all its positions
    for layer in plan.kv_layers:
        for i, got in enumerate(sink(layer)):
            want = torch.stack([kv[layer][i][0, 0] for kv in own]).mean(0)
            torch.testing.assert_close(got, want, **FORWARD32)
    assert not torch.allclose(sink(plan.source)[0], own[0][plan.source][0][0, 1], atol=1e-3)  # not position 1


def test_projector_heads_start_at_the_linear_map_and_training_lowers_the_ced_held_out_kl(tmp_path, frozen):
    """with_projector_heads: each projector becomes its linear map plus a zero MLP (bit for bit), reading
    ``H_split`` standardised by its stats over the records; a distill branch then trains the MLP."""
    from ced_csa2 import kv_hooks
    from ced_csa2.train.objectives import online_records
    from ced_csa2.train.tuning import phase_optimizer, ridge_served, train_branch, with_projector_heads

    model, tok = frozen
    params = with_online(tiny_params())
    write_inputs(tmp_path, params, tok)
    plan, geo = load_plan(params.plan, params.model)
    served = ridge_served(params, plan, geo, tmp_path)
    linear = {group: torch.nn.Linear(geo.hidden_size, 2 * geo.kv_dim) for group in served}
    for group, parts in served.items():
        linear[group].load_state_dict(parts.projector.proj.state_dict())
    rows, _ = online_records(params, tok, tmp_path)
    with_projector_heads(served, model, plan, rows, tok.pad_token_id, 16, "gelu", ONLINE.batch_size)

    hidden = []  # H_split at every position of the records, the independent way: one record at a time
    with torch.no_grad(), kv_hooks.capture(model, hidden_layers=[plan.split]) as store:
        for row in rows:
            model.model(input_ids=torch.tensor([row]))
            hidden.append(store["h"][plan.split][0])
    h = torch.cat(hidden)
    for group, parts in served.items():
        head = parts.projector
        assert head.mlp_width == 16
        k, v = head(h)
        assert torch.equal(torch.cat([k, v], -1), linear[group](h))  # the MLP adds exact zeros
        # The stats are stored as FP16 (what a file would hold): equal to within FP16's rounding.
        torch.testing.assert_close(head.h_mean, h.double().mean(0).float(), rtol=2 ** -11, atol=1e-6)
        torch.testing.assert_close(head.h_std, h.double().std(0, correction=0).float().clamp_min(1e-3),
                                   # atol for means near 0: FP16 storage rounds values below 2^-14 to steps of 6e-8;
                                   # 1e-6 covers it
                                   rtol=2 ** -11, atol=1e-6)
    with pytest.raises(ValueError, match="no head_lr"):
        phase_optimizer(served["csa2"], "ced", params.train.online)

    phases, _, _ = train_branch("distill", params, plan, served, model, tok, tmp_path, head_lr=1e-2)
    for group in ("ced", "ced_csa2"):
        assert phases[group]["val_after"]["kl"] < phases[group]["val_before"]["kl"], phases[group]
    assert served["csa2"].projector.mlp.down.weight.abs().sum() > 0  # the MLP left zero: it was trained
