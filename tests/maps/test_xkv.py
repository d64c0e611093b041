"""xKV, the training-free cross-layer low-rank baseline: fit, stage, runtime, scoring, bytes, refusals."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from conftest import rounding_tol, tiny_params
from tiny_maps import QWEN_PLAN, TINY_GEO, TINY_PARAMS, TINY_PLAN, check_exact, random_parts, rows, save_maps, true_kv

from ced_csa2.ced_runtime import CEDModeBRuntime, CEDParts, load_parts
from ced_csa2.config import ParamsError
from ced_csa2.data.dump_file import DumpLayout, DumpWriter
from ced_csa2.data.loader import record_split, row_mask
from ced_csa2.eval.scoring import multi_group_nll, sequence_nll
from ced_csa2.kv import kv_bytes as kb
from ced_csa2.maps.xkv import GramAccumulator, XKVBasis, load_xkv, save_xkv, top_eigenvectors
from ced_csa2.model_utils import attention, geometry
from ced_csa2.pipeline import paths
from ced_csa2.pipeline.checkpoint import CheckpointError, checkpoint_meta, expected_meta
from ced_csa2.pipeline.map_roles import MAIN
from ced_csa2.plan import LayerPlan
from ced_csa2.groups import GROUPS
from ced_csa2.stages import fit_xkv

LAYERS = (TINY_PLAN.source, *TINY_PLAN.targets)
FULL = len(LAYERS) * TINY_GEO.kv_dim  # 128


# ----------------------------------------------------------------------------- the fit, in float64

def stacked_rows(n=600, layers=4, d=8, seed=0):
    """Rows ``(n, layers * d)`` with offsets and very uneven directions (a K-like spectrum)."""
    g = np.random.default_rng(seed)
    return g.standard_normal((n, layers * d)) * np.geomspace(5.0, 0.01, layers * d) @ \
        np.linalg.qr(g.standard_normal((layers * d, layers * d)))[0] + 0.7


def test_streamed_gram_is_xtx_and_the_basis_spans_the_top_right_singular_vectors():
    X = stacked_rows()
    acc = GramAccumulator(X.shape[1])
    for s in range(0, len(X), 37):  # uneven blocks
        acc.update(torch.from_numpy(X[s:s + 37]).float() if s == 0 else torch.from_numpy(X[s:s + 37]))
    X[:37] = X[:37].astype(np.float32)  # the first block went in as float32, as dump rows do
    assert acc.n == len(X) and acc.gram.dtype == torch.float64
    # float64 sums of 600 products in two orders: <= 600 eps64 (1.3e-13) relative to Σ|x_i x_j| (<= ~1e4 here)
    np.testing.assert_allclose(acc.gram.numpy(), X.T @ X, rtol=1e-12, atol=1e-9)
    _, S, Vt = np.linalg.svd(X, full_matrices=False)
    for rank in (1, 10, 32):
        U, evals = top_eigenvectors(acc.gram, rank)
        # eigenvalues = σ², descending; float64 eigen/SVD solvers: eps64 × σ1² (~1e4) ≈ 2e-12 absolute
        np.testing.assert_allclose(evals.numpy(), S ** 2, rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(U.T.numpy() @ U.numpy(), np.eye(rank), atol=1e-12)  # float64: ~32 eps64 = 7e-15
        # the same subspace as numpy's top-r right singular vectors (projectors agree); float64, the
        # subspace's error is eps64 × σ1² / (the eigengap after rank r, >= ~1e-3 here) ≈ 1e-9 at worst
        np.testing.assert_allclose(U.numpy() @ U.numpy().T, Vt[:rank].T @ Vt[:rank], atol=1e-9)
        assert (U.abs().argmax(0) == U.argmax(0)).all()  # each column's largest entry is positive


def test_full_rank_reconstructs_the_true_kv_and_lower_ranks_are_the_svd_truncation():
    layers, d = (3, 5, 7, 9), 8
    X = {kind: stacked_rows(seed=i) for i, kind in enumerate("kv")}
    grams = {kind: torch.from_numpy(x.T @ x) for kind, x in X.items()}
    rows = {kind: {l: torch.from_numpy(x[:, i * d:(i + 1) * d]) for i, l in enumerate(layers)} for kind, x in X.items()}
    full = XKVBasis.from_grams(grams, layers, d, len(layers) * d, dtype=torch.float64)
    out = full(rows["k"], rows["v"])
    for l in layers:
        for j, kind in enumerate("kv"):
            # float64 U Uᵀ x with |x| <~ 10 over 32 terms: ~32 × eps64 × 10 = 7e-14, far below 1e-10
            np.testing.assert_allclose(out[l][j].numpy(), rows[kind][l].numpy(), rtol=0, atol=1e-10)
    rank = 6
    low = XKVBasis.from_grams(grams, layers, d, rank, dtype=torch.float64)
    c = low.compress("k", rows["k"])
    assert c.shape == (600, rank)  # r coefficients per token: the stored entry
    U, S, Vt = np.linalg.svd(X["k"], full_matrices=False)
    best = (U[:, :rank] * S[:rank]) @ Vt[:rank]  # Eckart-Young: the best rank-r approximation
    got = torch.cat([low(rows["k"], rows["v"])[l][0] for l in layers], 1).numpy()
    np.testing.assert_allclose(got, best, atol=1e-9)  # float64 subspaces agree to eps64 × σ1² / gap (see above)


def test_rank_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"xkv rank must be in \[1, 16\]"):
        XKVBasis((1, 2), 8, 17)


# ----------------------------------------------------------------------------- the stage

def write_tiny_dump(path, n_records=24, seed=0):
    """A dump of the tiny plan's widths whose K/V rows are rank-16 plus a little noise."""
    rng = np.random.default_rng(seed)
    mix = {kind: rng.standard_normal((16, FULL)) for kind in "kv"}
    lengths = [int(n) for n in rng.integers(20, 60, n_records)]
    w = DumpWriter(path, path.with_suffix(".partial.h5"), DumpLayout(TINY_GEO.hidden_size, TINY_GEO.kv_dim, LAYERS),
                   chunk_kib=64,
                   attrs={"fingerprint": "test", "model": TINY_PARAMS.model.name, "tokenizer_sha256": "x"})
    for i in range(0, n_records, 4):
        n = sum(lengths[i:i + 4])
        rows = {"h_split": rng.standard_normal((n, TINY_GEO.hidden_size))}
        for kind in "kv":
            x = rng.standard_normal((n, 16)) @ mix[kind] + 0.01 * rng.standard_normal((n, FULL)) + 0.5
            for j, layer in enumerate(LAYERS):
                rows[f"{kind}_{layer}"] = x[:, j * TINY_GEO.kv_dim:(j + 1) * TINY_GEO.kv_dim]
        w.append({k: v.astype(np.float32) for k, v in rows.items()}, np.zeros(n, np.int32), lengths[i:i + 4])
    return w.finalize()


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("xkv")
    (workdir / paths.DUMP_PATH).parent.mkdir(parents=True)
    write_tiny_dump(workdir / paths.DUMP_PATH)
    return workdir


@pytest.mark.parametrize("rank,rel_err_below", [(0, 1e-3), (17, 1e-3), (FULL, 1e-5), (4, 1.0)])
def test_stage_writes_the_bases_and_their_held_out_fit(dumped, rank, rel_err_below):
    params = tiny_params(xkv={"rank": rank}, split={"val_fraction": 0.2})
    metrics = fit_xkv.run(params, dumped)
    assert json.loads((dumped / paths.XKV_METRICS).read_text()) == json.loads(json.dumps(metrics))
    run = metrics["run"]
    assert run["rank"] == (rank or TINY_GEO.kv_dim) and run["layers"] == list(LAYERS) and run["width"] == FULL
    from ced_csa2.data.dump_file import DumpReader
    with DumpReader(dumped / paths.DUMP_PATH) as r:  # the ridge stage's record split, every token
        train, val = record_split(r.n_records, 0.2, params.seed)
        assert run["n_train_rows"] == int(row_mask(r.record_offsets, train, 0, params.seed).sum())
        assert run["n_val_rows"] == int(row_mask(r.record_offsets, val, 0, params.seed).sum())
        assert run["n_train_rows"] + run["n_val_rows"] == r.n_tokens
    assert set(metrics["layers"]) == {f"{kind}_{layer}" for kind in "kv" for layer in LAYERS}
    for name, fit in metrics["layers"].items():
        assert fit["rel_err"] < rel_err_below and fit["n_val"] == run["n_val_rows"], (name, fit)
    for kind in "kv":
        energy = metrics["energy"][kind]
        assert 0 < energy["val"] <= 1 + 1e-6 and 0 < energy["train"] <= 1 + 1e-12
        if rank != 4:  # the rows: rank 16, plus the offset (uncentred: one more direction), plus 1% noise
            assert energy["train"] > 0.999 and energy["val"] > 0.999
    basis = load_xkv(dumped / paths.XKV_PATH, expect=expected_meta(params, TINY_PLAN, TINY_GEO)["xkv"], role=MAIN)
    assert basis.layers == LAYERS and basis.rank == run["rank"] and basis.k.dtype == torch.float32
    assert basis.meta["n_train_rows"] == run["n_train_rows"] and basis.meta["val_fraction"] == 0.2
    assert not list(dumped.rglob(".*tmp*"))


def test_stage_refuses_a_rank_above_the_stacked_width(dumped):
    with pytest.raises(ValueError, match=r"'xkv.rank' is 129, above the 128 channels"):
        fit_xkv.run(tiny_params(xkv={"rank": FULL + 1}), dumped)


# ----------------------------------------------------------------------------- checkpoint checks

def save_basis(models, *, params=TINY_PARAMS, plan=TINY_PLAN, geo=TINY_GEO, rank=8):
    meta = checkpoint_meta(params, plan, geo, params.plan, params.xkv, role=MAIN)["xkv"]
    basis = XKVBasis((plan.source, *plan.targets), geo.kv_dim, rank)
    models.mkdir(parents=True, exist_ok=True)
    save_xkv(models / paths.XKV_PATH.name, basis, meta)
    return basis


@pytest.mark.parametrize("made_for,sentence", [
    ({"plan": LayerPlan(16, 20, (24, 28))}, (r"xkv\.pt: 'layers' is \[20, 24, 28\] in the checkpoint, "
                                             r"expected \[20, 24, 28, 32\]$")),
    ({"params": tiny_params(model={"name": "other_model"})},
     r"xkv\.pt: 'model' is 'other_model' in the checkpoint, expected 'tiny_qwen3_5'$"),
    ({"geo": dataclasses.replace(TINY_GEO, head_dim=8)}, r"xkv\.pt: 'kv_dim' is 16 in the checkpoint, expected 32$"),
])
def test_a_checkpoint_made_for_something_else_is_refused(tmp_path, made_for, sentence):
    save_maps(tmp_path)
    save_basis(tmp_path)
    assert load_parts(tmp_path, TINY_PARAMS, TINY_PLAN, TINY_GEO, low_rank=True, role=MAIN).xkv.layers == LAYERS
    assert load_parts(tmp_path, TINY_PARAMS, TINY_PLAN, TINY_GEO, role=MAIN).xkv is None  # only when asked for
    save_basis(tmp_path, **made_for)
    with pytest.raises(CheckpointError, match=sentence) as err:
        load_parts(tmp_path, TINY_PARAMS, TINY_PLAN, TINY_GEO, low_rank=True, role=MAIN)
    assert str(err.value).startswith(f"{tmp_path}/xkv.pt: ") and "\n" not in str(err.value)


def test_missing_bases_are_refused(tiny_model):
    with pytest.raises(ValueError, match="group 'xkv' needs the cross-layer bases of models/xkv.pt"):
        CEDModeBRuntime(tiny_model[0], QWEN_PLAN, "xkv", CEDParts(), kv_format=None)
    parts = random_parts(TINY_GEO, LayerPlan(16, 20, (24, 28)))
    with pytest.raises(ValueError, match=r"bases span layers \[20, 24, 28\], the plan's source and targets are "
                                         r"\[20, 24, 28, 32\]"):
        CEDModeBRuntime(tiny_model[0], QWEN_PLAN, "xkv", parts, kv_format=None)


# ----------------------------------------------------------------------------- runtime and scoring (tiny Qwen3.5)

@pytest.fixture(scope="module")
def fitted(tiny_model):
    """Full-rank and kv_dim-rank bases fitted on the tiny model's own clean K/V."""
    model, _ = tiny_model
    x = torch.randint(0, 250, (4, 40), generator=torch.Generator().manual_seed(5))
    kv = true_kv(model, x, LAYERS)
    grams = {}
    for j, kind in enumerate("kv"):
        rows = torch.cat([kv[l][j] for l in LAYERS], -1).reshape(-1, FULL).double()
        grams[kind] = rows.T @ rows
    return {rank: CEDParts(xkv=XKVBasis.from_grams(grams, LAYERS, TINY_GEO.kv_dim, rank))
            for rank in (FULL, TINY_GEO.kv_dim)}


def test_full_rank_gives_the_baseline_logits_and_kv_dim_rank_does_not(tiny_model, fitted):
    model, _ = tiny_model
    x = torch.randint(0, 250, (2, 29), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x).logits
        with CEDModeBRuntime(model, QWEN_PLAN, "xkv", fitted[FULL], kv_format=None):
            full = model(x).logits
        with CEDModeBRuntime(model, QWEN_PLAN, "xkv", fitted[TINY_GEO.kv_dim], kv_format=None):
            low = model(x).logits
    # U Uᵀ = I up to float32 rounding, carried through the layers above the source (~2 eps of |x| measured):
    # 16 roundings of the largest |logit|; rank kv_dim moves the logits by ~0.2, five orders more
    tol = rounding_tol(torch.float32, 16, ref.abs().max().item())
    torch.testing.assert_close(full, ref, rtol=0, atol=tol)
    assert not torch.allclose(low, ref, rtol=0, atol=1000 * tol)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_every_group_layer_reads_the_reconstruction_of_the_clean_kv(tiny_model, fitted):
    model, _ = tiny_model
    parts = fitted[TINY_GEO.kv_dim]
    x = torch.randint(0, 250, (1, 17), generator=torch.Generator().manual_seed(2))
    clean = true_kv(model, x, LAYERS)  # the unmodified model's K/V
    want = parts.xkv({l: kv[0] for l, kv in clean.items()}, {l: kv[1] for l, kv in clean.items()})
    seen = {}
    with torch.no_grad(), CEDModeBRuntime(model, QWEN_PLAN, "xkv", parts, kv_format=None):
        handles = [getattr(attention(model, l), f"{kind}_proj").register_forward_hook(
            lambda mod, inp, out, key=(l, kind): seen.__setitem__(key, out.clone()))
            for l in LAYERS for kind in "kv"]  # after the runtime's hooks: the final outputs (last pass wins)
        model(x)
        for h in handles:
            h.remove()
    for l in LAYERS:
        assert torch.equal(seen[(l, "k")], want[l][0]) and torch.equal(seen[(l, "v")], want[l][1]), l
    # ... not of the modified pass: above the source, that pass's own K/V differ from the clean ones
    # a real difference, not rounding: 1e-4 is ~800 float32 eps of these O(1) entries
    assert not torch.allclose(true_kv(model, x, LAYERS)[32][0], seen[(32, "k")], atol=1e-4)


def test_shared_trunk_equals_the_runtime_and_full_rank_equals_the_baseline(tiny_model, fitted):
    model, _ = tiny_model
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (19, 7, 26, 12, 3)]
    cut = [0, 2, 9, 0, 1]
    with torch.no_grad():
        logits = [model(torch.tensor([s])).logits[0] for s in seqs]
    # Per scored token, the NLL (logsumexp x - x_y) and the KL term (Σ p x - logsumexp x, on either side)
    # are formed from float32 values of size <= M.  At full rank the runtime's logits are the baseline's up to
    # float32 rounding (U Uᵀ = I; ~2 eps of |x| measured), so the true KL is second order in it (~0) and what
    # is measured is rounding: 4 roundings of M per token, either sign, summed over the sequence's tokens.
    M = max(max(x.logsumexp(-1).abs().max().item(), x.abs().max().item()) for x in logits)
    tol = rounding_tol(torch.float32, 4, M)  # per token, ~3e-6 nats; rank kv_dim moves a sequence by >= 1e-3
    for rank, parts in fitted.items():
        shared = multi_group_nll(model, QWEN_PLAN, ["baseline", "xkv"], parts, seqs, cut, 2, 0, kv_format=None,
                                 agreement=True)
        alone = multi_group_nll(model, QWEN_PLAN, ["xkv"], parts, seqs, cut, 2, 0, kv_format=None)  # trunk stops early
        with CEDModeBRuntime(model, QWEN_PLAN, "xkv", parts, kv_format=None):
            ref = sequence_nll(model, seqs, cut, 2, pad_id=0)
        assert torch.equal(shared["xkv"][:, :2], ref) and torch.equal(alone["xkv"], ref), rank
        n = ref[:, 1]  # scored tokens per sequence
        nll_gap, kl = (ref[:, 0] - shared["baseline"][:, 0]).abs(), shared["xkv"][:, 2]  # KL(baseline || xkv), nats
        assert torch.equal(n, shared["baseline"][:, 1])
        if rank == FULL:
            assert (nll_gap <= tol * n).all() and (kl.abs() <= tol * n).all(), (nll_gap, kl)
        else:  # a reconstruction that drops directions: far outside rounding
            assert nll_gap.max() > 100 * tol * n.max() and (kl > 100 * tol * n).all(), (nll_gap, kl)


def test_cached_generation_is_refused(tiny_model, fitted):
    from transformers import DynamicCache

    model, _ = tiny_model
    x = torch.randint(0, 250, (1, 8))
    sentence = r"^group 'xkv' compresses the K/V of a finished clean prefill \(xKV\) and supports teacher-forced " \
               r"passes only, not a forward with a KV cache \(cached generation\)$"
    with torch.no_grad(), CEDModeBRuntime(model, QWEN_PLAN, "xkv", fitted[TINY_GEO.kv_dim], kv_format=None):
        with pytest.raises(NotImplementedError, match=sentence):
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=2, do_sample=False, pad_token_id=0)
        with pytest.raises(NotImplementedError, match=sentence):
            model(x, cache=DynamicCache(config=model.config), use_cache=True)
        model(x)  # a teacher-forced pass still runs
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


# ----------------------------------------------------------------------------- bytes and params

QWEN = kb.Geometry(n_layers=32, hidden_size=2560, n_kv_heads=4, head_dim=256, attention_layers=tuple(range(4, 33, 4)))
QWEN_4B_PLAN = LayerPlan(16, 20, (24, 28, 32))


@pytest.mark.parametrize("basis", kb.BASES)
@pytest.mark.parametrize("dtype_bytes", [2, 4])
def test_bytes_per_token_at_rank_kv_dim_equal_csa2s(basis, dtype_bytes):
    for geo, plan in ((QWEN, QWEN_4B_PLAN), (TINY_GEO, TINY_PLAN)):
        xkv = kb.bytes_per_token(kb.kv_copies(geo, plan, GROUPS["xkv"], basis, dtype_bytes))
        assert xkv == kb.bytes_per_token(kb.kv_copies(geo, plan, GROUPS["csa2"], basis, dtype_bytes))
        assert kb.stored_layers(geo, plan, GROUPS["xkv"], basis) == \
               kb.stored_layers(geo, plan, GROUPS["csa2"], basis)
        # rank r: the one entry is r wide for K and for V, every other layer as csa2
        r = 100
        assert kb.bytes_per_token(kb.kv_copies(geo, plan, GROUPS["xkv"], basis, dtype_bytes, rank=r)) == \
            xkv - 2 * (geo.kv_dim - r) * dtype_bytes
    assert kb.xkv_basis_params(QWEN_4B_PLAN, GROUPS["xkv"], 1024, 1024) == 2 * 4 * 1024 * 1024
    assert kb.xkv_basis_params(QWEN_4B_PLAN, GROUPS["csa2"], 1024, 1024) == 0


def test_storage_stage_counts_xkv_entries_and_bases(tmp_path):
    from ced_csa2.stages.storage import run

    for rank in (0, 48):
        m = run(tiny_params(xkv={"rank": rank}), tmp_path)
        qwen, active = m["qwen3_5_4b"], m["active_model"]
        r = rank or 1024
        assert qwen["weights"]["xkv_rank"] == r and active["weights"]["xkv_rank"] == (rank or TINY_GEO.kv_dim)
        assert qwen["weights"]["xkv_basis_params"]["xkv"] == 2 * 4 * 1024 * r
        bf16 = qwen["kv"]["bf16"]
        assert bf16["decoder_attention"]["xkv"]["bytes_per_token"] == 2 * r * 2  # csa2's 4,096 at r = 1024
        assert bf16["all_attention_amortised_4k"]["xkv"]["bytes_per_token"] == \
            bf16["all_attention"]["xkv"]["bytes_per_token"] + 2 * 4 * 1024 * r * 2 / 4096
    assert m["groups"]["xkv"].startswith("training-free xKV baseline")


def test_accounted_copies_are_csa2s_at_rank_kv_dim():
    from ced_csa2.runtime.shared_kv import accounted_copies

    assert (accounted_copies(TINY_GEO, TINY_PLAN, "xkv", "bf16", 4)
            == accounted_copies(TINY_GEO, TINY_PLAN, "csa2", "bf16", 4))
    with pytest.raises(ValueError, match="FP4 storage 'nvfp4' is not defined"):
        accounted_copies(TINY_GEO, TINY_PLAN, "xkv", "nvfp4", 4)


def test_xkv_can_be_generated_with_and_rank_must_be_non_negative():
    """xkv decodes through LowRankKVCache (eval.generation.group_cache), so eval_gsm8k.generate may list it."""
    assert tiny_params(eval_gsm8k={"groups": ["baseline", "xkv"], "generate": ["baseline", "xkv"]})
    with pytest.raises(ParamsError, match=r"'xkv.rank' must be >= 0"):
        tiny_params(xkv={"rank": -1})


def test_random_parts_cover_xkv(tiny_model):
    parts = random_parts(geometry(tiny_model[0].config), QWEN_PLAN)
    assert parts.xkv.layers == LAYERS and parts.xkv.rank == TINY_GEO.kv_dim


def test_the_trunk_runs_through_the_top_target_and_no_further():
    from conftest import tiny_llama

    model, plan = tiny_llama(), LayerPlan(1, 2, (3, 4))  # 6 layers: the top target is below the last
    for groups in (("xkv",), ("share_plain", "xkv")):
        check_exact(model, plan, groups, batch_size=4)
    calls = {}
    handles = [layer.register_forward_hook(lambda m, i, o, l=l: calls.__setitem__(l, calls.get(l, 0) + 1))
               for l, layer in enumerate(model.model.layers, 1)]
    try:
        seqs, cut = rows(250)
        multi_group_nll(model, plan, ["xkv"], random_parts(geometry(model.config), plan), seqs, cut, 4, 0,
                        kv_format=None)  # 7 sequences: 2 batches
    finally:
        for h in handles:
            h.remove()
    # per batch: the trunk runs layers 1..4 (it stops before 5, once the top target's K/V are in), the branch 2..6
    assert calls == {1: 2, 2: 4, 3: 4, 4: 4, 5: 2, 6: 2}
