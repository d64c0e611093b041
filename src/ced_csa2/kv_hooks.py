"""Forward hooks that read and replace K/V at the injection point, always removed.

The injection point (docs/design.md §1) is the output of a layer's ``self_attn.k_proj`` /
``self_attn.v_proj``: pre-k_norm, pre-RoPE, shape ``(batch, tokens, n_kv_heads *
head_dim)``.  A forward hook that *returns* a tensor replaces the module output, so
the layer's own k_norm, RoPE and KV cache act on the replacement unchanged -- in
teacher-forced passes and in cached ``generate()`` alike -- and no model code is
patched.  Every hook is installed by a context manager that removes it on exit, so
the model is a plain HF model again afterwards (as in NVIDIA/kvpress).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Mapping, Union

import torch
from torch import nn

from .model_utils import attention, decoder_layer

Replacement = Union[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]


@contextmanager
def _installed(handles_factory: Callable[[], list]) -> Iterator[None]:
    handles = []
    try:
        handles.extend(handles_factory())
        yield
    finally:
        for h in handles:
            h.remove()


def _hidden(output):
    # Decoder layers return a plain tensor in transformers 5.x; older ones a tuple.
    return output[0] if isinstance(output, tuple) else output


@contextmanager
def capture(model: nn.Module, kv_layers: Iterable[int] = (), hidden_layers: Iterable[int] = ()) -> Iterator[dict]:
    """Record K/V and hidden states of one or more forward passes.

    Yields a dict filled by each forward: ``store["k"][l]``, ``store["v"][l]`` --
    ``k_proj``/``v_proj`` outputs of layer ``l``, ``(B, T, kv_dim)``; ``store["h"][l]``
    -- output of decoder layer ``l`` (``H_l``), ``(B, T, hidden)``.  The last forward
    wins; tensors are the modules' own outputs (not copies).
    """
    store: dict = {"k": {}, "v": {}, "h": {}}

    def factory():
        handles = []
        for layer in kv_layers:
            attn = attention(model, layer)
            for kind in ("k", "v"):
                proj = getattr(attn, f"{kind}_proj")
                handles.append(proj.register_forward_hook(
                    lambda mod, inp, out, kind=kind, layer=layer: store[kind].__setitem__(layer, out)))
        for layer in hidden_layers:
            handles.append(decoder_layer(model, layer).register_forward_hook(
                lambda mod, inp, out, layer=layer: store["h"].__setitem__(layer, _hidden(out))))
        return handles

    with _installed(factory):
        yield store


@contextmanager
def inject(model: nn.Module, replacements: Mapping[tuple[int, str], Replacement]) -> Iterator[None]:
    """Replace ``k_proj``/``v_proj`` outputs while the context is open.

    ``replacements[(layer, "k" | "v")]`` is a tensor of the output's shape, or a callable
    mapping the true output ``(B, T, kv_dim)`` to its replacement (called on every
    forward, so it also works step by step inside ``generate()``).  The replacement is
    moved to the output's device (a no-op but under ``model.device_map: auto``, where it
    may come from a layer on another device).
    """
    def factory():
        handles = []
        for (layer, kind), repl in replacements.items():
            proj = getattr(attention(model, layer), f"{kind}_proj")
            handles.append(proj.register_forward_hook(
                lambda mod, inp, out, repl=repl: (repl(out) if callable(repl) else repl).to(out.device)))
        return handles

    with _installed(factory):
        yield
