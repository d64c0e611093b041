"""The embedded default computes in float32 on every machine; bf16 is a switch, not a CPU feature.

A CPU with AMX makes ``auto`` pick bf16 (model and trainers' autocast), so a default that said
``auto`` would give other metrics on such a machine.  These tests pretend every CPU has AMX.
"""

import pytest
import torch
import yaml

from ced_csa2.compose import compose
from ced_csa2.config import Params, from_dict
from ced_csa2.model_utils import resolve_dtype
from ced_csa2.train.training import amp_context, compute_dtype_name

CPU = torch.device("cpu")


@pytest.fixture
def amx_everywhere(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert resolve_dtype("auto", CPU) == torch.bfloat16  # the switch this test relies on is live


def composed(*overrides: str) -> Params:
    return from_dict(Params, yaml.safe_load(compose(list(overrides))))


@pytest.mark.parametrize("budget", ["cpu", "cpu_full"])
def test_cpu_budgets_compose_to_float32_even_where_bf16_is_native(amx_everywhere, budget):
    params = composed(f"budget={budget}")
    assert resolve_dtype(params.model.dtype, CPU) == torch.float32
    for trainer in (params.train_projector, params.train_adapters):
        assert compute_dtype_name(CPU, trainer.amp_dtype) == "float32"
        assert not isinstance(amp_context(CPU, trainer.amp_dtype), torch.autocast)


def test_the_committed_params_are_the_float32_default(amx_everywhere):
    from conftest import ROOT

    params = from_dict(Params, yaml.safe_load((ROOT / "params.yaml").read_text()))
    assert params == composed()
    assert resolve_dtype(params.model.dtype, CPU) == torch.float32


def test_bf16_is_one_switch_away(amx_everywhere):
    params = composed("model.dtype=bfloat16", "train_projector.amp_dtype=auto", "train_adapters.amp_dtype=auto")
    assert resolve_dtype(params.model.dtype, CPU) == torch.bfloat16
    assert compute_dtype_name(CPU, params.train_projector.amp_dtype) == "bfloat16"
    assert isinstance(amp_context(CPU, params.train_adapters.amp_dtype), torch.autocast)


def test_the_full_profile_keeps_bf16():
    params = composed("model=qwen3_5_4b", "data=wikitext", "plan=qwen3_5", "budget=recipe")
    assert params.model.dtype == "bfloat16"
    assert resolve_dtype(params.train_projector.amp_dtype, torch.device("cuda")) == torch.bfloat16
