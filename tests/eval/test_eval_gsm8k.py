"""The eval_gsm8k stage runs lm-eval's gsm8k offline per group; Wilson CI and gold NLL are exact."""

import dataclasses
import json
import math

import pytest
import torch
from conftest import tiny_params
from tiny_maps import (
    random_parts,
)

from ced_csa2.ced_runtime import CEDModeARuntime
from ced_csa2.data import corpus
from ced_csa2.eval import gsm8k
from ced_csa2.model_utils import geometry
from ced_csa2.pipeline import paths
from ced_csa2.plan import LayerPlan, load_plan
from ced_csa2.groups import GROUPS
from ced_csa2.stages import eval_gsm8k, gold_pairs

# Short on purpose: the tiny model's tokenizer is byte-level and its GatedDeltaNet
# layers run the slow reference kernels, so prompt length is what the test pays for.
PROBLEMS = [
    {"id": f"p{i}", "question": q, "answer": a, "target": a.rsplit("#### ", 1)[1]}
    for i, (q, a) in enumerate([
        ("Ada has 2 cats and 3 dogs. Pets?", "2 + 3 = 5\n#### 5"),
        ("Ben buys 4 pens twice. Pens?", "4 * 2 = 8\n#### 8"),
        ("Eve had 9 figs, ate 6. Left?", "9 - 6 = 3\n#### 3"),
        ("Hugo reads 7 pages and 7 more. Pages?", "7 + 7 = 14\n#### 14"),
    ])
]


def write_problems(workdir, problems=PROBLEMS):
    """``problems`` as the math set, recorded (as prepare records it) for the tiny profile's ``data.math``."""
    corpus.write_prepared(tiny_params(), workdir, paths.GSM8K_JSONL, "".join(json.dumps(p) + "\n" for p in problems))
    return workdir / paths.GSM8K_JSONL


def independent_gold_nll(model, tok, problems):
    """Per-token NLL of ' ' + answer after 'Question: {q}\\nAnswer:', one problem at a time."""
    total, n = 0.0, 0
    for p in problems:
        prompt = f"Question: {p['question']}\nAnswer:"
        ids = tok(prompt + " " + p["answer"], return_tensors="pt")["input_ids"]
        cut = len(tok(prompt)["input_ids"])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
        targets = ids[0, cut:]
        total -= logp[cut - 1:-1].gather(1, targets[:, None]).sum().item()
        n += len(targets)
    return total / n, n


@pytest.mark.parametrize("successes, n, low, high", [
    # by hand: centre = (p + z²/2n) / (1 + z²/n), half = z/(1 + z²/n) * sqrt(p(1-p)/n + z²/4n²), z = 1.96
    (0, 100, 0.0, 0.036995),      # centre = half = 0.0184974
    (50, 100, 0.403830, 0.596170),  # centre 0.5, half 1.887487 * 0.0509520 = 0.0961702
    (5, 5, 0.565509, 1.0),        # centre 0.782754, half 0.217246; clipped at 1
])
def test_wilson_interval_matches_hand_computation(successes, n, low, high):
    got = gsm8k.wilson_interval(successes, n)
    # the hand values are given to 6 decimals; the interval itself is float64 arithmetic
    assert got == pytest.approx((low, high), abs=1e-6)


def test_wilson_interval_refuses_empty_or_impossible_counts():
    with pytest.raises(ValueError, match="n > 0"):
        gsm8k.wilson_interval(0, 0)
    with pytest.raises(ValueError, match="0 <= successes <= n"):
        gsm8k.wilson_interval(6, 5)


def test_fewshot_context_uses_fixed_exemplars_never_evaluated_problems(tmp_path):
    from lm_eval.tasks import TaskManager

    data = write_problems(tmp_path)
    gsm8k.write_task_yaml(tmp_path, data, num_fewshot=2)
    manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
    task = manager.load([gsm8k.TASK])["tasks"][gsm8k.TASK]
    docs = list(task.test_docs())
    assert [d["question"] for d in docs] == [p["question"] for p in PROBLEMS]
    exemplars = gsm8k.fewshot_exemplars()
    assert len(exemplars) == 8 and all(e["answer"].split("\n")[-1].startswith("#### ") for e in exemplars)
    context = task.fewshot_context(docs[1], num_fewshot=2)
    assert context == (f"Question: {exemplars[0]['question']}\nAnswer: {exemplars[0]['answer']}\n\n"
                       f"Question: {exemplars[1]['question']}\nAnswer: {exemplars[1]['answer']}\n\n"
                       f"Question: {PROBLEMS[1]['question']}\nAnswer:")


def test_missing_math_set_names_the_prepare_stage(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"dvc repro prepare"):
        eval_gsm8k.run(tiny_params(), tmp_path)


def test_gold_pairs_stage_builds_lm_eval_prompts_from_the_tokenizer_alone(tmp_path, tiny_model):
    """The pairs gold_pairs writes (no model) are those lm-eval's HFLM builds while generating (2-shot here)."""
    model, tok = tiny_model
    data = write_problems(tmp_path)
    params = tiny_params(eval_gsm8k={"num_fewshot": 2, "groups": ["baseline"], "generate": ["baseline"]})
    with pytest.raises(FileNotFoundError, match=r"gsm8k_gold.json not found: run `dvc repro gold_pairs`"):
        eval_gsm8k.run(params, tmp_path, model_and_tok=(model, tok))

    pairs = gold_pairs.run(params, tmp_path)

    assert gsm8k.load_gold_pairs(tmp_path / paths.GOLD_PATH, params) == pairs
    with gsm8k.local_task(data, params.eval_gsm8k.num_fewshot) as manager:
        _, generated = gsm8k.evaluate_lm(scripted_lm(model, tok, _gold), manager, params, "baseline")
    assert generated == pairs and len(pairs) == len(PROBLEMS)
    exemplar = gsm8k.fewshot_exemplars()[0]["question"]
    assert all(tok.decode(ids[:cut]).startswith(f"Question: {exemplar}") and cut < len(ids) for ids, cut in pairs)


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_chat_template_and_multiturn_shape_generation_and_gold_pairs_alike(tmp_path, tiny_model):
    """eval_gsm8k.apply_chat_template / fewshot_as_multiturn reach lm-eval: each exemplar a turn, the same pairs."""
    model, tok = tiny_model
    data = write_problems(tmp_path)
    params = tiny_params(eval_gsm8k={"num_fewshot": 2, "apply_chat_template": True, "fewshot_as_multiturn": True,
                                     "groups": ["baseline"], "generate": ["baseline"]})
    with pytest.raises(ValueError, match=r"apply_chat_template is true, but model .* has no chat template"):
        gsm8k.check_chat_template(_without_template(tok), params)
    chat_tok = _with_template(tok)
    with gsm8k.local_task(data, 2) as manager:
        pairs = gsm8k.prompt_pairs(chat_tok, manager, params)
        _, generated = gsm8k.evaluate_lm(scripted_lm(model, chat_tok, _gold), manager, params, "baseline")
        plain = gsm8k.prompt_pairs(chat_tok, manager, tiny_params(eval_gsm8k={"num_fewshot": 2}))
    assert generated == pairs and len(pairs) == len(PROBLEMS) and pairs != plain
    prompt = chat_tok.decode(pairs[0][0][:pairs[0][1]])
    # two exemplars as user/assistant turns, then the question, then the assistant's turn opens
    assert prompt.count("<|user|>") == 3 and prompt.count("<|assistant|>") == 3 and prompt.endswith("<|assistant|>")
    assert PROBLEMS[0]["question"] in prompt.rsplit("<|user|>", 1)[1]


def test_gold_pairs_tokenise_as_lm_eval_loglikelihood_requests(tmp_path, tiny_model):
    """The answer follows the delimiter without a chat template, and directly the assistant's turn with one;
    a prompt's trailing whitespace (the template's newline) moves into the continuation, as lm-eval's requests do."""
    _, tok = tiny_model
    data = write_problems(tmp_path)
    newline = _with_template(tok, CHAT_TEMPLATE.replace("<|assistant|>{% endif %}", "<|assistant|>\n{% endif %}"))
    with gsm8k.local_task(data, 0) as manager:
        plain = gsm8k.prompt_pairs(tok, manager, tiny_params())
        chat = gsm8k.prompt_pairs(newline, manager, tiny_params(eval_gsm8k={"apply_chat_template": True}))
    for (ids, cut), (chat_ids, chat_cut), problem in zip(plain, chat, PROBLEMS, strict=True):
        assert tok.decode(ids[:cut]).endswith("Answer:") and tok.decode(ids[cut:]) == " " + problem["answer"]
        assert newline.decode(chat_ids[:chat_cut]).endswith("<|assistant|>")
        assert newline.decode(chat_ids[chat_cut:]) == "\n" + problem["answer"]


def test_gold_pairs_of_another_math_set_or_size_are_refused(tmp_path, tiny_model):
    _, tok = tiny_model
    write_problems(tmp_path)
    params = tiny_params()
    pairs = gold_pairs.run(params, tmp_path)
    path = tmp_path / paths.GOLD_PATH
    assert gsm8k.load_gold_pairs(path, params, len(PROBLEMS)) == pairs
    with pytest.raises(ValueError, match=r"gsm8k_gold.json holds 4 gold pairs for a math set of 5 problems"):
        gsm8k.load_gold_pairs(path, params, len(PROBLEMS) + 1)
    other = dataclasses.replace(params, data=dataclasses.replace(
        params.data, math=dataclasses.replace(params.data.math, label="GSM8K-other")))
    with pytest.raises(ValueError, match=r"gsm8k_gold.json was written for .*'math_set'"):
        gsm8k.load_gold_pairs(path, other)


def _with_template(tok, template=CHAT_TEMPLATE):
    import copy

    out = copy.deepcopy(tok)
    out.chat_template = template
    return out


def _without_template(tok):
    import copy

    out = copy.deepcopy(tok)
    out.chat_template = None
    return out


def test_gold_nll_without_generation(tmp_path, tiny_model):
    """eval_gsm8k.generate may be empty: gold NLL on the saved pairs, no exact match."""
    model, tok = tiny_model
    write_problems(tmp_path, PROBLEMS[:2])
    params = tiny_params(eval_gsm8k={"groups": ["baseline"], "generate": [], "mode_a": "off", "batch_size": 2})
    pairs = gold_pairs.run(params, tmp_path)
    m = eval_gsm8k.run(params, tmp_path, model_and_tok=(model, tok))
    assert m["groups"] == {"baseline": {"gold_nll": gsm8k.gold_nll(model, pairs, 2, tok.pad_token_id)}}


def test_stage_end_to_end_two_groups(tmp_path, tiny_model):
    model, tok = tiny_model
    write_problems(tmp_path)
    params = tiny_params(eval_gsm8k={"groups": ["baseline", "ced"], "generate": ["baseline", "ced"],
                                     "max_gen_toks": 8, "batch_size": 4, "mode_a": "generate"})
    parts = random_parts(geometry(model.config), LayerPlan(16, 20, (24, 28, 32)))
    gold_pairs.run(params, tmp_path)
    m = eval_gsm8k.run(params, tmp_path, parts=parts, model_and_tok=(model, tok))

    assert json.loads((tmp_path / paths.GSM8K_METRICS).read_text()) == json.loads(json.dumps(m))
    proto = m["protocol"]
    assert proto["n"] == len(PROBLEMS) and proto["math_set"] == params.data.math.label
    assert proto["num_fewshot"] == 0 and proto["max_gen_toks"] == 8 and proto["lm_eval"]
    assert list(m["groups"]) == ["baseline", "ced"]
    for g in m["groups"].values():
        for name in gsm8k.FILTERS:
            acc = g[name]
            assert acc["n"] == len(PROBLEMS) and acc["correct"] == round(acc["exact_match"] * len(PROBLEMS))
            assert acc["ci95"] == pytest.approx(list(gsm8k.wilson_interval(acc["correct"], acc["n"])))

    nll, tokens = independent_gold_nll(model, tok, PROBLEMS)
    base = m["groups"]["baseline"]["gold_nll"]
    assert base["tokens"] == tokens
    assert math.isclose(base["nll_per_token"], nll, rel_tol=1e-5)
    assert abs(m["groups"]["ced"]["gold_nll"]["nll_per_token"] - nll) > 1e-4
    assert all(not mod._forward_hooks for mod in model.modules())

    # The gold pairs (every generated group's prompts) reproduce the baseline's gold NLL without lm-eval.
    pairs = gsm8k.load_gold_pairs(tmp_path / paths.GOLD_PATH, params)
    assert len(pairs) == len(PROBLEMS)
    assert gsm8k.gold_nll(model, pairs, 4, tok.pad_token_id) == base
    other = tiny_params(eval_gsm8k={"num_fewshot": 2})
    with pytest.raises(ValueError, match=r"gsm8k_gold.json was written for .*num_fewshot"):
        gsm8k.load_gold_pairs(tmp_path / paths.GOLD_PATH, other)

    # Mode A (the plan covers): lm-eval's task through the prefill skip, gold NLL paired with the baseline.
    a = m["mode_a"]
    assert a["covered"] and "zero state" in a["note"]
    assert all(a[name]["n"] == len(PROBLEMS) for name in gsm8k.FILTERS)
    runtime = CEDModeARuntime(model, LayerPlan(16, 20, (24, 28, 32)), geometry(model.config), parts,
                              sink=params.mode_a.sink)
    total = 0.0
    for ids, c in pairs:  # independent: the runtime's own logits for each gold answer
        x = torch.tensor([ids])
        logp = torch.log_softmax(runtime.continuation_logits(x[:, :c], x[:, c:])[0].float(), -1)
        total -= logp.gather(-1, x[0, c:, None]).sum().item()
    assert a["gold_nll"]["tokens"] == tokens
    assert math.isclose(a["gold_nll"]["nll_per_token"], total / tokens, rel_tol=1e-5)
    assert a["gold_nll"]["delta"] == pytest.approx(a["gold_nll"]["nll_per_token"] - base["nll_per_token"])
    assert a["gold_nll"]["delta_ci95"][0] <= a["gold_nll"]["delta"] <= a["gold_nll"]["delta_ci95"][1]

    def with_mode_a(setting):
        return eval_gsm8k.run(dataclasses.replace(params, eval_gsm8k=dataclasses.replace(params.eval_gsm8k,
                                                                                           mode_a=setting)),
                              tmp_path, parts=parts, model_and_tok=(model, tok))

    gold_only = with_mode_a("gold_nll")["mode_a"]
    assert gold_only["gold_nll"] == a["gold_nll"] and not set(gsm8k.FILTERS) & set(gold_only)
    assert with_mode_a("off")["mode_a"] == {"covered": None, "note": "eval_gsm8k.mode_a is off"}


def test_each_group_generates_through_the_cache_that_holds_its_bytes(tmp_path, tiny_model):
    """lm-eval's left-padded batches run on each group's own cache (the entry names it; bytes are checked per
    batch), and the dense shared store writes exactly the text Mode B's substitution writes on a DynamicCache."""
    from lm_eval.tasks import TaskManager

    from ced_csa2.ced_runtime import CEDModeBRuntime
    from ced_csa2.eval.lm_eval_models import DataParallelLM

    model, tok = tiny_model
    write_problems(tmp_path)
    groups = ["baseline", "csa2", "csa2_fp4"]
    params = tiny_params(eval_gsm8k={"groups": groups, "generate": groups, "max_gen_toks": 4, "batch_size": 4,
                                     "mode_a": "off"})
    plan = LayerPlan(16, 20, (24, 28, 32))
    parts = random_parts(geometry(model.config), plan)
    gold_pairs.run(params, tmp_path)
    m = eval_gsm8k.run(params, tmp_path, parts=parts, model_and_tok=(model, tok))
    assert {g: m["groups"][g]["cache"] for g in groups} == {
        "baseline": "DynamicCache", "csa2": "SharedKVCache(bf16)", "csa2_fp4": "SharedKVCache(nvfp4)"}
    assert "its used bytes checked" in m["protocol"]["generation"]

    task_dir = tmp_path / "task"
    task_dir.mkdir()
    gsm8k.write_task_yaml(task_dir, tmp_path / paths.GSM8K_JSONL, params.eval_gsm8k.num_fewshot)
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    lm = DataParallelLM(pretrained=model, tokenizer=tok, batch_size=4)
    with CEDModeBRuntime(model, plan, "csa2", parts, kv_format=None):  # substitution, every layer its own copy
        substituted, _ = gsm8k.evaluate_lm(lm, manager, params, "csa2")
    assert substituted["generations_sha256"] == m["groups"]["csa2"]["generations_sha256"]


# ----------------------------------------------------------------------------- exact match through lm-eval's filters

def _gold(answer: str, doc_id: int) -> str:
    return answer  # GSM8K format: '... <<a+b=c>>c ...\n#### c'


def _off_by_one(answer: str, doc_id: int) -> str:
    body, n = answer.rsplit("#### ", 1)
    return f"{body}#### {int(n) + 1}"


def _last_number_only(answer: str, doc_id: int) -> str:
    body, n = answer.rsplit("\n#### ", 1)
    return f"{body}\nSo the answer is {n}."  # right last number, no '#### N' line


def _even_gold_odd_off(answer: str, doc_id: int) -> str:
    return (_gold if doc_id % 2 == 0 else _off_by_one)(answer, doc_id)


def scripted_lm(model, tok, reply):
    """The stage's ``DataParallelLM`` (lm-eval's ``HFLM``) over ``model``, except that ``generate_until`` answers
    each request with ``reply(gold answer, doc_id)``; log-likelihood and tokenisation stay HFLM's."""
    from ced_csa2.eval.lm_eval_models import DataParallelLM

    class ScriptedLM(DataParallelLM):
        def generate_until(self, requests, disable_tqdm=False):
            self.requests = list(requests)
            return [reply(r.doc["answer"], r.doc_id) for r in requests]

    return ScriptedLM(pretrained=model, tokenizer=tok, batch_size=4)


# Wilson 95% at n = 6, by hand (z = 1.96): 0/6 and 6/6: half = 0.1951715 around centre 0.1951715
# (resp. 0.8048285); 3/6: centre 0.5, half 0.3123872.
WILSON_6 = {0: [0.0, 0.390343], 3: [0.187613, 0.812387], 6: [0.609657, 1.0]}


@pytest.mark.parametrize("reply, strict, flexible", [
    (_gold, 6, 6),
    (_off_by_one, 0, 0),
    (_last_number_only, 0, 6),
    (_even_gold_odd_off, 3, 3),
], ids=["gold", "off_by_one", "last_number_only", "half_right"])
def test_exact_match_through_lm_eval_filters(tmp_path, tiny_model, reply, strict, flexible):
    """Scripted generations through the stage's own lm-eval path: strict-match wants '#### N',
    flexible-extract the last number; counts, exact_match and Wilson CI come out per filter."""
    from lm_eval.tasks import TaskManager

    model, tok = tiny_model
    params = tiny_params(eval_gsm8k={"groups": ["baseline"], "generate": ["baseline"], "batch_size": 4})
    problems = corpus.math_problems(params.data)  # the tiny profile's math set, as `prepare` writes it
    assert len(problems) == 6 and all(p["answer"].endswith(f"#### {p['target']}") for p in problems)
    data = write_problems(tmp_path, problems)
    task_dir = tmp_path / "task"
    task_dir.mkdir()
    gsm8k.write_task_yaml(task_dir, data, params.eval_gsm8k.num_fewshot)
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    plan, _ = load_plan(params.plan, params.model)
    lm = scripted_lm(model, tok, reply)

    out, pairs = gsm8k.evaluate_group(lm, plan, "baseline", None, manager, params)

    assert sorted(r.doc_id for r in lm.requests) == list(range(6))  # every problem generated once
    for name, correct in (("strict-match", strict), ("flexible-extract", flexible)):
        acc = out[name]
        assert (acc["correct"], acc["n"]) == (correct, 6), name
        assert acc["exact_match"] == pytest.approx(correct / 6), name
        # WILSON_6 is given to 6 decimals; the interval itself is float64 arithmetic
        assert acc["ci95"] == pytest.approx(WILSON_6[correct], abs=1e-6), name
    assert len(pairs) == 6 and all(cut < len(ids) for ids, cut in pairs)


# ----------------------------------------------------------------------------- kv_format end to end

FP4_GROUPS = tuple(name for name, spec in GROUPS.items() if spec.is_fp4)  # the groups kv_format stores


def test_stage_passes_kv_format_to_every_fp4_group(tmp_path, tiny_model):
    """nvfp4 vs mxfp4 moves the FP4 groups' gold NLL, leaves baseline bit-identical, and is recorded.

    A rotated FP4 group also generates (lm-eval, cached decoding under its runtime).
    """
    model, tok = tiny_model
    write_problems(tmp_path, PROBLEMS[:2])
    params = tiny_params(eval_gsm8k={"groups": ["baseline", *FP4_GROUPS], "generate": ["baseline", "csa2_fp4_rot"],
                                     "max_gen_toks": 1, "batch_size": 2})
    parts = random_parts(geometry(model.config), LayerPlan(16, 20, (24, 28, 32)))
    gold_pairs.run(params, tmp_path)
    nll = {}
    for fmt in ("nvfp4", "mxfp4"):
        m = eval_gsm8k.run(dataclasses.replace(params, kv_format=fmt), tmp_path, parts=parts,
                           model_and_tok=(model, tok))
        assert m["protocol"]["kv_format"] == fmt
        assert json.loads((tmp_path / paths.GSM8K_METRICS).read_text())["protocol"]["kv_format"] == fmt
        nll[fmt] = {g: v["gold_nll"]["nll_per_token"] for g, v in m["groups"].items()}
    nv, mx = nll["nvfp4"], nll["mxfp4"]
    assert nv["baseline"] == mx["baseline"]
    for g in FP4_GROUPS:  # measured: |nvfp4 - mxfp4| >= 4e-5 nats/token (csa2_fp4, the smallest)
        assert abs(nv[g] - mx[g]) > 1e-6, (g, nv[g], mx[g])
