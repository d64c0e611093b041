"""Both trainers on a small synthetic dump: they learn, they are reproducible, they check inputs first."""

import dataclasses
import json
import shutil

import pytest
import torch
from conftest import read_curves
from tiny_dump import HIDDEN, KV, params, write_synthetic_dump

from ced_csa2.csa2 import load_adapters
from ced_csa2.data.dump_file import DumpError
from ced_csa2.maps.ridge import load_ridge
from ced_csa2.pipeline import paths
from ced_csa2.ced_runtime import load_seed_init
from ced_csa2.config import ParamsError
from ced_csa2.pipeline.checkpoint import check_meta_provenance, expected_meta
from ced_csa2.pipeline.map_roles import MAIN, SEED_INIT_ROLE
from ced_csa2.plan import load_plan
from ced_csa2.projector import load_projector, load_projectors
from ced_csa2.stages import extra_projectors, ridge, train_adapters, train_projector
from ced_csa2.train.training import write_curves


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Thousands of tiny matmuls: one thread is faster, and two stall badly on OpenMP
    # barriers whenever the two cores are shared with other work (30 s instead of 2 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prepared(one_thread, tmp_path_factory):
    """A workdir with a synthetic ``data/dump/dump.h5`` (plan 16 / 20 / 24, 28, 32) and ``models/ridge.pt``."""
    work = tmp_path_factory.mktemp("train")
    write_synthetic_dump(work, params())
    return work


@pytest.fixture
def workdir(prepared, tmp_path):
    shutil.copytree(prepared, tmp_path, dirs_exist_ok=True)
    return tmp_path


def without_wall_time(metrics):
    return {**metrics, "run": {k: v for k, v in metrics["run"].items() if k != "wall_s"}}


def epoch_curves(path, names, epochs):
    """The curves of a trainer: exactly ``names`` x (train_loss, val_loss, val_cos), x = epoch."""
    x, curves = read_curves(path)
    assert x == "epoch"
    assert sorted(curves) == sorted((n, m) for n in names for m in ("train_loss", "val_loss", "val_cos"))
    for (name, quantity), points in curves.items():
        first = 1 if quantity == "train_loss" else 0  # val_* start before training
        assert [e for e, _ in points] == list(range(first, epochs + 1)), (name, quantity)
    return {key: [v for _, v in points] for key, points in curves.items()}


def test_projector_learns_and_reruns_identically(workdir, tmp_path_factory):
    p = params()
    m = train_projector.run(p, workdir)
    layer = m["layers"]["20"]
    assert layer["val_loss"] < layer["val_loss_init"]
    assert layer["k"]["r2"] > 0.5 and layer["v"]["r2"] > 0.5 and layer["k"]["n"] == m["run"]["val_rows"]
    assert json.loads((workdir / paths.PROJECTOR_METRICS).read_text()) == m
    curves = epoch_curves(workdir / paths.PROJECTOR_CURVES, ["layer20"], epochs=4)
    # the curve table keeps 8 significant digits (5e-8 relative); otherwise the same float
    assert curves["layer20", "val_loss"][0] == pytest.approx(layer["val_loss_init"], rel=1e-6)
    # the curve table keeps 8 significant digits (5e-8 relative); otherwise the same float
    assert curves["layer20", "val_loss"][-1] == pytest.approx(layer["val_loss"], rel=1e-6)
    # the curve table keeps 8 significant digits (5e-8 relative); the mean of two: one more rounding
    assert curves["layer20", "val_cos"][-1] == pytest.approx((layer["k"]["cos"] + layer["v"]["cos"]) / 2, rel=1e-6)
    assert curves["layer20", "train_loss"][-1] < curves["layer20", "train_loss"][0]
    assert not (workdir / "metrics/plots").exists()

    expect = expected_meta(p, *load_plan(p.plan, p.model))  # what every consumer checks
    proj, meta = load_projector(workdir / "models/projector_k20v20.pt", expect=expect["projector"], role=MAIN)
    assert (meta["split"], meta["layer"], meta["hidden_size"], meta["kv_dim"]) == (16, 20, HIDDEN, KV)
    assert not (workdir / paths.PROJECTORS_EXTRA).exists()  # the extra_projectors stage's

    again = tmp_path_factory.mktemp("again")
    shutil.copytree(workdir / "data", again / "data")
    assert without_wall_time(train_projector.run(p, again)) == without_wall_time(m)
    proj2, _ = load_projector(again / "models/projector_k20v20.pt", role=MAIN)
    assert torch.equal(proj.proj.weight, proj2.proj.weight)


def test_the_seed_literal_projector_records_the_recipe_it_was_trained_with(workdir):
    """params.yaml says ``init: ridge, keep: best_val``; the seed-literal reference trains with ``init: random,
    keep: last`` and its file says so, its reader checks it against the same, and it is no main-branch file."""
    p = params(projector={"init": "ridge", "keep": "best_val"})
    train_projector.run(p, workdir)
    plan, geo = load_plan(p.plan, p.model)
    seed_file = workdir / paths.projector_path(plan.source, paths.SEED_INIT_MODELS)
    seed, seed_meta = load_projector(seed_file, role=SEED_INIT_ROLE)
    _, main_meta = load_projector(workdir / paths.projector_path(plan.source), role=MAIN)
    recipe = ("train_projector.init", "train_projector.keep")
    assert [seed_meta["provenance"][k] for k in recipe] == ["random", "last"]
    assert [main_meta["provenance"][k] for k in recipe] == ["ridge", "best_val"]
    assert seed_meta["provenance"]["train_projector.lr"] == main_meta["provenance"]["train_projector.lr"]
    assert "ridge.lambda" in main_meta["provenance"] and "ridge.lambda" not in seed_meta["provenance"]  # no ridge start
    assert seed_meta["params_hash"] != main_meta["params_hash"]
    # eval_objectives' reader checks it against params.yaml as the seed-literal branch applies them ...
    assert torch.equal(load_seed_init(workdir, p, plan, geo, "cpu").projector.proj.weight, seed.proj.weight)
    # ... which params.yaml as it is would refuse
    with pytest.raises(ParamsError, match=rf"{seed_file}: was made with train_projector.init = 'random', params.yaml "
                                          r"has 'ridge'"):
        check_meta_provenance(seed_file, seed_meta, p, MAIN)


def test_projector_keeps_its_best_held_out_epoch(workdir):
    """From the ridge map (the held-out least-squares optimum's neighbour) a large AdamW lr only adds
    noise: ``keep: best_val`` ends on the start itself, ``keep: last`` on the worse last epoch."""
    kept = train_projector.run(params(projector={"init": "ridge", "lr": 0.5}), workdir)["layers"]["20"]
    val = [v for _, v in read_curves(workdir / paths.PROJECTOR_CURVES)[1]["layer20", "val_loss"]]
    assert min(val[1:]) > val[0]  # every trained epoch is worse than the start
    # the curve table keeps 8 significant digits (5e-8 relative); otherwise the same float
    assert kept["kept_epoch"] == 0 and kept["val_loss"] == pytest.approx(val[0], rel=1e-6)
    proj, _ = load_projector(workdir / "models/projector_k20v20.pt", role=MAIN)
    maps, _ = load_ridge(workdir / paths.RIDGE_PATH)
    # the start itself, as saved (fp16)
    assert torch.equal(proj.proj.weight, maps["proj_20"]["W"].T.half().to(proj.proj.weight.dtype))
    last = train_projector.run(params(projector={"init": "ridge", "lr": 0.5, "keep": "last"}), workdir)["layers"]["20"]
    # the curve table keeps 8 significant digits (5e-8 relative); otherwise the same float
    assert last["kept_epoch"] == 4 and last["val_loss"] == pytest.approx(val[-1], rel=1e-6)
    assert last["val_loss"] > kept["val_loss"]


def test_adapters_improve_on_ridge_and_rerun_identically(workdir, tmp_path_factory):
    p = params()
    m = train_adapters.run(p, workdir)
    assert sorted(m["layers"]) == ["24", "28", "32"]
    for t, kinds in m["layers"].items():
        for kind in ("k", "v"):
            r = kinds[kind]
            assert r["trained"]["mse"] < r["ridge"]["mse"], (t, kind)
            assert r["gain"]["r2"] == pytest.approx(r["trained"]["r2"] - r["ridge"]["r2"])
    assert m["run"]["val_pairs"] == 12 * 16 and m["layers"]["24"]["k"]["trained"]["n"] == 12 * 16
    # one series per (layer, kind): six adapters are six lines, not one zig-zag
    curves = epoch_curves(workdir / paths.ADAPTERS_CURVES, [f"layer{t}_{kind}" for t in (24, 28, 32)
                                                            for kind in ("k", "v")], epochs=12)
    for t, kinds in m["layers"].items():
        for kind, r in kinds.items():
            val_loss, val_cos = curves[f"layer{t}_{kind}", "val_loss"], curves[f"layer{t}_{kind}", "val_cos"]
            # the curve table keeps 8 significant digits (5e-8 relative); otherwise the same float
            assert (val_loss[0], val_cos[0]) == pytest.approx((r["ridge"]["mse"], r["ridge"]["cos"]), rel=1e-6)
            # the trained end, as the ridge start above (8 significant digits)
            assert (val_loss[-1], val_cos[-1]) == pytest.approx((r["trained"]["mse"], r["trained"]["cos"]), rel=1e-6)

    adapters = load_adapters(workdir / paths.ADAPTERS_PATH, expect=expected_meta(p, *load_plan(p.plan, p.model))[
        "adapters"], role=MAIN)  # what every consumer checks
    assert (adapters.meta["layers"], adapters.meta["kv_dim"], adapters.meta["source"]) == ([24, 28, 32], KV, 20)
    assert adapters.width == 48

    again = tmp_path_factory.mktemp("again")
    shutil.copytree(workdir / "data", again / "data")
    shutil.copytree(workdir / "models", again / "models")
    assert without_wall_time(train_adapters.run(p, again)) == without_wall_time(m)


def covering(p):
    """The tiny plan with layer 32 as an extra source instead of a target."""
    return dataclasses.replace(p, plan=dataclasses.replace(p.plan, targets=[24, 28], extra_sources=[32]))


def test_extra_projectors_are_the_ridge_maps_or_trained(workdir, tmp_path):
    p = covering(params())
    fits = ridge.run(p, workdir)
    m = extra_projectors.run(p, workdir)
    expect = expected_meta(p, *load_plan(p.plan, p.model))["projectors"]
    extra, meta = load_projectors(workdir / paths.PROJECTORS_EXTRA, expect=expect, role=MAIN)
    assert list(extra) == [32] and meta["maps"] == "ridge"
    maps, _ = load_ridge(workdir / paths.RIDGE_PATH)
    W, b = maps["proj_32"]["W"], maps["proj_32"]["b"]
    assert torch.equal(extra[32].proj.weight, W.T.half().float()) and torch.equal(extra[32].proj.bias, b.half().float())
    got = m["layers"]["32"]
    assert got["maps"] == "ridge" and got["k"]["n"] == m["run"]["val_rows"]
    for kind in "kv":  # the same maps on the same held-out rows as the ridge stage measured (before FP16 storage)
        # not rounding: the maps are stored as FP16 (eps 9.8e-4) before they are measured again here
        assert got[kind]["r2"] == pytest.approx(fits[f"proj_32_{kind}"]["r2"], abs=1e-3)

    trained = dataclasses.replace(p, extra_projectors="trained")
    m = extra_projectors.run(trained, workdir)
    assert m["layers"]["32"]["maps"] == "trained" and m["layers"]["32"]["val_loss"] < m["layers"]["32"]["val_loss_init"]
    assert load_projectors(workdir / paths.PROJECTORS_EXTRA, expect=expect, role=MAIN)[1]["maps"] == "trained"

    # A plan without extra sources reads nothing and writes an empty file.
    assert extra_projectors.run(params(), tmp_path)["layers"] == {}
    assert load_projectors(tmp_path / paths.PROJECTORS_EXTRA, role=MAIN)[0] == {}


def test_stages_check_their_inputs_before_training(workdir):
    (workdir / paths.RIDGE_PATH).unlink()
    with pytest.raises(FileNotFoundError, match="ridge.pt"):
        train_adapters.run(params(), workdir)
    p = params()
    with pytest.raises(DumpError, match="holds H_16, the plan splits at layer 12"):
        train_projector.run(dataclasses.replace(p, plan=dataclasses.replace(p.plan, split=12)), workdir)
    other = dataclasses.replace(p.plan, split=8, source=12, targets=[24])
    with pytest.raises(DumpError, match=r"holds K/V of layers \[20, 24, 28, 32\], the plan needs \[12, 24\]"):
        train_adapters.run(dataclasses.replace(p, plan=other), workdir)
    assert not (workdir / paths.PROJECTOR_METRICS).exists()


def test_curves_one_table_grouped_by_quantity_then_series(tmp_path):
    table = tmp_path / "stage.tsv"
    table.write_text("stale\n")
    write_curves(table, {("b", "val_loss"): [(0, 1 / 3)], ("a", "val_loss"): [(0, 0.5)],
                         ("a", "train_loss"): [(1, 0.5), (2, 0.25)]})
    assert table.read_text() == ("step\tquantity\tseries\tvalue\n1\ttrain_loss\ta\t0.5\n2\ttrain_loss\ta\t0.25\n"
                                 "0\tval_loss\ta\t0.5\n0\tval_loss\tb\t0.33333333\n")
    assert read_curves(table)[1][("b", "val_loss")] == [(0, pytest.approx(1 / 3))]
    write_curves(table, {}, x="epoch")  # a stage that trains nothing: the header alone
    assert table.read_text() == "epoch\tquantity\tseries\tvalue\n"
    for bad in ([(1, 0.5), (1, 0.4)], [(2, 0.5), (1, 0.4)], []):
        with pytest.raises(ValueError, match="strictly increasing"):
            write_curves(tmp_path / "bad.tsv", {("b", "loss"): bad})
    with pytest.raises(ValueError, match="use letters"):
        write_curves(tmp_path / "bad.tsv", {("b/c", "loss"): [(1, 0.5)]})
    assert not (tmp_path / "bad.tsv").exists()
