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
def installed(handles_factory: Callable[[], list]) -> Iterator[None]:
    """Keep the hooks ``handles_factory()`` registers (it returns their handles) for the context; remove them on exit."""
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

    with installed(factory):
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

    with installed(factory):
        yield


@contextmanager
def keep_initial(model: nn.Module, layers: Iterable[int], positions: int,
                 constants: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None) -> Iterator[None]:
    """Keep the first ``positions`` positions' K/V of ``layers`` while other hooks replace the rest.

    Enter it *after* the hooks that replace ``k_proj``/``v_proj`` outputs (:func:`inject`): at a
    kept position the output is the layer's own (recorded by a hook that runs before every other)
    or, with ``constants``, ``constants(layer) -> (k, v)`` each ``(kv_dim,)``, for position 0
    only.  Kept positions are read from the ``position_ids`` the model's forward hands each
    decoder layer, not from the index in the call: a cached decode step (position ``t``, one
    token) keeps nothing, a left-padded row keeps its own first tokens (a pad also sits at a
    position below ``positions`` and may be kept: the mask hides it from every query).

    Raises ``RuntimeError`` on a forward whose decoder layer gets no ``position_ids``.
    """
    if constants is not None and positions != 1:
        raise ValueError(f"keep_initial: constants stand for position 0 only, got positions={positions}")
    state: dict = {}

    def read_positions(layer: int):
        def hook(module, args, kwargs):
            pos = kwargs.get("position_ids")
            if pos is None:
                raise RuntimeError(f"decoder layer {layer} got no position_ids: the positions whose K/V are kept "
                                   "cannot be told")
            state[layer] = pos
        return hook

    def record(layer: int, kind: str):
        def hook(mod, inp, out):  # prepended: the layer's own output, before any replacement
            state[layer, kind] = out
        return hook

    def keep(layer: int, i: int, kind: str):
        def hook(mod, inp, out):  # appended: after the replacement
            pos = state[layer]  # (1 | B, T)
            kept = (pos < positions)[..., None]
            if not kept.any():
                return out
            first = state[layer, kind] if constants is None else constants(layer)[i].to(out)
            return torch.where(kept, first, out)
        return hook

    def factory():
        handles = []
        for layer in layers:
            handles.append(decoder_layer(model, layer).register_forward_pre_hook(read_positions(layer),
                                                                                 with_kwargs=True))
            attn = attention(model, layer)
            for i, kind in enumerate("kv"):
                proj = getattr(attn, f"{kind}_proj")
                if constants is None:
                    handles.append(proj.register_forward_hook(record(layer, kind), prepend=True))
                handles.append(proj.register_forward_hook(keep(layer, i, kind)))
        return handles

    try:
        with installed(factory):
            yield
    finally:
        state.clear()


# ----------------------------------------------------------------------------- replaying the upper layers

class StopLayers(Exception):
    """Raised by :func:`layer_calls`'s hook at its ``stop`` layer, before that layer runs."""


def layer_kinds(model: nn.Module) -> list[str]:
    """Per decoder layer (0-based) the key the model's forward picks its mask by (``layer_types``)."""
    cfg = model.model.config
    n = len(model.model.layers)
    return list(getattr(cfg, "layer_types", None) or ["decoder"] * n)[:n]


def kinds_seen_by(model: nn.Module, layers: Iterable[int]) -> int:
    """Lowest 1-based layer by which every kind among ``layers`` (1-based) has been called.

    A forward stopped there (:func:`layer_calls`) has recorded the arguments of each of them.
    """
    kinds, first = layer_kinds(model), {}
    for i, kind in enumerate(kinds, 1):
        first.setdefault(kind, i)
    return max((first[kinds[layer - 1]] for layer in layers), default=1)


@contextmanager
def layer_calls(model: nn.Module, stop: int | None = None, inputs_at: Iterable[int] = ()) -> Iterator[dict]:
    """Record what the model's own forward hands its decoder layers, to replay layers on other inputs.

    Yields ``{"kwargs": {kind: kwargs}, "inputs": {layer: hidden}}``, filled by the next forward:
    per kind of layer (:func:`layer_kinds`) the keyword arguments it passes (mask, position
    embeddings, cache, ...: the same object for every layer of a kind, checked), and the hidden
    state entering each layer in ``inputs_at``.  With ``stop`` the forward raises
    :class:`StopLayers` on entering that layer, before it runs (catch it): pick ``stop`` with
    :func:`kinds_seen_by` so that every kind to replay has been seen.  :func:`run_layers` replays.
    """
    kinds, inputs_at = layer_kinds(model), set(inputs_at)
    store: dict = {"kwargs": {}, "inputs": {}}

    def record(layer: int):
        def hook(module, args, kwargs):
            if len(args) != 1:
                raise RuntimeError(f"decoder layer {layer} was called with {len(args)} positional arguments; "
                                   "only the hidden state can be replayed")
            if layer in inputs_at:
                store["inputs"][layer] = args[0]
            kind, kw = kinds[layer - 1], dict(kwargs)
            seen = store["kwargs"].setdefault(kind, kw)
            if seen is not kw and (seen.keys() != kw.keys() or any(seen[k] is not kw[k] for k in kw)):
                raise RuntimeError(f"decoder layer {layer} got other arguments than an earlier {kind!r} layer; "
                                   "this model's forward cannot be replayed layer by layer")
            if layer == stop:
                raise StopLayers
        return hook

    def factory():
        return [decoder_layer(model, i).register_forward_pre_hook(record(i), with_kwargs=True)
                for i in range(1, (stop or len(kinds)) + 1)]

    with installed(factory):
        yield store


def run_layers(model: nn.Module, hidden: torch.Tensor, first: int, calls: dict, *, fresh_cache: bool,
               cache=None) -> torch.Tensor:
    """Decoder layers ``first..n`` on ``hidden`` ``(B, T, hidden)``, then the final norm: the forward's end.

    Each layer gets the arguments :func:`layer_calls` recorded for its kind; with ``fresh_cache``
    a new cache of the recorded one's type (one for all these layers, as a forward makes one)
    instead of the recorded cache, with ``cache`` that cache (which holds the layers below
    ``first`` already).  Returns the final hidden states ``(B, T, hidden)``.
    """
    if fresh_cache and cache is not None:
        raise ValueError("run_layers: give fresh_cache or a cache, not both")
    layers, kinds, fresh = model.model.layers, layer_kinds(model), {}
    for i in range(first, len(layers) + 1):
        kw = dict(calls["kwargs"][kinds[i - 1]])
        for name in ("cache", "past_key_values"):
            if kw.get(name) is not None and (fresh_cache or cache is not None):
                kw[name] = cache if cache is not None else fresh.setdefault(
                    name, type(kw[name])(config=model.model.config))
        hidden = _hidden(layers[i - 1](hidden, **kw))
    return model.model.norm(hidden)
