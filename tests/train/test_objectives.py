"""The objectives' losses (attn_out, distill): exact zeros where they must vanish, gradients only into the maps;
the registry's rows (:data:`~ced_csa2.train.objective_registry.OBJECTIVES`) true to their classes."""

import math
from typing import Protocol, runtime_checkable

import pytest
import torch
from tiny_maps import (
    QWEN_PLAN,
    identity_parts,
    random_parts,
)

from ced_csa2.eval.scoring import head_logits
from ced_csa2.model_utils import geometry
from ced_csa2.train.objective_registry import OBJECTIVES, TuneObjective, tune_objective
from ced_csa2.train.objectives import (
    TeacherCache,
    attn_out_loss,
    distill_loss,
    kl_distill,
    kl_from_hidden,
    kv_loss,
    map_tensors,
    substituted_layers,
    teacher_pass,
)


@runtime_checkable
class KeptOnHost(Protocol):
    """What :class:`TeacherCache` keeps in place of each tensor: the tensor on the host and the device it came from."""

    tensor: torch.Tensor
    device: torch.device


PHASES = {"ced": ("projector",), "csa2": ("adapters",), "ced_csa2": ("projector", "adapters")}
TRAINED = [name for name, o in OBJECTIVES.items() if o.trains]  # the objectives with a loss
# Each objective that trains, its row: whether its loss runs the substituted model (a student forward per loss).
RUNS_A_STUDENT = {"attn_out": False, "distill": True}


def batch(seed=0):
    """Two rows, the second right-padded by 7 tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 250, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -7:] = 0
    return ids, mask


def test_kl_distill_is_temperature_scaled_kl():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 3, 11, generator=g), torch.randn(2, 3, 11, generator=g)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    T = 2.0
    p = torch.softmax(t / T, -1)
    kl = (p * (torch.log(p) - torch.log_softmax(s / T, -1))).sum(-1)
    want = T * T * kl[mask.bool()].mean()
    # float32 KL (sum over the vocabulary, O(1)) vs the same formula in another grouping: a few eps32, << 1e-6
    assert kl_distill(s, t, mask, T).item() == pytest.approx(want.item(), rel=1e-6)
    assert kl_distill(t, t, mask, T).item() == 0.0


@pytest.mark.parametrize("block_tokens", [1, 5, 17, 1000])
def test_blockwise_kl_is_the_whole_batch_kl_without_vocabulary_wide_batches(frozen, block_tokens):
    model, _ = frozen
    ids, mask = batch()
    with torch.no_grad():
        teacher = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        student = teacher + torch.randn(teacher.shape, generator=torch.Generator().manual_seed(1))
    rows = []  # rows the LM head is run on, per call
    handle = model.get_output_embeddings().register_forward_pre_hook(lambda mod, args: rows.append(args[0].shape[:-1]))
    try:
        for temperature in (1.0, 2.0):
            whole = kl_from_hidden(model, student, teacher, mask, temperature)
            rows.clear()
            blocks = kl_from_hidden(model, student, teacher, mask, temperature, block_tokens)
            # float32 log-probabilities (|log p| up to ~log V) differenced per token: only the LM head's
            # row count and the summation order differ, a few float32 ulps of log V per token
            tol = 4 * torch.finfo(torch.float32).eps * math.log(model.config.vocab_size)
            assert blocks.item() == pytest.approx(whole.item(), abs=tol)
            assert whole.item() > 100 * tol
            real = int(mask.sum())
            assert all(len(r) == 1 and r[0] <= block_tokens for r in rows)  # (block, hidden), never (B, T, hidden)
            assert sum(r[0] for r in rows) == 2 * real  # student and teacher, the real positions only
            assert kl_from_hidden(model, teacher, teacher, mask, temperature, block_tokens).item() == 0.0
    finally:
        handle.remove()
    with pytest.raises(ValueError, match="block_tokens must be positive"):
        kl_from_hidden(model, student, teacher, mask, 1.0, 0)
    with pytest.raises(ValueError, match="the mask holds no real position"):
        kl_from_hidden(model, student, teacher, torch.zeros_like(mask), 1.0, block_tokens)


@pytest.mark.parametrize("group", ["ced", "csa2"])
def test_distill_without_substitution_is_zero_and_reaches_nothing(frozen, group):
    model, _ = frozen
    parts = random_parts(geometry(model.config), QWEN_PLAN)
    ids, mask = batch()
    teacher = teacher_pass(model, QWEN_PLAN, group, ids, mask)
    loss = distill_loss(model, parts, QWEN_PLAN, "baseline", teacher, ids, mask, temperature=2.0, kv_weight=1.0)
    assert loss.item() == 0.0
    assert not loss.requires_grad  # no graph at all: nothing can receive a gradient
    assert all(p.grad is None for p in [*parts.projector.parameters(), *parts.adapters.parameters()])


@pytest.mark.parametrize("objective", TRAINED)
@pytest.mark.parametrize("group", list(PHASES))
def test_gradients_reach_only_the_trained_maps(frozen, group, objective):
    model, _ = frozen
    parts = random_parts(geometry(model.config), QWEN_PLAN)
    trained = torch.nn.ModuleList([getattr(parts, name) for name in PHASES[group]])
    other = [p for name in {"projector", "adapters"} - set(PHASES[group]) for p in getattr(parts, name).parameters()]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    maps_before = [p.detach().clone() for p in trained.parameters()]
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-2)

    ids, mask = batch()
    # the teacher pass the registry row asks for (final_teacher) is all the loss reads
    loss = OBJECTIVES[objective].batch_loss(model, parts, QWEN_PLAN, group, ids, mask, temperature=2.0, kv_weight=0.5)
    assert loss.item() > 0
    loss.backward()
    opt.step()

    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trained.parameters() if p.dim() == 2)
    assert all(p.grad is None for p in other)
    assert all(not p.requires_grad and p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert any(not torch.equal(a, b) for a, b in zip(maps_before, trained.parameters()))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("group", list(PHASES))
def test_attn_out_and_kv_losses_vanish_for_true_kv(frozen, group):
    model, _ = frozen
    ids = batch()[0]
    mask = torch.ones_like(ids)  # the identity maps replay the K/V of exactly this batch
    teacher = teacher_pass(model, QWEN_PLAN, group, ids, mask)
    exact = identity_parts(model, ids, QWEN_PLAN)
    assert attn_out_loss(model, exact, QWEN_PLAN, group, teacher, mask).item() == 0.0
    assert kv_loss(exact, QWEN_PLAN, group, teacher, mask).item() == 0.0
    wrong = random_parts(geometry(model.config), QWEN_PLAN)
    assert attn_out_loss(model, wrong, QWEN_PLAN, group, teacher, mask).item() > 1e-3
    assert set(teacher["attn"]) == set(substituted_layers(QWEN_PLAN, group))


@pytest.mark.parametrize("group", ["ced", "csa2"])
def test_attn_out_teacher_stops_after_the_last_substituted_layer(frozen, group):
    model, _ = frozen
    ids, mask = batch()
    parts = random_parts(geometry(model.config), QWEN_PLAN)
    full = teacher_pass(model, QWEN_PLAN, group, ids, mask)
    short = teacher_pass(model, QWEN_PLAN, group, ids, mask, final=False)
    assert short["final"] is None and full["final"] is not None
    assert torch.equal(attn_out_loss(model, parts, QWEN_PLAN, group, short, mask),
                       attn_out_loss(model, parts, QWEN_PLAN, group, full, mask))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    # the model runs to the end again, and the full pass's final state is the model's own
    assert torch.equal(head_logits(model, full["final"]), model(input_ids=ids, attention_mask=mask).logits)


def test_phase_groups_are_checked():
    with pytest.raises(ValueError, match="training phase group must be one of"):
        substituted_layers(QWEN_PLAN, "share_plain")
    assert substituted_layers(QWEN_PLAN, "ced_csa2") == (QWEN_PLAN.source, *QWEN_PLAN.targets)


@pytest.mark.parametrize("objective", TRAINED)
def test_teacher_cache_gives_every_phase_its_own_pass_bit_for_bit_from_one_forward(frozen, objective):
    model, _ = frozen
    parts = random_parts(geometry(model.config), QWEN_PLAN)
    batches = [batch(0), batch(1)]
    forwards = []
    handle = model.model.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        spec = OBJECTIVES[objective]
        cache = TeacherCache(model, QWEN_PLAN, final=spec.final_teacher)
        for group in PHASES:
            for ids, mask in batches:
                cached = spec.batch_loss(model, parts, QWEN_PLAN, group, ids, mask, 2.0, 0.5, teacher=cache(ids, mask))
                n = len(forwards)
                own = spec.batch_loss(model, parts, QWEN_PLAN, group, ids, mask, 2.0, 0.5)
                forwards[n:] = []  # the uncached reference's own passes are not the cache's
                assert torch.equal(cached, own), (group, objective)
    finally:
        handle.remove()
    # one teacher pass per distinct batch (plus, for distill, the students' forwards: one per loss)
    students = len(PHASES) * len(batches) if RUNS_A_STUDENT[objective] else 0
    assert len(forwards) == len(batches) + students
    # kept on the host, each tensor with the device it came from (moved back at every read)
    leaves = []
    map_tensors(cache._passes, leaves.append, leaf=KeptOnHost)
    map_tensors(cache._passes, lambda t: pytest.fail("a teacher tensor kept unwrapped"))
    assert leaves and all(o.tensor.device.type == "cpu" and o.device == ids.device for o in leaves)
    held = TeacherCache(model, QWEN_PLAN, final=True)(*batches[0])
    assert torch.equal(head_logits(model, held["final"]),
                       model(input_ids=batches[0][0], attention_mask=batches[0][1]).logits)


def test_map_tensors_keeps_the_tree_and_reaches_every_tensor():
    from collections import namedtuple

    Pair = namedtuple("Pair", "cos sin")
    marker = object()
    tree = {"final": torch.ones(2), "kv": {"k": {3: torch.zeros(1)}}, "attn": {3: [(torch.ones(1),),
            {"position_embeddings": Pair(torch.ones(1), torch.zeros(1)), "mask": None, "other": marker}, None]}}
    seen = []
    out = map_tensors(tree, lambda t: seen.append(t) or t + 1)
    assert len(seen) == 5
    assert isinstance(out["attn"][3][1]["position_embeddings"], Pair)
    assert out["attn"][3][1]["mask"] is None and out["attn"][3][1]["other"] is marker
    assert isinstance(out["attn"][3][0], tuple) and isinstance(out["attn"][3], list)
    assert torch.equal(out["kv"]["k"][3], torch.ones(1)) and torch.equal(out["final"], torch.full((2,), 2.0))


def test_held_out_scores_each_objective_by_its_own_loss_and_refuses_one_without(frozen):
    """``tuning.held_out``'s loss is the registry objective's own (the training loss, on the held-out teacher); an
    objective that trains nothing, or a name the registry lacks, is refused rather than scored as another."""
    from ced_csa2.train.tuning import held_out, new_teachers

    model, _ = frozen
    parts = random_parts(geometry(model.config), QWEN_PLAN)
    val = [batch()]
    for objective in TRAINED:
        _, teachers = new_teachers(objective, model, QWEN_PLAN)
        got = held_out(objective, model, parts, QWEN_PLAN, "ced", val, 2.0, 0.5, teachers, 64)
        with torch.no_grad():
            own = OBJECTIVES[objective].batch_loss(model, parts, QWEN_PLAN, "ced", *val[0], 2.0, 0.5,
                                                   teacher=teachers(*val[0]))
        # distill's held-out KL runs the LM head on 64 positions at a time: the same sum in another order
        assert got["loss"] == pytest.approx(own.item(), rel=1e-5) and got["loss"] > 0, objective
    with pytest.raises(ValueError, match="objective 'ridge' trains nothing"):
        held_out("ridge", model, parts, QWEN_PLAN, "ced", val, 1.0, 0.0, teachers, 64)
    with pytest.raises(ValueError, match=r"unknown tune objective 'kv_mse'; known: \['ridge', 'attn_out', 'distill'\]"):
        held_out("kv_mse", model, parts, QWEN_PLAN, "ced", val, 1.0, 0.0, teachers, 64)


def test_a_registry_row_that_contradicts_its_class_is_refused():
    """A row is refused at import: an objective with a loss prices every phase; one without has no costs or keys."""
    trained = type(OBJECTIVES["distill"])
    with pytest.raises(ValueError, match=r"'half': step_cost must give every phase \['ced', 'csa2', 'ced_csa2'\]"):
        trained("half", step_cost={"ced": 1.0})
    with pytest.raises(ValueError, match="'idle' trains nothing"):
        TuneObjective("idle", final_teacher=True)
    assert [o.name for o in OBJECTIVES.values() if not o.trains] == ["ridge"]
    assert set(RUNS_A_STUDENT) == set(TRAINED), "give each objective that trains its row in RUNS_A_STUDENT"
    assert tune_objective("distill") is OBJECTIVES["distill"]
