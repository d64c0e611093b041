"""The lightning indexer: its score and loss against independent formulas, and training that imitates attention."""

import copy
import dataclasses

import numpy as np
import pytest
import torch
from conftest import tiny_llama

from ced_csa2.kv.fp4 import MXFP4
from ced_csa2.maps.indexer import IndexerConfig, LightningIndexer, indexer_loss, key_bytes
from ced_csa2.model_utils import attention, geometry, rope_fn, rotary
from ced_csa2.train import indexer_training as it


def test_scores_are_v4_1_s_weighted_sum_of_relu_dot_products():
    torch.manual_seed(0)
    q, w, k = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5), torch.randn(2, 7, 4)
    got = LightningIndexer.scores(q, w, k)
    want = torch.zeros(2, 5, 7)
    for b in range(2):
        for t in range(5):
            for j in range(7):
                want[b, t, j] = sum(w[b, h, t] * max(0.0, float(q[b, h, t] @ k[b, j])) for h in range(3))
    # float32 scores (3 heads × 4-term dots, O(1)) against Python-float sums: ~16 eps32 ≈ 2e-6
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_an_offset_is_the_query_s_last_channel_against_a_constant_key_channel_inside_the_relu():
    torch.manual_seed(0)
    q, w, k = torch.randn(1, 2, 3, 5), torch.randn(1, 2, 3), torch.randn(1, 4, 4)
    got = LightningIndexer.scores(q, w, k)  # queries one channel wider than the keys
    want = LightningIndexer.scores(q, w, torch.cat((k, torch.ones(1, 4, 1)), -1))
    # float32: an extra channel of ones adds one rounding per score (O(1)): eps32-level, << 1e-6
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="width 5 cannot score keys of width 3"):
        LightningIndexer.scores(q, w, k[..., :3])


def test_rotated_keys_leave_the_float_scores_and_change_only_what_fp4_stores():
    torch.manual_seed(0)
    rope = lambda q, k, cos, sin: (q * cos + torch.roll(q, 1, -1) * sin, k)  # noqa: E731 (any per-position map)
    plain = LightningIndexer(16, 8, 8, 2, rope, key_heads=2, offset=True)
    rotated = LightningIndexer(16, 8, 8, 2, rope, key_heads=2, offset=True, rotate_keys=True)
    rotated.load_state_dict(plain.state_dict())
    with torch.no_grad():
        plain.b.bias.fill_(3.0), rotated.b.bias.fill_(3.0)
    x, k = torch.randn(1, 6, 16), torch.randn(1, 6, 8) * torch.tensor([20.0] + [1.0] * 7)  # one outlier channel
    cos, sin = torch.rand(1, 6, 8), torch.rand(1, 6, 8)
    with torch.no_grad():
        kp, kr = plain.keys(k, cos, sin), rotated.keys(k, cos, sin)
        sp = LightningIndexer.scores(*plain.queries(x, cos, sin), kp)
        sr = LightningIndexer.scores(*rotated.queries(x, cos, sin), kr)
    # float32: the rotation is two extra 8-term matmuls per score (O(1) values): ~16 eps32 ≈ 2e-6
    torch.testing.assert_close(sr, sp, rtol=1e-5, atol=1e-5)
    r = rotated.rotations[0].matrix.float()
    # float32: the rotation as one 8-term matmul, in two orders: ~8 eps32 of O(1) keys
    torch.testing.assert_close(kr.view(1, 6, 2, 8), kp.view(1, 6, 2, 8) @ r.T, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(kr, kp)


def test_key_copies_are_stored_side_by_side_each_under_its_own_rotation_and_score_as_one_key():
    """Two copies: the float scores are the one-copy indexer's, each copy is the plain key turned by its
    own matrix, the stored width doubles, and MXFP4 rounds the copies differently, so their mean scores
    closer to the float keys than one copy does (an outlier channel makes the rounding coarse)."""
    from ced_csa2.maps.indexer import key_format

    torch.manual_seed(0)
    rope = lambda q, k, cos, sin: (q * cos + torch.roll(q, 1, -1) * sin, k)  # noqa: E731
    plain = LightningIndexer(16, 8, 8, 2, rope, key_heads=2, offset=True)
    one = LightningIndexer(16, 8, 8, 2, rope, key_heads=2, offset=True, rotate_keys=True)
    two = LightningIndexer(16, 8, 8, 2, rope, key_heads=2, offset=True, rotate_keys=True, key_copies=2)
    one.load_state_dict(plain.state_dict())
    two.load_state_dict(plain.state_dict())
    assert (one.key_width, two.key_width) == (16, 32)
    x, k = torch.randn(1, 64, 16), torch.randn(1, 64, 8) * torch.tensor([20.0] + [1.0] * 7)
    cos, sin = torch.rand(1, 64, 8), torch.rand(1, 64, 8)
    with torch.no_grad():
        kp, k2 = plain.keys(k, cos, sin), two.keys(k, cos, sin)
        s_float = LightningIndexer.scores(*plain.queries(x, cos, sin), kp)
        torch.testing.assert_close(LightningIndexer.scores(*two.queries(x, cos, sin), k2), s_float,
                                   # float32: the rotation is two extra 8-term matmuls per score (O(1) values): ~16
                                   # eps32 ≈ 2e-6
                                   rtol=1e-5, atol=1e-5)
        for c, half in enumerate(k2.split(16, -1)):
            r = two.rotations[c].matrix.float()
            # float32: the rotation as one 8-term matmul, in two orders: ~8 eps32 of O(1) keys
            torch.testing.assert_close(half.view(1, 64, 2, 8), kp.view(1, 64, 2, 8) @ r.T, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(*k2.split(16, -1))
        errors = []
        for ix in (one, two):
            fmt = key_format(ix.key_width)
            stored = fmt.dequantize(fmt.quantize(ix.keys(k, cos, sin)))
            errors.append((LightningIndexer.scores(*ix.queries(x, cos, sin), stored) - s_float).abs().mean())
    assert errors[1] < errors[0]
    with pytest.raises(ValueError, match="key_copies 2 needs rotate_keys"):
        LightningIndexer(16, 8, 8, 2, rope, key_heads=2, key_copies=2)


def test_loss_is_the_kl_from_the_target_over_the_visible_entries():
    torch.manual_seed(0)
    scores = torch.randn(1, 2, 6, requires_grad=True)
    visible = torch.tensor([[[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]]], dtype=torch.bool)
    target = torch.rand(1, 2, 6) * visible
    target[0, 0, 1] = 0.0  # a visible entry without mass: 0 · log 0 = 0
    target = target / target.sum(-1, keepdim=True)
    loss = indexer_loss(scores, target, visible)
    want = []
    for r in range(2):
        n = int(visible[0, r].sum())
        p, s = target[0, r, :n].double(), scores[0, r, :n].detach().double()
        log_q = s - torch.logsumexp(s, 0)
        want.append(sum(float(pi * (torch.log(pi) - lq)) for pi, lq in zip(p, log_q) if pi > 0))
    # float32 loss (a mean of float32 KLs, O(1)) against float64: a few eps32 relative, << 1e-6
    assert loss.item() == pytest.approx(np.mean(want), rel=1e-6)
    loss.backward()
    assert torch.isfinite(scores.grad).all() and (scores.grad[0, 0, 3:] == 0).all()


def test_key_bytes_are_mxfp4_entries():
    assert key_bytes(64) == 64 // 2 + 64 // 32 and key_bytes(256) == 128 + 8
    assert key_bytes(16) == 8 + 1  # narrower than a block: one scale per key


@pytest.fixture(scope="module")
def llama_samples():
    model = tiny_llama()
    geo = geometry(model.config)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 300, (96,), generator=gen).tolist() for _ in range(10)]
    train = it.attention_samples(model, geo, [3, 5], seqs[:8], rows=48, first_row=8, seed=0)
    held = it.attention_samples(model, geo, [3, 5], seqs[8:], rows=32, first_row=40, seed=None)
    return model, geo, train, held, seqs


def k_proj_io(model, layer, ids):
    """The attention input and pre-RoPE keys of ``layer`` over ``ids``: ``k_proj``'s input and output."""
    captured = {}
    hook = attention(model, layer).k_proj.register_forward_hook(lambda m, i, o: captured.update(x=i[0], k=o))
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        hook.remove()
    return captured["x"], captured["k"]


def test_samples_are_the_layer_s_head_averaged_attention_and_its_inputs(llama_samples):
    model, geo, train, _, seqs = llama_samples
    s = train[3]
    assert s.x.shape == (8, 48, geo.hidden_size) and s.k.shape == (8, 96, geo.kv_dim)
    assert s.target.shape == s.oracle.shape == (8, 48, 96)
    # Independently: the eager attention of layer 3 from its own projections and RoPE
    attn = attention(model, 3)
    x, k = k_proj_io(model, 3, seqs[0])
    cos, sin = rotary(model, 3, x, torch.arange(96)[None])
    q = attn.q_proj(x).view(1, 96, -1, geo.head_dim).transpose(1, 2)
    kh = k.view(1, 96, -1, geo.head_dim).transpose(1, 2)
    q, kh = rope_fn(attn)(q, kh, cos, sin)
    kh = kh.repeat_interleave(q.shape[1] // kh.shape[1], dim=1)
    logits = (q @ kh.transpose(-1, -2)) / geo.head_dim ** 0.5
    logits = logits.masked_fill(torch.ones(96, 96, dtype=torch.bool).triu(1), float("-inf"))
    rows = s.rows[0]
    # float32 softmax averaged over heads, the same ops in another grouping: a few eps32 of p <= 1
    torch.testing.assert_close(s.target[0], logits.softmax(-1).mean(1)[0, rows], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s.x[0], x[0, rows], rtol=0, atol=0)
    torch.testing.assert_close(s.k[0], k[0], rtol=0, atol=0)
    # float32 probabilities: the sum of <= 96 of them is 1 to ~96 eps32 ≈ 1e-5
    assert (s.target[0].sum(-1) - 1).abs().max() < 1e-5
    assert torch.isinf(s.oracle[0, 0, int(rows[0]) + 1:]).all()


CFG = IndexerConfig(heads=2, steps=150, lr=1e-2, batch=4)


def test_training_lowers_the_held_out_kl_on_the_tiny_llama(llama_samples):
    model, geo, train, held, _ = llama_samples
    for layer in (3, 5):
        indexer = it.new_indexer(model, geo, layer, CFG, seed=0)
        before = it.held_out_kl(indexer, held[layer], 4)
        losses = it.fit(indexer, train[layer], CFG, 4, seed=0)
        after = it.held_out_kl(indexer, held[layer], 4)
        assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:10])
        assert after < 0.8 * before, (layer, before, after)


def test_training_lowers_the_loss_on_the_tiny_qwen3_5(tiny_model):
    """Qwen3.5: gated queries, k_norm and partial RoPE (the indexer rotates the rotary part only).  Its random
    weights attend nearly uniformly (an untrained indexer's held-out KL is already ~0.14), so only the
    training loss is asserted here; the Llama test above checks held-out KL."""
    model = tiny_model[0]
    geo = geometry(model.config)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 250, (96,), generator=gen).tolist() for _ in range(8)]
    layers = geo.attention_layers[:2]
    train = it.attention_samples(model, geo, layers, seqs, rows=48, first_row=8, seed=0)
    for layer in layers:
        losses = it.fit(it.new_indexer(model, geo, layer, CFG, seed=0), train[layer], CFG, 4, seed=0)
        assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:10]), layer


def test_selection_counts_the_oracle_s_top_k_and_the_attention_it_keeps_among_the_older_entries(llama_samples):
    model, geo, _, held, _ = llama_samples
    indexer = it.new_indexer(model, geo, 3, IndexerConfig(heads=2), seed=1)
    s, k, window = held[3], 5, 4
    got = it.selection(indexer, s, [k], window)
    fractions, fractions_attention, kept, oracle_kept, best_kept = [], [], [], [], []
    for i in range(s.k.shape[0]):
        # The scores and their top-k over whole masked rows, as selection ranks them: ReLU makes exact-zero ties
        # whose order topk leaves to the layout.  The counting below is independent.  Keys read back from MXFP4.
        fmt = MXFP4(group=min(32, indexer.key_width))
        keys = fmt.dequantize(fmt.quantize(indexer.keys(s.k[i:i + 1], s.cos, s.sin)))
        q, w = indexer.queries(s.x[i:i + 1], s.cos[:, s.rows[i]], s.sin[:, s.rows[i]])
        scores = LightningIndexer.scores(q, w, keys)[0]
        for r, row in enumerate(s.rows[i].tolist()):
            newer = torch.arange(s.k.shape[1]) > row - window
            a = set(scores[r].masked_fill(newer, float("-inf")).topk(k).indices.tolist())
            b = set(s.oracle[i, r].masked_fill(newer, float("-inf")).topk(k).indices.tolist())
            assert max(a | b) <= row - window
            fractions.append(len(a & b) / k)
            p = s.target[i, r, :row - window + 1].double()
            c = set(p.argsort(descending=True)[:k].tolist())  # the attention's own top-k of the older entries
            fractions_attention.append(len(a & c) / k)
            kept.append(float(p[sorted(a)].sum() / p.sum()))
            oracle_kept.append(float(p[sorted(b)].sum() / p.sum()))
            best_kept.append(float(p[sorted(c)].sum() / p.sum()))
    assert got["recall"][k] == pytest.approx(np.mean(fractions), abs=1e-6)  # float32 fractions
    # float32 fractions, averaged: a few eps32 (1.2e-7) of values <= 1
    assert got["recall_attention"][k] == pytest.approx(np.mean(fractions_attention), abs=1e-6)
    # float32 masses (sums of <= ~90 probabilities, divided): ~90 eps32 ≈ 1e-5
    assert got["mass"][k] == pytest.approx(np.mean(kept), abs=1e-5)
    assert 0 < got["recall"][k] < 1 and 0 < got["mass"][k] < 1
    oracle = it.selection(None, s, [k], window)
    # float32 masses (sums of <= ~90 probabilities, divided): ~90 eps32 ≈ 1e-5
    assert oracle["recall"][k] == 1 and oracle["mass"][k] == pytest.approx(np.mean(oracle_kept), abs=1e-5)
    best = it.selection(None, s, [k], window, by_attention=True)
    # float32 masses (sums of <= ~90 probabilities, divided): ~90 eps32 ≈ 1e-5
    assert best["recall_attention"][k] == 1 and best["mass"][k] == pytest.approx(np.mean(best_kept), abs=1e-5)
    assert best["mass"][k] >= max(oracle["mass"][k], got["mass"][k])  # no selection keeps more attention
    with pytest.raises(ValueError, match="by_attention"):
        it.selection(indexer, s, [k], window, by_attention=True)


def test_init_from_attention_starts_at_the_oracle_and_lifted_offsets_keep_its_order(llama_samples):
    model, geo, _, held, seqs = llama_samples
    cfg = IndexerConfig(heads=geo.n_kv_heads, key_heads=geo.n_kv_heads, offset=True, init="attention")
    indexer = it.new_indexer(model, geo, 3, cfg, seed=0)
    attn = attention(model, 3)
    x, k = k_proj_io(model, 3, seqs[8])
    n = x.shape[1]
    cos, sin = rotary(model, 3, x, torch.arange(n)[None])
    q = attn.q_proj(x).view(1, n, -1, geo.head_dim).transpose(1, 2)
    kh = k.view(1, n, -1, geo.head_dim).transpose(1, 2)
    q, kh = rope_fn(attn)(q, kh, cos, sin)
    group = q.shape[1] // kh.shape[1]
    per_kv = torch.einsum("bgqd,bgkd->bgqk", q.view(1, kh.shape[1], group, n, -1).sum(2), kh)  # (1, n_kv, n, n)
    w = attn.scaling / model.config.num_attention_heads
    with torch.no_grad():
        got = LightningIndexer.scores(*indexer.queries(x, cos, sin), indexer.keys(k, cos, sin))
    # float32 scores from a folded query (sums over the group's heads and head_dim, O(1)): ~64 eps32 ≈ 1e-5
    # absolute, 1e-4 relative for the larger ones
    torch.testing.assert_close(got, w * per_kv.relu().sum(1), rtol=1e-4, atol=1e-5)  # offsets 0: clipped per KV head
    # Lifted over samples of this sequence, none of their dot products is clipped, so at their rows the score
    # is the oracle's, scaled and shifted -- the oracle's order (random weights: the offsets are not trivial).
    offsets = it.lift_offsets(indexer, held[3], 4)
    assert (offsets > 0).all()
    rows = held[3].rows[0]
    older = torch.arange(n)[None] <= rows[:, None] - 4
    with torch.no_grad():
        got = LightningIndexer.scores(*indexer.queries(x, cos, sin), indexer.keys(k, cos, sin))[0, rows]
    want = w * (per_kv[0][:, rows] + offsets[:, None, None]).sum(0)
    # float32 scores plus per-head offsets (O(1), summed over heads in another order): ~100 eps32
    torch.testing.assert_close(got[older], want[older], rtol=1e-4, atol=1e-4)
    oracle = held[3].oracle[0]
    for r in range(len(rows)):
        if older[r].sum() >= 8:
            assert set(got[r].masked_fill(~older[r], -1e9).topk(8).indices.tolist()) == \
                set(oracle[r].masked_fill(~older[r], -1e9).topk(8).indices.tolist())
    with pytest.raises(ValueError, match="heads = key_heads = n_kv_heads"):
        it.new_indexer(model, geo, 3, IndexerConfig(heads=4, key_heads=geo.n_kv_heads, offset=True, init="attention"),
                       seed=0)
    with pytest.raises(ValueError, match="needs offset: true"):
        IndexerConfig(heads=geo.n_kv_heads, key_heads=geo.n_kv_heads, init="attention")


def test_init_from_attention_refuses_a_gated_normed_attention(tiny_model):
    model = tiny_model[0]
    geo = geometry(model.config)
    cfg = IndexerConfig(heads=geo.n_kv_heads, key_heads=geo.n_kv_heads, offset=True, init="attention")
    with pytest.raises(ValueError, match="plain q/k projections"):
        it.new_indexer(model, geo, geo.attention_layers[0], cfg, seed=0)


def _oracle_start(model, geo, held, layer=3, **recipe):
    cfg = IndexerConfig(heads=geo.n_kv_heads, key_heads=geo.n_kv_heads, offset=True, init="attention", **recipe)
    indexer = it.new_indexer(model, geo, layer, cfg, seed=0)
    it.lift_offsets(indexer, held[layer], 4)
    return indexer, cfg


def test_the_anchor_adds_its_weight_times_the_kl_from_the_start(llama_samples):
    model, geo, _, held, _ = llama_samples
    start, _ = _oracle_start(model, geo, held)
    moved = copy.deepcopy(start)
    with torch.no_grad():
        moved.q.weight.add_(0.5 * torch.randn(moved.q.weight.shape, generator=torch.Generator().manual_seed(1)))
    s, idx, window = held[3], torch.tensor([0, 1]), 4
    plain = it._batch_loss(moved, s, idx, window)
    # Independently: KL(start's softmax ‖ moved's) over each row's entries older than the window, mean over rows.
    with torch.no_grad():
        kls = []
        for i in idx.tolist():
            rows = s.rows[i]
            older = torch.arange(s.k.shape[1])[None] <= rows[:, None] - window
            p, q = (LightningIndexer.scores(*ix.queries(s.x[i:i + 1], s.cos[:, rows], s.sin[:, rows]),
                                            ix.keys(s.k[i:i + 1], s.cos, s.sin))[0].double()
                    .masked_fill(~older, float("-inf")).log_softmax(-1) for ix in (start, moved))
            kls.append(torch.where(older, p.exp() * (p - q), 0.0).sum(-1))
        want = float(torch.cat(kls).mean())
    assert want > 1e-3  # the perturbation moved the distribution: the check below can fail
    anchored = it._batch_loss(moved, s, idx, window, start=start, anchor=3.0)
    assert float((anchored - plain).detach()) == pytest.approx(3.0 * want, rel=1e-4)  # float32 sums over ~90 entries
    same = it._batch_loss(moved, s, idx, window, start=moved, anchor=3.0)
    # float32: an anchor at the start itself adds exact zeros; what differs is rounding of an O(1) loss: a few
    # eps32, << 1e-6
    assert float(same.detach()) == pytest.approx(float(plain.detach()), abs=1e-6)


def test_an_anchored_indexer_stays_nearer_its_start(llama_samples):
    """The trust region: with the anchor, the trained scores' distribution stays nearer the start's (held out)."""
    model, geo, train, held, _ = llama_samples
    everything = torch.arange(held[3].k.shape[0])
    from_start, attention_kl = {}, {}
    for anchor in (0.0, 30.0):
        cfg = dataclasses.replace(CFG, anchor=anchor)  # a random start, which training moves far (test above)
        indexer = it.new_indexer(model, geo, 3, cfg, seed=0)
        start = copy.deepcopy(indexer)
        it.fit(indexer, train[3], cfg, 4, seed=0)
        with torch.no_grad():
            attention_kl[anchor] = float(it._batch_loss(indexer, held[3], everything, 4))
            # KL(start ‖ trained): the anchor term at weight 1 (its formula is checked above)
            from_start[anchor] = float(it._batch_loss(indexer, held[3], everything, 4, start=start, anchor=1.0)) \
                - attention_kl[anchor]
    assert 0 < from_start[30.0] < 0.5 * from_start[0.0], (from_start, attention_kl)
    assert attention_kl[30.0] > attention_kl[0.0]  # what the trust region costs: less of the attention imitated
    with pytest.raises(ValueError, match="anchor >= 0"):
        IndexerConfig(anchor=-1.0)
