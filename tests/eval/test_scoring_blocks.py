"""Blockwise scoring: only scored positions reach the LM head, a block at a time, with the whole-batch figures."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_llama, tiny_params
from tiny_maps import (
    LENGTHS,
    LLAMA_PLAN,
    random_parts,
    rows,
)

from ced_csa2.eval import scoring
from ced_csa2.eval.scoring import (
    BLOCK_TOKENS,
    continuation_logprob,
    head_logits,
    multi_group_nll,
    score_hidden,
    sequence_nll,
)
from ced_csa2.model_utils import geometry

BLOCKS = (1, 2, 7, 10_000)  # one position, a few, unaligned with the batches, more than a whole batch


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def llama(request):
    return tiny_llama().to(request.param)


def unblocked(model, seqs, cut):
    """Per-sequence summed NLL and count from the model's own full (1, T, vocab) logits, in float64, and the
    largest |logit|."""
    out, largest = [], 0.0
    with torch.no_grad():
        for s, c in zip(seqs, cut):
            logits = model(torch.tensor([s])).logits[0, :-1].double()
            largest = max(largest, logits.abs().max().item())
            nll = -torch.log_softmax(logits, -1).gather(-1, torch.tensor(s[1:])[:, None])[:, 0][max(1, c) - 1:]
            out.append([nll.sum().item(), len(nll)])
    return torch.tensor(out, dtype=torch.float64), largest


def tolerance(model, largest: float) -> float:
    """Per-token NLL tolerance.  The LM head's matmul over other rows may round a logit to a neighbour in the
    compute dtype (two units in the last place of the largest |logit|), which moves the NLL by at most twice
    that; the fp32 log-softmax adds a few fp32 units of log(vocab)."""
    vocab = model.config.vocab_size
    return 2 * 2 * torch.finfo(model.dtype).eps * largest + 16 * torch.finfo(torch.float32).eps * math.log(vocab)


@pytest.mark.parametrize("block", BLOCKS)
def test_blockwise_nll_is_the_unblocked_nll(llama, block):
    seqs, cut = rows(300)
    got = sequence_nll(llama, seqs, cut, 3, block_tokens=block)
    want, largest = unblocked(llama, seqs, cut)
    assert torch.equal(got[:, 1], want[:, 1])
    assert ((got[:, 0] - want[:, 0]).abs() <= tolerance(llama, largest) * want[:, 1]).all(), got[:, 0] - want[:, 0]


def test_block_size_moves_scores_by_rounding_only(llama):
    seqs, cut = rows(300)
    parts = random_parts(geometry(llama.config), LLAMA_PLAN)
    groups = ("baseline", "ced", "csa2_fp4")
    runs = [multi_group_nll(llama, LLAMA_PLAN, groups, parts, seqs, cut, 3, 0, kv_format="nvfp4", agreement=True,
                            block_tokens=b) for b in BLOCKS]
    tol = tolerance(llama, unblocked(llama, seqs, cut)[1]) * max(LENGTHS)
    for run in runs[1:]:
        for g in groups:
            torch.testing.assert_close(run[g][:, :3], runs[0][g][:, :3], rtol=0, atol=tol)
            assert torch.equal(run[g][:, 1], runs[0][g][:, 1])
            # top-1 agreement may flip only at a near-tie: at most one token per sequence here
            assert (run[g][:, 3] - runs[0][g][:, 3]).abs().max() <= 1
    for run in runs:  # the baseline against itself, in every block size
        assert (run["baseline"][:, 2] == 0).all() and torch.equal(run["baseline"][:, 3], run["baseline"][:, 1])


@pytest.mark.parametrize("block", BLOCKS)
def test_kl_and_top1_match_an_independent_float64_computation(block):
    model = tiny_llama()
    g = torch.Generator().manual_seed(3)
    B, T, H = 3, 11, model.config.hidden_size
    base = torch.randn(B, T, H, generator=g)
    other = base + 0.3 * torch.randn(B, T, H, generator=g)
    targets = torch.randint(0, model.config.vocab_size, (B, T), generator=g)
    keep = torch.rand(B, T, generator=g) > 0.3
    out = {k: torch.zeros(B, 4, dtype=torch.float64) for k in ("base", "other")}
    with torch.no_grad():
        score_hidden(model, out, 0, {"base": base, "other": other}, targets, keep, block, reference="base")
        lp = torch.log_softmax(head_logits(model, base).double(), -1)  # (B, T, vocab), float64 throughout
        lq = torch.log_softmax(head_logits(model, other).double(), -1)
    kl = F.kl_div(lq, lp, log_target=True, reduction="none").sum(-1)  # KL(base ‖ other) per position
    nll = -lq.gather(-1, targets[..., None])[..., 0]
    agree = lp.argmax(-1) == lq.argmax(-1)
    k = keep.double()
    # float32 NLL sums (|log p| <~ log V per token, 8 tokens) against float64: ~8 × 4 eps32 × log V ≈ 2e-5 absolute
    # at worst, 1e-6 relative of sums ~40
    torch.testing.assert_close(out["other"][:, 0], (nll * k).sum(1), rtol=1e-6, atol=1e-5)
    # KL from float32 terms Σ p x - logsumexp x against float64: a few eps32 × |logit| per token (~1e-6), against KL
    # sums >= 1e-3 (checked below)
    torch.testing.assert_close(out["other"][:, 2], (kl * k).sum(1), rtol=1e-4, atol=1e-5)
    assert torch.equal(out["other"][:, 3], (agree & keep).sum(1).double())
    assert torch.equal(out["other"][:, 1], keep.sum(1).double())
    assert (out["other"][:, 2] > 1e-3).all()  # the perturbation moves every row's distribution
    assert (out["base"][:, 2] == 0).all() and torch.equal(out["base"][:, 3], out["base"][:, 1])


class HeadRows:
    """Counts the rows that reach the LM head, and the largest call."""

    def __init__(self, model):
        self.rows, self.largest, self.shapes = 0, 0, set()
        self.handle = model.get_output_embeddings().register_forward_pre_hook(self)

    def __call__(self, module, args):
        x = args[0]
        self.shapes.add(x.dim())
        n = x.reshape(-1, x.shape[-1]).shape[0]
        self.rows += n
        self.largest = max(self.largest, n)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def scored_tokens(cut, lengths=LENGTHS):
    return sum(max(0, n - max(1, c)) for n, c in zip(lengths, cut))


@pytest.mark.parametrize("block", [1, 5, 10_000])
def test_the_lm_head_sees_only_scored_positions(block):
    model = tiny_llama()
    seqs, cut = rows(300)  # gold-style cuts: prompts and pads are never scored
    n = scored_tokens(cut)
    assert n < sum(LENGTHS) - len(LENGTHS)  # some positions are not scored
    with HeadRows(model) as seen:
        sequence_nll(model, seqs, cut, 3, block_tokens=block)
    per_batch = [scored_tokens(cut[i:i + 3], LENGTHS[i:i + 3]) for i in range(0, len(LENGTHS), 3)]
    assert seen.rows == n and seen.largest == min(block, max(per_batch)) and seen.shapes == {2}
    parts = random_parts(geometry(model.config), LLAMA_PLAN)
    groups = ("baseline", "ced", "share_plain")
    for agreement in (False, True):  # with agreement the baseline's block is the reference: once, not twice
        with HeadRows(model) as seen:
            multi_group_nll(model, LLAMA_PLAN, groups, parts, seqs, cut, 3, 0, kv_format=None, agreement=agreement,
                            block_tokens=block)
        assert seen.rows == len(groups) * n and seen.largest <= block


def test_continuation_logprob_is_the_full_log_softmax():
    model = tiny_llama()
    g = torch.Generator().manual_seed(4)
    hidden, targets = torch.randn(9, model.config.hidden_size, generator=g), torch.randint(0, 300, (9,), generator=g)
    with torch.no_grad():
        logp = torch.log_softmax(head_logits(model, hidden).double(), -1)
    want = logp.gather(-1, targets[:, None]).sum().item()
    for block in BLOCKS:
        total, greedy = continuation_logprob(model, hidden, targets, block)
        # float32 log-softmax per block against the whole continuation's: a few eps32 of |log p| per token, << 1e-6
        # of the sum
        assert total == pytest.approx(want, rel=1e-6) and greedy is False
    greedy_targets = logp.argmax(-1)
    assert continuation_logprob(model, hidden, greedy_targets, 2)[1] is True


def test_block_tokens_must_be_positive_and_the_default_is_the_configs():
    assert tiny_params().eval_ppl.score_block_tokens == BLOCK_TOKENS
    model = tiny_llama()
    with pytest.raises(ValueError, match="block_tokens must be positive"):
        sequence_nll(model, [[1, 2, 3]], [0], 1, block_tokens=0)


def test_kl_through_the_head_weight_is_the_per_label_pass_over_the_logits(monkeypatch):
    # fp32 linear head: each label's Σ p x is (pᵀ W)·h; the unoptimised pass over its logits (_dot) agrees
    model = tiny_llama()
    assert scoring._linear_head_weight(model) is model.get_output_embeddings().weight
    g = torch.Generator().manual_seed(4)
    B, T, H = 3, 11, model.config.hidden_size
    base = 30 * torch.randn(B, T, H, generator=g)  # logits of tens, as a trained model's
    hidden = {"base": base, "near": base + 0.3 * torch.randn(B, T, H, generator=g),
              "far": base + 10 * torch.randn(B, T, H, generator=g)}
    targets = torch.randint(0, model.config.vocab_size, (B, T), generator=g)
    keep = torch.rand(B, T, generator=g) > 0.3

    def score():
        out = {k: torch.zeros(B, 4, dtype=torch.float64) for k in hidden}
        score_hidden(model, out, 0, hidden, targets, keep, 5, reference="base")
        return out

    fused = score()
    with torch.no_grad():
        largest = max(head_logits(model, h).abs().max().item() for h in hidden.values())
    monkeypatch.setattr(scoring, "_linear_head_weight", lambda model: None)
    per_label = score()
    for k in hidden:
        assert torch.equal(fused[k][:, [0, 1, 3]], per_label[k][:, [0, 1, 3]])  # NLL, counts, top-1: same ops
        # Σ p x summed over the vocabulary (or the hidden size) in fp32: a few units of the largest |logit| per token
        n = fused[k][:, 1]
        assert ((fused[k][:, 2] - per_label[k][:, 2]).abs() <= 8 * torch.finfo(torch.float32).eps * largest * n).all()
        assert k == "base" or (fused[k][:, 2] > 1e-3).all()
    assert (fused["base"][:, 2] == 0).all()  # the reference against itself: 0 exactly, on both paths


def test_kl_falls_back_to_the_logits_for_softcapped_biased_or_bf16_heads():
    model = tiny_llama()
    model.config.final_logit_softcapping = 30.0
    assert scoring._linear_head_weight(model) is None
    assert scoring._linear_head_weight(tiny_llama().to(torch.bfloat16)) is None
