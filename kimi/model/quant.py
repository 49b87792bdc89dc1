"""Weight quantisation formats of the Kimi-K2 checkpoints (plain PyTorch reference; CPU or GPU).

INT4 "pack-quantized" (compressed-tensors; K2-Thinking, K2.5, K2.6 routed experts; docs/model-format.md, Tensors):
symmetric, one scale per `group_size` (32) consecutive inputs of a row,
``q = clamp(round(w / scale), -8, 7)``, stored nibble ``q + 8``; element k of row n sits in bits
``[4*(k % 8), 4*(k % 8) + 4)`` of ``weight_packed[n, k // 8]`` (lowest nibble first, packed along the
input dim). Dequant: ``W[n, k] = (nibble - 8) * weight_scale[n, k // group_size]``.
The scale of a group is ``absmax / 7.5`` as in compressed-tensors' `calculate_qparams` for symmetric
weights (``max(|min|, |max|) / ((q_max - q_min) / 2)`` with q in [-8, 7]), rounded to the stored scale
dtype before quantising, and a zero scale replaced by the dtype's eps.

FP8 block (K2-Instruct; DeepSeek-V3 `weight_dequant`): float8_e4m3fn weights with one float32
`weight_scale_inv` per 128 x 128 tile, ``W[i, j] = float(q[i, j]) * scale_inv[i // 128, j // 128]``
(multiplied despite the name), ragged last tiles counted with ceil.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "FP8_MAX",
    "dequant_fp8_block",
    "dequant_int4",
    "pack_int4",
    "pack_nibbles",
    "quant_fp8_block",
    "unpack_int4",
]

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0

# Bit offset of element k % 8 inside its int32 word: 0, 4, ..., 28.
_SHIFTS = tuple(4 * i for i in range(8))


def _shifts(device: torch.device) -> Tensor:
    return torch.tensor(_SHIFTS, dtype=torch.int32, device=device)


def pack_int4(w: Tensor, group_size: int = 32, scale_dtype: torch.dtype = torch.bfloat16) -> tuple[Tensor, Tensor]:
    """Quantise and pack a weight matrix into compressed-tensors pack-quantized INT4.

    Args:
        w: [N, K] floating weight (any float dtype; computed in float32). K must be a multiple of
            `group_size` and of 8.
        group_size: inputs per scale (32 for Kimi).
        scale_dtype: dtype of the stored scales (bfloat16 in the Kimi checkpoints).

    Returns:
        weight_packed: [N, K // 8] int32, nibble (q + 8) of element k in bits [4*(k%8), 4*(k%8)+4) of word k // 8.
        weight_scale: [N, K // group_size] `scale_dtype`, absmax(group) / 7.5 (see module docstring).

    Raises:
        ValueError: w is not 2-D floating, or K is not divisible by group_size and 8.
    """
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"pack_int4: need a 2-D floating tensor, got {tuple(w.shape)} {w.dtype}")
    n, k = w.shape
    if k % group_size or k % 8:
        raise ValueError(f"pack_int4: K={k} must be a multiple of group_size={group_size} and of 8")
    wf = w.float().reshape(n, k // group_size, group_size)
    absmax = wf.abs().amax(dim=-1)  # [N, K/g]
    scale = (absmax / 7.5).to(scale_dtype)
    eps = torch.finfo(scale_dtype).eps
    scale = torch.where(scale == 0, torch.full_like(scale, eps), scale)
    q = torch.clamp(torch.round(wf / scale.float().unsqueeze(-1)), -8, 7).to(torch.int8).reshape(n, k)
    return pack_nibbles(q), scale


def pack_nibbles(q: Tensor) -> Tensor:
    """[N, K] int8 values in [-8, 7] -> [N, K // 8] int32 (nibble q + 8, lowest nibble first)."""
    n, k = q.shape
    nib = (q.to(torch.int32) + 8).reshape(n, k // 8, 8)  # [N, K/8, 8] in [0, 15]
    # Nibbles occupy disjoint bits, so a sum is a bitwise OR; the top nibble may set the sign bit, which
    # int32 wrap-around handles (2^31 overflows to a negative int32, bit pattern preserved).
    words = (nib.to(torch.int64) << _shifts(q.device).to(torch.int64)).sum(dim=-1)  # [N, K/8] in [0, 2^32)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def unpack_int4(weight_packed: Tensor) -> Tensor:
    """Unpack compressed-tensors INT4 words into signed values.

    Args:
        weight_packed: [N, K // 8] int32 (pack-quantized layout).

    Returns:
        [N, K] int8 with values in [-8, 7] (stored nibble - 8).

    Raises:
        ValueError: weight_packed is not 2-D int32.
    """
    if weight_packed.dim() != 2 or weight_packed.dtype != torch.int32:
        raise ValueError(
            f"unpack_int4: need a 2-D int32 tensor, got {tuple(weight_packed.shape)} {weight_packed.dtype}"
        )
    n, kw = weight_packed.shape
    nib = (weight_packed.unsqueeze(-1) >> _shifts(weight_packed.device)) & 0xF  # [N, K/8, 8] (arith shift, masked)
    return (nib - 8).to(torch.int8).reshape(n, kw * 8)


def dequant_int4(
    weight_packed: Tensor, weight_scale: Tensor, group_size: int = 32, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Dequantise compressed-tensors INT4: ``W[n, k] = (nibble - 8) * weight_scale[n, k // group_size]``.

    Args:
        weight_packed: [N, K // 8] int32.
        weight_scale: [N, K // group_size] floating (bfloat16 in checkpoints); multiplied in float32.
        group_size: inputs per scale.
        dtype: output dtype.

    Returns:
        [N, K] `dtype`.

    Raises:
        ValueError: shapes of weight_packed and weight_scale disagree.
    """
    q = unpack_int4(weight_packed)  # [N, K]
    n, k = q.shape
    if k % group_size or tuple(weight_scale.shape) != (n, k // group_size):
        raise ValueError(
            f"dequant_int4: weight_scale {tuple(weight_scale.shape)} does not match packed [{n}, {k}] "
            f"with group_size {group_size}"
        )
    w = q.float().reshape(n, k // group_size, group_size) * weight_scale.float().unsqueeze(-1)
    return w.reshape(n, k).to(dtype)


def _check_fp8_args(shape: torch.Size, block: tuple[int, int], what: str) -> None:
    if len(shape) != 2:
        raise ValueError(f"{what}: need a 2-D tensor, got {tuple(shape)}")
    if len(block) != 2 or block[0] <= 0 or block[1] <= 0:
        raise ValueError(f"{what}: bad block {block}")


def quant_fp8_block(w: Tensor, block: tuple[int, int] = (128, 128)) -> tuple[Tensor, Tensor]:
    """Quantise to float8_e4m3fn with one float32 scale per `block` tile (DeepSeek-V3 / K2-Instruct format).

    The scale of a tile is ``absmax / 448`` (448 = largest e4m3 value; 1.0 for an all-zero tile), so that
    ``float(q) * scale_inv`` reconstructs the weight; ragged last tiles (N or K not a multiple of the
    block) use ceil.

    Args:
        w: [N, K] floating.
        block: (rows, cols) of a tile.

    Returns:
        q: [N, K] torch.float8_e4m3fn.
        scale_inv: [ceil(N / block[0]), ceil(K / block[1])] float32.

    Raises:
        ValueError: w is not 2-D or block is invalid.
    """
    _check_fp8_args(w.shape, block, "quant_fp8_block")
    n, k = w.shape
    b0, b1 = block
    nb0, nb1 = -(-n // b0), -(-k // b1)
    wf = w.float()
    padded = torch.zeros(nb0 * b0, nb1 * b1, dtype=torch.float32, device=w.device)
    padded[:n, :k] = wf
    tiles = padded.reshape(nb0, b0, nb1, b1)
    absmax = tiles.abs().amax(dim=(1, 3))  # [nb0, nb1]
    scale_inv = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    q = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.reshape(nb0 * b0, nb1 * b1)[:n, :k].to(torch.float8_e4m3fn)
    return q.contiguous(), scale_inv.contiguous()


def dequant_fp8_block(
    w_fp8: Tensor, scale_inv: Tensor, block: tuple[int, int] = (128, 128), dtype: torch.dtype = torch.float32
) -> Tensor:
    """Dequantise FP8 block weights: ``W[i, j] = float(w_fp8[i, j]) * scale_inv[i // b0, j // b1]``.

    Args:
        w_fp8: [N, K] torch.float8_e4m3fn.
        scale_inv: [ceil(N / b0), ceil(K / b1)] float (float32 in checkpoints).
        block: (b0, b1).
        dtype: output dtype (computed in float32).

    Returns:
        [N, K] `dtype`.

    Raises:
        ValueError: scale_inv's shape is not the ceil-divided tile grid of w_fp8.
    """
    _check_fp8_args(w_fp8.shape, block, "dequant_fp8_block")
    n, k = w_fp8.shape
    b0, b1 = block
    grid = (-(-n // b0), -(-k // b1))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(
            f"dequant_fp8_block: scale_inv {tuple(scale_inv.shape)} does not match weight [{n}, {k}] "
            f"with block {block} (need {grid})"
        )
    s = scale_inv.float().repeat_interleave(b0, dim=0)[:n].repeat_interleave(b1, dim=1)[:, :k]  # [N, K]
    return (w_fp8.float() * s).to(dtype)
