"""The Mode A lm-eval LM: lm-eval's requests answered through the prefill skip."""

import pytest
import torch
from conftest import tiny_llama
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from tiny_maps import (
    QWEN_PLAN,
    random_parts,
    true_kv,
)

from ced_csa2.ced_runtime import CEDModeARuntime, CEDParts
from ced_csa2.eval.lm_eval_models import ModeALM
from ced_csa2.model_utils import geometry
from ced_csa2.plan import LayerPlan

LLAMA_COVERING = LayerPlan(2, 3, (5,), (4, 6))
CONTEXTS = ["Question: 12 apples and 7 pears?\nAnswer:", "The river flows", "ab"]
CONTINUATIONS = [" 19 fruit", " into the sea.", " cd"]


def true_maps(model, plan) -> CEDParts:
    """Maps that return the true K/V of the prompt being prefilled: the identity substitution.

    A pre-hook on the decoder notes the ids of each prefill; every map then reads the true
    K/V of its layer for those ids from a plain forward.
    """
    seen = {}
    model.model.register_forward_pre_hook(lambda m, a, kw: seen.__setitem__("ids", kw["input_ids"]), with_kwargs=True)

    def kv(layer):
        return true_kv(model, seen["ids"], [layer])[layer]

    return CEDParts(projector=lambda h: kv(plan.source), adapters=lambda layer, k, v: kv(layer),
                    extra={e: (lambda h, e=e: kv(e)) for e in plan.extra_sources})


def ll_requests():
    return [Instance("loglikelihood", {}, (c, x), i) for i, (c, x) in enumerate(zip(CONTEXTS, CONTINUATIONS))]


def gen_requests(max_gen_toks=12):
    return [Instance("generate_until", {}, (c, {"until": ["\n\n", "Question:"], "max_gen_toks": max_gen_toks,
                                                  "do_sample": False}), i) for i, c in enumerate(CONTEXTS)]


@pytest.fixture(scope="module")
def llama_and_tok(tiny_model):
    tok = tiny_model[1]
    model = tiny_llama()
    assert len(tok) <= model.config.vocab_size
    return model, tok


def test_true_maps_give_the_baselines_loglikelihoods_and_greedy_outputs(llama_and_tok):
    model, tok = llama_and_tok
    geo = geometry(model.config)
    base = HFLM(pretrained=model, tokenizer=tok, batch_size=1)
    want_ll, want_gen = base.loglikelihood(ll_requests()), base.generate_until(gen_requests())
    lm = ModeALM(CEDModeARuntime(model, LLAMA_COVERING.validate(geo), geo, true_maps(model, LLAMA_COVERING)), tok)
    got_ll, got_gen = lm.loglikelihood(ll_requests()), lm.generate_until(gen_requests())
    for (g, g_greedy), (w, w_greedy) in zip(got_ll, want_ll):
        # float32 log-likelihoods of one continuation through two code paths (a Mode A runtime and the plain model):
        # FORWARD32's 96 eps relative, ~1e-5, also absolute for sums near 0
        assert g == pytest.approx(w, rel=1e-5, abs=1e-5) and g_greedy == w_greedy
    assert got_gen == want_gen and any(got_gen)
    # Wrong maps move both.
    wrong = ModeALM(CEDModeARuntime(model, LLAMA_COVERING, geo, random_parts(geo, LLAMA_COVERING)), tok)
    assert all(abs(g - w) > 1e-3 for (g, _), (w, _) in zip(wrong.loglikelihood(ll_requests()), want_ll))


def test_on_hybrid_qwen3_5_each_request_is_the_runtimes_own_computation(tiny_model):
    """GatedDeltaNet layers above the cut start from zero (Mode A's stated approximation), so
    the reference is the runtime itself: the LM adds lm-eval's requests and nothing else."""
    model, tok = tiny_model
    geo = geometry(model.config)
    runtime = CEDModeARuntime(model, QWEN_PLAN, geo, random_parts(geo, QWEN_PLAN))
    lm = ModeALM(runtime, tok)
    got = lm.loglikelihood(ll_requests())
    for (ll, greedy), c, x in zip(got, CONTEXTS, CONTINUATIONS):
        ctx, whole = lm.tok_encode(c), lm.tok_encode(c + x)
        prompt, cont = torch.tensor([ctx]), torch.tensor([whole[len(ctx):]])
        logp = torch.log_softmax(runtime.continuation_logits(prompt, cont)[0].float(), -1)
        # the same float32 continuation logits, summed in float64 on one side and Python floats on the other: a few
        # float32 eps of |log p| per token, well inside 1e-6 relative of the sum
        assert ll == pytest.approx(logp.gather(-1, cont[0, :, None]).sum().item(), rel=1e-6)
        assert greedy == bool((logp.argmax(-1) == cont[0]).all())
    [text] = lm.generate_until(gen_requests(6)[:1])
    new = runtime.generate(torch.tensor([lm.tok_encode(CONTEXTS[0])]), 6)[0].tolist()
    assert text == lm.tok_decode(new).split("\n\n")[0].split("Question:")[0]


def test_sampling_and_short_contexts_are_refused(llama_and_tok):
    model, tok = llama_and_tok
    geo = geometry(model.config)
    lm = ModeALM(CEDModeARuntime(model, LLAMA_COVERING, geo, random_parts(geo, LLAMA_COVERING)), tok)
    with pytest.raises(ValueError, match="decodes greedily"):
        lm._model_generate(torch.tensor([[1, 2, 3]]), 8, [], do_sample=True)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        lm._loglikelihood_tokens([(None, [5], [6, 7])])
