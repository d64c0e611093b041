"""A model is used only when its checkpoint filled every weight (``model_utils.check_loading``).

The look-alike of the real Qwen3.5-4B checkpoint: a tiny ``Qwen3_5ForConditionalGeneration``
(text model with the tiny profile's widths, a one-block vision tower, tied embeddings) saved
with an ``mtp.*`` tensor added, as the hub's ``model.language_model.*`` / ``model.visual.*`` /
``mtp.*`` layout, and loaded as users load theirs (a pinned local folder through
``load_model_and_tokenizer``, which builds ``Qwen3_5ForCausalLM`` from ``text_config``).
"""

import json
import shutil

import pytest
import torch
from conftest import tiny_params
from safetensors.torch import load_file, save_file

from ced_csa2 import assets
from ced_csa2.config import LocalModel, ModelConfig
from ced_csa2.model_utils import ModelLoadError, load_model_and_tokenizer, tiny_config, tiny_tokenizer

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def look_alike(tmp_path_factory):
    """``(folder, the CondGen model it was saved from)``: text, vision and MTP tensors, tied, no lm_head tensor."""
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = tiny_config(tiny_params().model.tiny, len(tiny_tokenizer()), "sdpa")
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text.hidden_size,
                  patch_size=2, temporal_patch_size=1, spatial_merge_size=1, in_channels=3)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text.to_dict(), vision_config=vision,
                                                          tie_word_embeddings=True)).eval()
    folder = tmp_path_factory.mktemp("qwen3_5_look_alike") / "model"
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    tensors = load_file(folder / WEIGHTS)
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)  # the hub checkpoint's multi-token-prediction head
    save_file(tensors, folder / WEIGHTS, metadata={"format": "pt"})
    return folder, model


def _pinned(folder) -> ModelConfig:
    return ModelConfig(name="look_alike", kind="local", dtype="float32", attn_implementation="sdpa", device_map=None,
                       hf_id=None, revision=None, wheel=None, joined=None,
                       local=LocalModel(path=str(folder), sha256=assets.digest(folder)), tiny=None)


def _variant(look_alike, tmp_path, *, drop=None, add=None, config=None):
    """A copy of the look-alike with a tensor dropped or added, or its config edited."""
    folder = tmp_path / "model"
    shutil.copytree(look_alike[0], folder)
    if drop or add:
        tensors = load_file(folder / WEIGHTS)
        if drop:
            del tensors[drop]
        tensors.update(add or {})
        save_file(tensors, folder / WEIGHTS, metadata={"format": "pt"})
    if config:
        cfg = json.loads((folder / "config.json").read_text())
        config(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_the_real_checkpoint_layout_loads_clean_and_tied(look_alike):
    folder, source = look_alike
    assert {k.split(".")[0] + "." + k.split(".")[1] for k in load_file(folder / WEIGHTS)} == {
        "model.language_model", "model.visual", "mtp.fc"}
    model, tok = load_model_and_tokenizer(_pinned(folder))
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied through text_config
    ids = tok(["the text path of the look-alike"], return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, source(input_ids=ids).logits)


@pytest.mark.parametrize("edit,message", [
    (dict(drop="model.language_model.layers.3.self_attn.k_proj.weight"),
     r"lacks 1 tensor\(s\) the model needs, first 'model.layers.3.self_attn.k_proj.weight'"),
    (dict(config=lambda c: [d.pop("tie_word_embeddings") for d in (c, c["text_config"])]),  # the tie key dropped
     r"lacks 1 tensor\(s\) the model needs, first 'lm_head.weight'"),
    (dict(add={"model.language_model.layers.0.extra.weight": torch.zeros(2)}),
     r"holds 1 tensor\(s\) the model has no place for, first 'model.layers.0.extra.weight'"),
    (dict(add={"model.language_model.norm.weight": torch.zeros(3)}),
     r"a checkpoint tensor has another shape than the model's"),
])
def test_a_checkpoint_that_does_not_fill_the_model_is_refused_naming_it(look_alike, tmp_path, edit, message):
    folder = _variant(look_alike, tmp_path, **edit)
    with pytest.raises(ModelLoadError, match=rf"model 'look_alike' \(local\): .*{message}"):
        load_model_and_tokenizer(_pinned(folder))


def test_the_refusal_is_a_stage_s_one_line_input_error(look_alike, tmp_path):
    """What a stage prints for it: ``error: ...`` on one line naming the model and the tensor (exit 2)."""
    from ced_csa2.pipeline.stage_runner import error_line, is_input_error

    folder = _variant(look_alike, tmp_path, drop="model.language_model.norm.weight")
    with pytest.raises(ModelLoadError) as caught:
        load_model_and_tokenizer(_pinned(folder))
    assert is_input_error(caught.value)
    line = error_line(caught.value)
    assert "\n" not in line and "first 'model.norm.weight'" in line, line
