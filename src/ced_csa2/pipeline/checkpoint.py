"""The ``.pt`` files of the learned maps: one format, one set of checks.

A checkpoint is ``torch.save`` of a plain dict (loadable with ``weights_only=True``)::

    {"format": "ced_csa2.projector" | "ced_csa2.projectors" | "ced_csa2.adapters" | "ced_csa2.xkv",
     "format_version": 3,
     "state": {name: fp16 tensor},   # the module's state_dict, rounded to FP16
     "sha256": hex,                  # of the state (names, dtypes, shapes, bytes): state_digest
     "meta": {...}}                  # what it is for: role, model, layer(s), geometry, plan; provenance

Loading checks the format, the branch the file belongs to (``meta["role"]``,
:mod:`ced_csa2.pipeline.map_roles`) against the one asked for, the tensors against their
sha256 (a flipped byte is refused, naming the file), then every ``expect`` key against
``meta``, before any tensor is used; each failure raises :class:`CheckpointError` naming the
file (and the key, or the role, with both values).  ``meta["provenance"]`` is the params the
file was made from as its branch applied them, its inputs' included
(:func:`ced_csa2.config.provenance`); :func:`check_meta_provenance` refuses a file made with
other params than the current ones.  :func:`expected_meta` is what a file made for a given model,
plan and geometry says about itself: writers store it (:func:`checkpoint_meta`) and
every consumer passes it as ``expect``.  :func:`init_linear_from_ridge` copies a
closed-form map of the ridge stage into an ``nn.Linear``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import torch
from torch import nn

from ..config import check_provenance, params_hash
from .atomic_files import atomic_write_bytes

from .map_roles import Role, applied, describe

if TYPE_CHECKING:
    from ..config import Params
    from ..model_utils import Geometry
    from ..plan import LayerPlan

log = logging.getLogger(__name__)

# 3: the state's sha256 and meta's provenance; an older file is refused by the version check.
FORMAT_VERSION = 3
SAVE_DTYPE = torch.float16


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, of another kind, or does not match what the caller expects."""


def _plain(value):
    """Tuples as lists, recursively, so a plan given as tuples compares equal to the stored lists."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def expected_meta(params: Params, plan: LayerPlan, geo: Geometry) -> dict[str, dict]:
    """What each map file of ``plan`` must say it is for: the ``expect`` of every consumer.

    Parameters
    ----------
    params
        Validated parameters; only ``model.name`` is read.
    plan
        The validated layer plan the maps serve.
    geo
        The model's geometry: ``hidden_size`` (width of ``H_split``) and ``kv_dim``
        (``n_kv_heads * head_dim``, the width of one K or V row).

    Returns
    -------
    dict
        ``{kind: {meta key: value}}`` for the kinds ``"projector"`` (``projector_k{s}v{s}.pt``),
        ``"projectors"`` (``projectors_extra.pt``), ``"adapters"`` (``adapters.pt``),
        ``"xkv"`` (``xkv.pt``), ``"sink"`` (``mode_a/sink.pt``) and ``"bank"``
        (``mode_a/projector_bank.pt``), keys in the order they are
        checked: ``model``; the layers the file maps (``layer`` = ``plan.source``; ``layers`` =
        ``plan.extra_sources``; ``source`` and ``layers`` = ``plan.targets``; ``layers`` =
        ``[plan.source, *plan.targets]``; ``layers`` = ``plan.kv_layers``; ``layers`` = ``plan.projected``);
        ``hidden_size`` and ``kv_dim``; ``plan`` (``split``, ``source``,
        ``targets``, ``extra_sources`` as lists).  Writers store the same dicts
        (:func:`checkpoint_meta`), so a file always matches the plan it was made for.
    """
    fit = {"hidden_size": geo.hidden_size, "kv_dim": geo.kv_dim, "plan": _plain(dataclasses.asdict(plan))}
    model = {"model": params.model.name}
    return {"projector": {**model, "layer": plan.source, **fit},
            "projectors": {**model, "layers": list(plan.extra_sources), **fit},
            "adapters": {**model, "source": plan.source, "layers": list(plan.targets), **fit},
            "xkv": {**model, "layers": [plan.source, *plan.targets], **fit},
            "sink": {**model, "layers": list(plan.kv_layers), **fit},
            "bank": {**model, "layers": list(plan.projected), **fit}}


def checkpoint_meta(params: Params, plan: LayerPlan, geo: Geometry, *sections, role: Role,
                    provenance: Mapping | None = None) -> dict[str, dict]:
    """:func:`expected_meta` plus role and provenance, for the writers.

    Each kind's dict also holds ``role`` (``role.as_meta()``: the branch the files belong to),
    ``split``, ``model_id`` (``model.hf_id`` or the name), ``seed``, ``params_hash``
    (:func:`ced_csa2.config.params_hash` of ``sections``, the params sections that determine the
    weights, as applied) and ``provenance`` (the writer's :func:`ced_csa2.config.provenance` of
    :func:`ced_csa2.pipeline.map_roles.applied` params, its inputs' merged in), checked by every reader.
    """
    made = {"role": role.as_meta(), "split": plan.split, "model_id": params.model.hf_id or params.model.name,
            "seed": params.seed, "params_hash": params_hash(*sections), "provenance": dict(provenance or {})}
    return {kind: {**want, **made} for kind, want in expected_meta(params, plan, geo).items()}


def check_meta_provenance(path: str | Path, meta: Mapping, params: Params, role: Role) -> None:
    """Refuse a map file of ``role`` whose recorded provenance is not ``params`` as ``role``'s branch applies them.

    (:func:`ced_csa2.pipeline.map_roles.applied`, :func:`ced_csa2.config.check_provenance`.)
    """
    check_provenance(path, meta.get("provenance") or {}, applied(params, role))


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over a state dict's names, dtypes, shapes and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def save_checkpoint(path: str | Path, kind: str, module: nn.Module, meta: Mapping, required: tuple[str, ...]) -> Path:
    """Write ``module``'s state in FP16 with ``meta`` to ``path`` (temp name + rename).

    Parameters
    ----------
    path
        Destination file; its parent is created.
    kind
        Format tag, e.g. ``"projector"``; :func:`load_checkpoint` insists on the same.
    module
        The map; every floating-point tensor of its state dict is stored as FP16.
    meta
        JSON-like metadata (str/int/float/bool/None, lists and dicts of them).
    required
        Keys ``meta`` must hold: a checkpoint that cannot say what it belongs to is refused.
    """
    path = Path(path)
    missing = [k for k in required if k not in meta]
    if missing:
        raise CheckpointError(f"{path}: refusing to save a {kind} checkpoint without metadata {missing}")
    state = {}
    for name, t in module.state_dict().items():
        t = t.detach().cpu()
        if t.is_floating_point():
            t = t.to(SAVE_DTYPE).contiguous()
            if not torch.isfinite(t).all():
                raise CheckpointError(f"{path}: tensor '{name}' is not finite in {SAVE_DTYPE} (overflow or NaN)")
        state[name] = t
    blob = {"format": f"ced_csa2.{kind}", "format_version": FORMAT_VERSION, "state": state,
            "sha256": state_digest(state), "meta": _plain(meta)}
    buf = io.BytesIO()
    torch.save(blob, buf)
    atomic_write_bytes(path, buf.getvalue())
    log.info("wrote %s (%s, %.2f MB)", path, kind, path.stat().st_size / 1e6)
    return path


def load_checkpoint(path: str | Path, kind: str, expect: Mapping | None = None, *,
                    role: Role | None) -> tuple[dict, dict]:
    """``(state, meta)`` of a checkpoint written by :func:`save_checkpoint`, after all checks.

    Parameters
    ----------
    path
        The file.
    kind
        The format tag it must carry.
    expect
        ``{meta key: value}`` the file must agree with (e.g. ``{"kv_dim": 1024, "layer": 20}``;
        the pipeline's consumers pass :func:`expected_meta`), checked in its order.

    Raises
    ------
    CheckpointError
        Missing or unreadable file, wrong format or version, or an ``expect`` mismatch
        (the message names the file, the key and both values).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: {kind} checkpoint not found (run `dvc repro` for the stage that writes it)")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load raises many types (zip, pickle, EOF) for one cause: a bad file
        raise CheckpointError(f"{path}: not a readable checkpoint (truncated or corrupt?): "
                              f"{type(exc).__name__}: {exc}") from None
    if not isinstance(blob, dict) or blob.get("format") != f"ced_csa2.{kind}":
        found = blob.get("format") if isinstance(blob, dict) else type(blob).__name__
        raise CheckpointError(f"{path}: not a ced_csa2.{kind} checkpoint (its format is {found!r})")
    if blob.get("format_version") != FORMAT_VERSION:
        raise other_version_error(path, blob.get("format_version"), FORMAT_VERSION,
                                  role.writer(kind) if role is not None else None)
    meta = blob["meta"]
    if role is not None and meta.get("role") != role.as_meta():
        stage = f"`dvc repro {role.writer(kind)}`"
        if "role" not in meta:
            raise CheckpointError(f"{path}: records no role (written before map files named their branch): "
                                  f"rebuild it with {stage}")
        raise CheckpointError(f"{path}: holds the {kind} of {describe(meta['role'])}, asked for the {kind} of "
                              f"{role} (another branch's file?): rebuild it with {stage}")
    try:
        digest = state_digest(blob["state"])
    except Exception as exc:  # a flip that breaks a tensor's structure
        raise CheckpointError(f"{path}: its tensors cannot be read ({type(exc).__name__}: {exc})") from None
    written = str(blob.get("sha256"))
    if digest != written:
        raise CheckpointError(f"{path}: its tensors' sha256 is {up_to_difference(digest, written)}, not the "
                              f"{up_to_difference(written, digest)} it was written with: the file changed after it "
                              "was written (rebuild it with `dvc repro`)")
    for key, want in (expect or {}).items():
        if key not in meta:
            raise CheckpointError(f"{path}: metadata has no '{key}' (expected {want!r})")
        if _plain(meta[key]) != _plain(want):
            raise CheckpointError(f"{path}: '{key}' is {meta[key]!r} in the checkpoint, expected {want!r}")
    return blob["state"], meta


def other_version_error(path: Path, found, reads: int, stage: str | None) -> CheckpointError:
    """The refusal of a file whose format version ``found`` is not the ``reads`` this code reads.

    Said before its bytes are checked: an older file may lack what a newer one records (its
    sha256), which would otherwise read as a file changed after it was written.  ``stage`` is
    the one that writes the file (``None``: not known here, any stage that is out of date).
    """
    remedy = f"`dvc repro -f {stage}`" if stage else "`dvc repro`"
    return CheckpointError(f"{path}: written by another version of ced-csa2 (format {found}, this reads {reads}): "
                           f"re-run its stage, {remedy}")


def up_to_difference(digest: str, other: str, shown: int = 16) -> str:
    """``digest`` cut after its first digit that differs from ``other``, ``shown`` digits at least.

    Two digests shown by equal prefixes would read as a contradiction.
    """
    differ = next((i for i, (a, b) in enumerate(zip(digest, other)) if a != b), min(len(digest), len(other)))
    cut = max(shown, differ + 1)
    return digest if cut >= len(digest) else f"{digest[:cut]}..."


def load_state(path: Path, module: nn.Module, state: dict) -> None:
    """``module.load_state_dict(state)``, with a shape/key mismatch reported against ``path``."""
    try:
        module.load_state_dict(state)
    except RuntimeError as exc:
        raise CheckpointError(f"{path}: weights do not fit the module its metadata describes: {exc}") from None


@torch.no_grad()
def init_linear_from_ridge(linear: nn.Linear, W: torch.Tensor, b: torch.Tensor) -> None:
    """Copy a ridge map into ``linear`` so that ``linear(x)`` predicts ``x @ W + b``.

    Parameters
    ----------
    linear
        ``nn.Linear(d_in, d_out)``; weight and bias are overwritten (exact copies).
    W, b
        ``(d_in, d_out)`` and ``(d_out,)``.

    Notes
    -----
    The weight keeps ``nn.Linear``'s contiguous ``(d_out, d_in)`` layout, so
    ``linear(x)`` is bit-identical to ``F.linear(x, W.T.contiguous(), b)``.  An
    expression such as ``x @ W + b`` is the same map but may differ in the last bits:
    BLAS sums in another order for the other operand layout, and the bias is added
    after rounding instead of inside the GEMM.  (Keeping ``W``'s own layout through a
    transposed weight view would make it match ``torch.addmm(b, x, W)``, but is several
    times slower in CPU bf16 autocast, whose kernels want the standard layout.)
    """
    d_out, d_in = linear.weight.shape
    if tuple(W.shape) != (d_in, d_out) or tuple(b.shape) != (d_out,):
        raise ValueError(f"ridge map of shape W{tuple(W.shape)} b{tuple(b.shape)} does not fit "
                         f"Linear({d_in} -> {d_out}), which needs W({d_in}, {d_out}) b({d_out},)")
    linear.weight.copy_(W.T)
    linear.bias.copy_(b)
