"""Fixed orthogonal rotations of stored K/V entries before FP4 (the ``*_fp4_rot`` groups).

A block-scaled FP4 entry (:mod:`ced_csa2.kv.fp4`) spends one scale per group of ``G``
channels, set by the group's largest magnitude: one outlier channel (pre-RoPE K has a few
channels many times larger than the rest) makes every other channel of its group round
to zero or to a coarse grid.  Rotating each head by a fixed orthogonal matrix ``R`` first
spreads that outlier's energy over all ``head_dim`` channels, so the groups' maxima come
closer to their RMS and FP4 loses less (QuaRot, SpinQuant; DeepSeek-V4 rotates its
indexer K by a Hadamard matrix before FP4, seed 002).  The reader undoes it:

    stored = FP4(R x),    read = Rᵀ dequant(FP4(R x))

per head, on the injection-point layout ``(..., kv_dim)`` = ``(..., n_kv_heads · head_dim)``
(pre-k_norm, pre-RoPE).  Without FP4 the round trip is the identity (``RᵀR = I``).

``R`` is a *randomised Hadamard* matrix, ``R = H · diag(s)``: ``H`` the normalised
Sylvester Hadamard matrix (entries ``±1/√head_dim``), ``s`` seeded random signs (the signs
keep a structured input -- e.g. a constant vector, which ``H`` maps to one spike -- from
lining up with ``H``'s rows).  Sylvester matrices exist for powers of two only; for any
other ``head_dim`` (80, 96, ...) the **fallback** is a seeded Haar-random orthogonal
matrix (QR of a Gaussian matrix, signs fixed by ``diag(R_qr) > 0``): it spreads outliers
as well, in expectation, just without Hadamard's flat ``1/√n`` entries.  Either is applied
as one dense ``(head_dim, head_dim)`` matmul (``head_dim <= 256`` here: a fast
Walsh-Hadamard transform would not pay).

Seeds and bytes.  The rotation is weights, derived from a seed, not stored per token:
layer ``l``'s matrix comes from seed ``ROTATION_SEED + l`` (the same for every head, and
for K and V of that layer), so every run, stage and process rebuilds the same ``R``, and a
rotated group's bytes per token are exactly its plain FP4 twin's.

Which streams.  :data:`ROTATED_STREAMS` (K only, or K and V) was chosen by measurement:
K and V, figures in :mod:`ced_csa2.groups`.  Elementwise error is a poor guide
here: on SmolLM2's K/V the NVFP4 round trip's relative MSE is slightly *higher* rotated
(K 0.0086 -> 0.0092) -- E4M3 scales per 16 channels already follow the outlier channels --
yet perplexity improves, because the error no longer sits on the few channels that
dominate ``q·k``.
"""

from __future__ import annotations

import torch

# Base seed of the rotations; layer l (1-based) uses ROTATION_SEED + l.  Fixed, so a group's
# rotation is a property of the group (not of params.seed): any stage rebuilds the same R.
ROTATION_SEED = 13_000
# Streams rotated before FP4: K and V.  Measured on the embedded default (SmolLM2, 32 eval
# records, baseline_fp4, paired ΔPPL vs rotating K only): rotating V as well gains
# measurably under MXFP4 and changes nothing measurable under NVFP4
# (figures: docs/results.md, "Beyond the seed"); K gives most of the gain.
ROTATED_STREAMS: tuple[str, ...] = ("k", "v")


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def hadamard(n: int) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix of order ``n`` (a power of two).

    ``H_1 = [1]``, ``H_2m = [[H_m, H_m], [H_m, -H_m]]``, divided by ``√n``: symmetric and
    orthogonal (``H Hᵀ = I``), every entry ``±1/√n``.

    Returns
    -------
    torch.Tensor, shape (n, n), float64
    """
    if not is_power_of_two(n):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two order, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)
    return h / n ** 0.5


def rotation_matrix(n: int, seed: int) -> torch.Tensor:
    """The orthogonal matrix ``R`` of order ``n`` for ``seed``: randomised Hadamard, or Haar-random (fallback).

    Power-of-two ``n``: ``R = H · diag(s)``, ``s`` in ``{-1, +1}^n`` drawn from a CPU
    ``torch.Generator`` seeded with ``seed`` (bit-reproducible).  Otherwise ``R = Q · diag(sign
    diag(R_qr))`` from the QR decomposition of an ``n × n`` standard-normal matrix drawn from
    the same generator (reproducible up to the LAPACK build's last bits).

    Returns
    -------
    torch.Tensor, shape (n, n), float64
        Orthogonal: ``R Rᵀ = Rᵀ R = I`` to float64 rounding.
    """
    if n < 1:
        raise ValueError(f"rotation order must be >= 1, got {n}")
    gen = torch.Generator().manual_seed(int(seed))
    if is_power_of_two(n):
        signs = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int64).to(torch.float64) * 2 - 1
        return hadamard(n) * signs  # column j scaled by s_j: H · diag(s)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))  # unique Haar-distributed Q


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype entries of ``dtype`` are rotated (and FP4-rounded) in: float64 stays float64, anything else float32."""
    # float64 stays float64 (exact round-trip tests); everything else is rotated in float32,
    # which is what FP4 quantises in anyway (a bf16 rotation would add bf16 rounding).
    return torch.float64 if dtype == torch.float64 else torch.float32


class HeadRotation:
    """One orthogonal ``(head_dim, head_dim)`` matrix applied to every head of ``(..., kv_dim)`` entries.

    Parameters
    ----------
    head_dim
        Channels per head; ``kv_dim`` of the entries must be a multiple of it.
    seed
        Seed of :func:`rotation_matrix` (use :func:`layer_rotation` for a layer's).

    Attributes
    ----------
    matrix : torch.Tensor, shape (head_dim, head_dim), float64
        ``R``; :meth:`rotate` computes ``R x_h`` for each head ``x_h``.
    """

    def __init__(self, head_dim: int, seed: int):
        self.head_dim, self.seed = int(head_dim), int(seed)
        self.matrix = rotation_matrix(self.head_dim, self.seed)
        self._cast: dict[tuple, torch.Tensor] = {}  # (device, dtype) -> R there (built once)

    @property
    def hadamard(self) -> bool:
        """Whether ``R`` is a randomised Hadamard matrix (``head_dim`` a power of two) or the QR fallback."""
        return is_power_of_two(self.head_dim)

    def _r(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.device, like.dtype)
        if key not in self._cast:
            self._cast[key] = self.matrix.to(device=like.device, dtype=like.dtype)
        return self._cast[key]

    def _per_head(self, x: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] % self.head_dim:
            raise ValueError(f"HeadRotation: entries of shape {tuple(x.shape)} do not split into heads of "
                             f"{self.head_dim} channels along the last dimension")
        heads = x.reshape(*x.shape[:-1], -1, self.head_dim)  # (..., n_kv_heads, head_dim)
        return (heads @ right).reshape(x.shape)  # row vectors: x_h @ M

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``R x_h`` for every head ``x_h`` of ``x``.

        Parameters
        ----------
        x : torch.Tensor, shape (..., kv_dim), floating
            ``kv_dim = n_kv_heads · head_dim``, heads contiguous (the ``k_proj``/``v_proj`` layout).

        Returns
        -------
        torch.Tensor, shape (..., kv_dim)
            float64 for float64 input, float32 otherwise (what FP4 quantises in).
        """
        x = x.to(work_dtype(x.dtype))
        return self._per_head(x, self._r(x).T)  # (R x_h)ᵀ = x_hᵀ Rᵀ

    def unrotate(self, y: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``Rᵀ y_h`` for every head (the inverse of :meth:`rotate`), cast to ``dtype`` (default ``y``'s).

        Parameters
        ----------
        y : torch.Tensor, shape (..., kv_dim), floating
        dtype : torch.dtype, optional

        Returns
        -------
        torch.Tensor, shape (..., kv_dim), ``dtype``
        """
        out_dtype = dtype or y.dtype
        y = y.to(work_dtype(y.dtype))
        return self._per_head(y, self._r(y)).to(out_dtype)  # (Rᵀ y_h)ᵀ = y_hᵀ R


def layer_rotation(head_dim: int, layer: int) -> HeadRotation:
    """Layer ``layer``'s (1-based) rotation: seed ``ROTATION_SEED + layer``, shared by its heads, K and V."""
    return HeadRotation(head_dim, ROTATION_SEED + int(layer))


def stream_rotations(head_dim: int, layer: int) -> dict[str, HeadRotation]:
    """Layer ``layer``'s (1-based) rotation of each stream of :data:`ROTATED_STREAMS` (``{"k": R, "v": R}``).

    :data:`ROTATED_STREAMS` is read at the call, as a module attribute (a study may set it), so
    whatever rounds or stores a rotated entry rotates the same streams by the same ``R``.
    """
    r = layer_rotation(head_dim, layer)
    return {kind: r for kind in ROTATED_STREAMS}


def fp4_round_trip(fmt, x: torch.Tensor, rotation: HeadRotation | None = None) -> torch.Tensor:
    """What reading ``x`` back from FP4 storage gives: ``dequant(FP4(x))``, or ``Rᵀ dequant(FP4(R x))``.

    Parameters
    ----------
    fmt
        An FP4 format (:class:`~ced_csa2.kv.fp4.NVFP4` / :class:`~ced_csa2.kv.fp4.MXFP4`).
    x : torch.Tensor, shape (..., kv_dim), floating
    rotation
        The stored entry's rotation, or ``None`` for plain FP4.

    Returns
    -------
    torch.Tensor, shape (..., kv_dim), ``x.dtype``
    """
    # fmt.round_trip is dequantize(quantize(.)) bit for bit, without the packed bytes no one reads
    if rotation is None:
        return fmt.round_trip(x)
    y = rotation.rotate(x)
    return rotation.unrotate(fmt.round_trip(y), dtype=x.dtype)
