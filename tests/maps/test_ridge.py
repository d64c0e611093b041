"""Streaming ridge against scikit-learn, its fallback, FitStats, and the ``ridge`` stage."""

import dataclasses
import itertools
import json
import logging
import types

import numpy as np
import pytest
import torch
import yaml
from conftest import ROOT
from sklearn.linear_model import LinearRegression, Ridge
from sklearn.metrics import r2_score

from ced_csa2.config import load_params, params_hash, to_dict
from ced_csa2.data.dump_file import DumpError, DumpLayout, DumpReader, DumpWriter
from ced_csa2.data.loader import aligned_block_rows, iter_blocks, load_rows, record_split, row_mask
from ced_csa2.maps.fit_metrics import FitStats
from ced_csa2.maps.ridge import RidgeAccumulator, fit_maps, load_ridge, map_groups, projected_groups
from ced_csa2.pipeline import paths
from ced_csa2.plan import LayerPlan
from ced_csa2.stages import ridge as ridge_stage

HIDDEN, KV_DIM = 24, 8


def write_dump(path, kv_layers, make_rows, n_records=30, seed=0):
    """A real dump file (chunks of 8-32 rows) whose rows come from ``make_rows(rng, n) -> {name: array}``."""
    rng = np.random.default_rng(seed)
    lengths = [int(n) for n in rng.integers(20, 120, n_records)]
    w = DumpWriter(path, path.with_suffix(".partial.h5"), DumpLayout(HIDDEN, KV_DIM, tuple(kv_layers)),
                   chunk_kib=1, attrs={"fingerprint": "test", "model": "synthetic", "tokenizer_sha256": "abc"})
    for i in range(0, n_records, 4):
        lens = lengths[i:i + 4]
        w.append(make_rows(rng, sum(lens)), np.zeros(sum(lens), np.int32), lens)
    return w.finalize()


def noisy_linear(rng, n):
    """h_split with offsets and uneven scales; k_1/v_1 a noisy linear map of it."""
    h = (rng.standard_normal((n, HIDDEN)) * np.linspace(0.5, 4, HIDDEN) + 3.0).astype(np.float32)
    A = np.random.default_rng(99).standard_normal((HIDDEN, 2 * KV_DIM))
    kv = h @ A + 1.5 + 0.3 * rng.standard_normal((n, 2 * KV_DIM))
    return {"h_split": h, "k_1": kv[:, :KV_DIM].astype(np.float32), "v_1": kv[:, KV_DIM:].astype(np.float32)}


@pytest.fixture(scope="module")
def noisy_dump(tmp_path_factory):
    return write_dump(tmp_path_factory.mktemp("ridge") / "dump.h5", [1], noisy_linear)


def stream_fit(path, mask, lam, x="h_split", y=("k_1", "v_1")):
    with DumpReader(path) as r:
        acc = RidgeAccumulator(r.layout.widths()[x], sum(r.layout.widths()[n] for n in y))
        n_blocks = 0
        for block in iter_blocks(r, [x, *y], mask, aligned_block_rows(r, 64)):
            acc.update(torch.from_numpy(block[x]), torch.from_numpy(np.concatenate([block[n] for n in y], 1)))
            n_blocks += 1
    assert n_blocks > 10  # the fit really streams over many blocks (and more chunks)
    X = load_rows(path, [x], mask, torch.float64).numpy()
    Y = load_rows(path, list(y), mask, torch.float64).numpy()
    return acc, X, Y


def rel_err(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


@pytest.mark.parametrize("lam", [1.0, 250.0])
def test_streaming_ridge_equals_sklearn(noisy_dump, lam):
    with DumpReader(noisy_dump) as r:
        mask = row_mask(r.record_offsets, record_split(r.n_records, 0.2, 0)[0], 0, 0)
    acc, X, Y = stream_fit(noisy_dump, mask, lam)
    W, b = acc.solve(lam)
    ref = Ridge(alpha=lam, fit_intercept=True, solver="cholesky").fit(X, Y)
    assert W.dtype == torch.float64 and W.shape == (HIDDEN, 2 * KV_DIM) and b.shape == (2 * KV_DIM,)
    # float64 normal equations against sklearn's Cholesky: eps64 × cond(XᵀX + λI); 1e-8 allows a condition
    # number up to ~4e7
    assert rel_err(W, ref.coef_.T) < 1e-8 and rel_err(b, ref.intercept_) < 1e-8


def test_lambda_zero_well_posed_equals_least_squares(noisy_dump, caplog):
    mask = np.ones(DumpReader(noisy_dump).n_tokens, bool)
    acc, X, Y = stream_fit(noisy_dump, mask, 0.0)
    with caplog.at_level(logging.WARNING):
        W, b = acc.solve(0.0)
    assert "falling back" not in caplog.text
    ref = LinearRegression().fit(X, Y)
    # float64 normal equations against sklearn's least squares: eps64 × cond(XᵀX); 1e-8 allows a condition
    # number up to ~4e7
    assert rel_err(W, ref.coef_.T) < 1e-8 and rel_err(b, ref.intercept_) < 1e-8


@pytest.mark.parametrize("jitter, reason", [(0.0, "Cholesky factorisation failed"),
                                             (1e-7, "condition number is at least")])
def test_collinear_inputs_take_the_logged_fallback(caplog, jitter, reason):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((500, 6))
    # Two columns that depend (exactly, or up to a tiny jitter) on two others.
    X = np.concatenate([X, X[:, :2] * 2.0 + 1.0 + jitter * rng.standard_normal((500, 2))], axis=1)
    Y = X[:, :6] @ rng.standard_normal((6, 3)) + 0.1 * rng.standard_normal((500, 3))
    acc = RidgeAccumulator(8, 3, name="collinear")
    for i in range(0, 500, 128):
        acc.update(torch.from_numpy(X[i:i + 128]), torch.from_numpy(Y[i:i + 128]))
    with caplog.at_level(logging.WARNING, logger="ced_csa2.maps.ridge"):
        W, b = acc.solve(0.0)
    assert "ridge collinear" in caplog.text and "falling back" in caplog.text and reason in caplog.text
    Xc, Yc = X - X.mean(0), Y - Y.mean(0)
    W_min_norm = np.linalg.lstsq(Xc, Yc, rcond=None)[0]  # lstsq gives the minimum-norm solution
    if jitter == 0.0:
        assert "rank 6 of 8" in caplog.text
        # float64 solutions in the well-conditioned rank-6 subspace (the null directions dropped): eps64 × its
        # condition number ≪ 1e-8
        assert rel_err(W, W_min_norm) < 1e-8
        # the intercept, as W above (float64)
        assert rel_err(b, Y.mean(0) - X.mean(0) @ W_min_norm) < 1e-8
    pred = X @ W.numpy() + b.numpy()
    best = ((Yc - Xc @ W_min_norm) ** 2).sum()
    # Dropping the near-null directions costs almost nothing in fit and keeps W small.
    # not rounding: the pseudo-inverse drops near-null directions that carry a little fit (<1%)
    assert ((Y - pred) ** 2).sum() == pytest.approx(best, rel=1e-2)
    assert float(W.abs().max()) < 10.0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ced_csa2.maps.ridge"):
        W1, _ = acc.solve(1.0)  # a positive lambda makes the same system well posed
    assert caplog.text == ""
    # float64 normal equations against sklearn: eps64 × cond(XᵀX + I) ≪ 1e-8
    assert rel_err(W1, Ridge(alpha=1.0).fit(X, Y).coef_.T) < 1e-8


def test_accumulator_rejects_wrong_shapes():
    acc = RidgeAccumulator(4, 2, name="m")
    with pytest.raises(ValueError, match=r"ridge m: update needs X \(n, 4\)"):
        acc.update(torch.zeros(3, 5), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="before any rows"):
        acc.solve(1.0)


def test_fit_stats_match_numpy_and_sklearn():
    rng = np.random.default_rng(1)
    true = rng.standard_normal((1000, 6)) * np.array([1, 2, 3, 0.5, 10, 1]) + 1e4  # large common offset
    pred = true + rng.standard_normal((1000, 6)) * 0.7
    fs = FitStats()
    bounds = [0, 7, 300, 300, 301, 999, 1000]  # uneven batches, including an empty one and a single row
    for i, j in itertools.pairwise(bounds):
        fs.update(torch.from_numpy(pred[i:j]).float(), torch.from_numpy(true[i:j]).float())
    got = fs.result()
    p32, t32 = pred.astype(np.float32).astype(np.float64), true.astype(np.float32).astype(np.float64)
    cos = (p32 * t32).sum(1) / np.linalg.norm(p32, axis=1) / np.linalg.norm(t32, axis=1)
    sse = ((p32 - t32) ** 2).sum()
    assert got["n"] == 1000
    # float64 sums of float32 rows (both sides): ~n × eps64 ≈ 1e-13, 1e-9 leaves room for sklearn's other formula of
    # r2
    assert got["r2"] == pytest.approx(r2_score(t32, p32, multioutput="variance_weighted"), rel=1e-9)
    # float64 sums of float32 rows, the same formula: a few eps64
    assert got["cos"] == pytest.approx(cos.mean(), rel=1e-12)
    # float64 sums of float32 rows, the same formula: a few eps64
    assert got["rel_mse"] == pytest.approx(sse / (t32 ** 2).sum(), rel=1e-12)
    # float64 sums of float32 rows, the same formula: a few eps64
    assert got["mse"] == pytest.approx(sse / t32.size, rel=1e-12)
    with pytest.raises(ValueError, match="before any rows"):
        FitStats().result()


# ----------------------------------------------------------------------------- the stage

def stage_params():
    """The committed default params (fast to load, unlike a Hydra compose), with small blocks."""
    params = load_params(ROOT / "params.yaml")
    return dataclasses.replace(params, split=dataclasses.replace(params.split, val_fraction=0.2),
                               ridge=dataclasses.replace(params.ridge, block_rows=128))


def exact_linear_rows(plan):
    """Rows where every map of ``plan`` is exactly linear (with offsets)."""
    g = np.random.default_rng(7)
    A = {l: g.standard_normal((HIDDEN, 2 * KV_DIM)) for l in plan.projected}
    C = {t: g.standard_normal((2, KV_DIM, KV_DIM)) for t in plan.targets}

    def make(rng, n):
        h = rng.standard_normal((n, HIDDEN)) + 0.5
        out = {"h_split": h}
        for l in plan.projected:
            kv = h @ A[l] + 2.0
            out[f"k_{l}"], out[f"v_{l}"] = kv[:, :KV_DIM], kv[:, KV_DIM:]
        for t in plan.targets:
            out[f"k_{t}"] = out[f"k_{plan.source}"] @ C[t][0] - 1.0
            out[f"v_{t}"] = out[f"v_{plan.source}"] @ C[t][1] + 0.5
        return {k: v.astype(np.float32) for k, v in out.items()}
    return make


def test_stage_fits_exact_linear_maps(tmp_path, monkeypatch):
    params = stage_params()
    plan = LayerPlan.from_config(params.plan)
    (tmp_path / "data/dump").mkdir(parents=True)
    write_dump(tmp_path / paths.DUMP_PATH, plan.kv_layers, exact_linear_rows(plan), n_records=25)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(to_dict(params), sort_keys=False))
    monkeypatch.chdir(tmp_path)
    ridge_stage.main([])  # the DVC entry point: params.yaml and the dump from the working directory

    metrics = json.loads((tmp_path / paths.RIDGE_METRICS).read_text())
    maps, meta = load_ridge(tmp_path / paths.RIDGE_PATH)
    src, targets = plan.source, plan.targets
    expected = {f"proj_{layer}{part}" for layer in plan.projected for part in ("", "_k", "_v")}
    # the adapters' maps from the source's own kind and from [K ‖ V]; ced_csa2's, from the projected
    # source (exactly linear too); and csa2's fed the projected source
    adapter_maps = {f"{kv}_{t}{suffix}" for t in targets for kv in "kv" for suffix in ("", "_from_kv")}
    expected |= adapter_maps | {f"ced_{m}" for m in adapter_maps} | {f"{m}_on_ced" for m in adapter_maps}
    assert f"proj_{src}" in expected
    assert set(metrics) == expected | {"run"}
    for name in expected:
        assert metrics[name]["r2"] > 0.9999 and metrics[name]["cos"] > 0.9999, (name, metrics[name])
        # not rounding: a fit from near-exact linear rows; a wrong map gives rel_mse ~1
        assert metrics[name]["rel_mse"] < 1e-4 and metrics[name]["n_val"] == metrics["run"]["n_val_rows"]
    assert set(maps) == {*[f"proj_{layer}" for layer in plan.projected], *adapter_maps,
                         *[f"ced_{m}" for m in adapter_maps]}
    assert maps[f"proj_{src}"]["W"].shape == (HIDDEN, 2 * KV_DIM) and maps[f"k_{targets[0]}"]["W"].shape == (8, 8)
    assert maps[f"ced_v_{targets[0]}_from_kv"]["W"].shape == (16, 8)
    assert all(m["W"].dtype == torch.float32 and m["b"].dtype == torch.float32 for m in maps.values())
    with DumpReader(tmp_path / paths.DUMP_PATH) as r:
        n_val = int(row_mask(r.record_offsets, record_split(r.n_records, 0.2, params.seed)[1], 0, 0).sum())
        assert metrics["run"]["n_val_rows"] == n_val and meta["n_train_rows"] == r.n_tokens - n_val
    assert meta["lambda"] == 1.0 and meta["dump"]["model"] == "synthetic" and meta["plan"]["source"] == src
    assert meta["params_hash"] == params_hash(params.plan, params.split, params.ridge)
    assert not list(tmp_path.rglob(".*tmp*"))  # atomic writes left no temporaries


def noisy_source(rng, n):
    """Source K/V a noisy linear map of h_split (so projecting it is not exact); target 2 from the true source."""
    h = (rng.standard_normal((n, HIDDEN)) * np.linspace(0.5, 3, HIDDEN) + 1.0).astype(np.float32)
    A = np.random.default_rng(5).standard_normal((HIDDEN, 2 * KV_DIM))
    src = h @ A + 0.8 * rng.standard_normal((n, 2 * KV_DIM))
    C = np.random.default_rng(6).standard_normal((2, KV_DIM, KV_DIM))
    out = {"h_split": h, "k_1": src[:, :KV_DIM], "v_1": src[:, KV_DIM:]}
    out["k_2"], out["v_2"] = np.tanh(out["k_1"] @ C[0]) + 0.2, out["v_1"] @ C[1] - 0.3
    return {k: v.astype(np.float32) for k, v in out.items()}


def test_projected_source_maps_equal_sklearn_on_the_projected_inputs(tmp_path):
    """ced_{k,v}_t: ridge from proj(h_split), the source K/V ced_csa2's targets read, to the true target K/V."""
    path = write_dump(tmp_path / "dump.h5", [1, 2], noisy_source)
    plan = types.SimpleNamespace(source=1, targets=(2,), projected=(1,))
    with DumpReader(path) as r:
        mask = row_mask(r.record_offsets, record_split(r.n_records, 0.2, 0)[0], 0, 0)
        maps = fit_maps(r, map_groups(plan)[:1], mask, aligned_block_rows(r, 64), 1.0)
        groups, derive = projected_groups(plan, maps["proj_1"])
        maps |= fit_maps(r, groups, mask, aligned_block_rows(r, 64), 3.0, derive)
    H = load_rows(path, ["h_split"], mask, torch.float64).numpy()
    projected = H @ maps["proj_1"]["W"].double().numpy() + maps["proj_1"]["b"].double().numpy()
    for kind, cols in (("k", slice(0, KV_DIM)), ("v", slice(KV_DIM, 2 * KV_DIM))):
        ref = Ridge(alpha=3.0, solver="cholesky").fit(projected[:, cols],
                                                      load_rows(path, [f"{kind}_2"], mask, torch.float64).numpy())
        # the rows went through the float32 projector: eps32 (1.2e-7) × cond of the ridge system, up to ~80 allowed
        assert rel_err(maps[f"ced_{kind}_2"]["W"], ref.coef_.T) < 1e-5
        # the rows went through the float32 projector: eps32 (1.2e-7) × cond of the ridge system, up to ~80 allowed
        assert rel_err(maps[f"ced_{kind}_2"]["b"], ref.intercept_) < 1e-5
    ref = Ridge(alpha=3.0, solver="cholesky").fit(projected, load_rows(path, ["v_2"], mask, torch.float64).numpy())
    assert rel_err(maps["ced_v_2_from_kv"]["W"], ref.coef_.T) < 1e-5  # from the whole projected entry [K ‖ V]
    true_src = Ridge(alpha=3.0).fit(load_rows(path, ["k_1"], mask, torch.float64).numpy(),
                                    load_rows(path, ["k_2"], mask, torch.float64).numpy())
    assert rel_err(maps["ced_k_2"]["W"], true_src.coef_.T) > 1e-2  # a different map than csa2's


def test_stage_rejects_a_dump_without_the_plans_layers(tmp_path):
    params = stage_params()
    plan = LayerPlan.from_config(params.plan)
    (tmp_path / "data/dump").mkdir(parents=True)
    short = dataclasses.replace(plan, targets=plan.targets[:1])
    write_dump(tmp_path / paths.DUMP_PATH, short.kv_layers, exact_linear_rows(short), n_records=4)
    with pytest.raises(DumpError, match="the plan needs"):
        ridge_stage.run(params, tmp_path)
    assert not (tmp_path / paths.RIDGE_PATH).exists() and not (tmp_path / paths.RIDGE_METRICS).exists()
