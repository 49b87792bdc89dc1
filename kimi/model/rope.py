"""Rotary position embedding with YaRN scaling, interleaved pairs (DeepSeek-V3 reference layout).

Math: docs/model-format.md, Math (YaRN) = DeepSeek-V3 reference `precompute_freqs_cis` /
`yarn_find_correction_range` / `yarn_linear_ramp_factor`, and `apply_rotary_emb` which rotates the pairs
(x[2i], x[2i+1]) by angle `pos * inv_freq[i]`. q_pe, k_pe and the k_pe stored in the latent KV cache all
keep this interleaved layout (q.k is the same as HF's de-interleaved "rotate-half" form).
"""

from __future__ import annotations

import math

import torch

from kimi.config import ModelConfig, RopeScaling, yarn_get_mscale


def yarn_correction_range(
    beta_fast: float, beta_slow: float, dim: int, base: float, original_max_position_embeddings: int
) -> tuple[float, float]:
    """The YaRN ramp's [low, high] pair-index bounds (docs/model-format.md, Math).

    `corr(r) = dim * ln(orig / (r * 2 pi)) / (2 ln base)`; `low = max(floor(corr(beta_fast)), 0)`,
    `high = min(ceil(corr(beta_slow)), dim - 1)`; when equal, `high += 0.001` (avoids a 0 division in the ramp).
    Returns python floats.
    """

    def corr(r: float) -> float:
        return dim * math.log(original_max_position_embeddings / (r * 2 * math.pi)) / (2 * math.log(base))

    low = float(max(math.floor(corr(beta_fast)), 0))
    high = float(min(math.ceil(corr(beta_slow)), dim - 1))
    if low == high:
        high += 0.001
    return low, high


def rope_inv_freq(dim: int, base: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [dim // 2] float32 for rotary dim `dim` (64 for Kimi) and theta `base`.

    Without scaling: `base^(-2i/dim)`. With YaRN (always applied when configured, not only past the original
    context): `inv_freq = f_extra / factor * ramp + f_extra * (1 - ramp)`, `ramp = clamp((i - low) / (high - low),
    0, 1)` with (low, high) from `yarn_correction_range` (docs/model-format.md, Math). Computed in float64, returned
    as float32.
    """
    i = torch.arange(dim // 2, dtype=torch.float64)  # [dim/2]
    f_extra = base ** (-2.0 * i / dim)  # [dim/2]
    if scaling is None:
        return f_extra.float()
    f_inter = f_extra / scaling.factor  # [dim/2]
    low, high = yarn_correction_range(
        scaling.beta_fast, scaling.beta_slow, dim, base, scaling.original_max_position_embeddings
    )
    ramp = ((i - low) / (high - low)).clamp(0.0, 1.0)  # [dim/2]
    return (f_inter * ramp + f_extra * (1.0 - ramp)).float()


def rope_mscale(scaling: RopeScaling | None) -> float:
    """cos/sin multiplier: `get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)` (1.0 for Kimi)."""
    if scaling is None:
        return 1.0
    return yarn_get_mscale(scaling.factor, scaling.mscale) / yarn_get_mscale(scaling.factor, scaling.mscale_all_dim)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs: `y[2i] = x[2i] cos_i - x[2i+1] sin_i`, `y[2i+1] = x[2i+1] cos_i + x[2i] sin_i`.

    x: [T, R] or [T, H, R] (any float dtype); cos, sin: [T, R/2] float32 (per-token angles).
    Returns the same shape and dtype as x, still interleaved; computed in float32 (DeepSeek-V3 reference
    `apply_rotary_emb`).
    """
    shape = x.shape
    xf = x.float().reshape(*shape[:-1], shape[-1] // 2, 2)  # [T, (H,) R/2, 2]
    view = (shape[0],) + (1,) * (x.dim() - 2) + (shape[-1] // 2,)
    c = cos.reshape(view)  # [T, (1,) R/2]
    s = sin.reshape(view)  # [T, (1,) R/2]
    x0, x1 = xf[..., 0], xf[..., 1]  # [T, (H,) R/2] each
    y = torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1)  # [T, (H,) R/2, 2]
    return y.reshape(shape).to(x.dtype)


class RotaryEmbedding:
    """cos/sin cache for the model's rotary dim (`qk_rope_head_dim`) with YaRN (docs/model-format.md, Math).

    `cos_cache`, `sin_cache`: [max_positions, R/2] float32 (mscale folded in), built eagerly;
    max_positions defaults to cfg.max_position_embeddings (64 MiB for Kimi's 262144 x 32 x 2 floats).
    """

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None, device: torch.device | str = "cpu"):
        self.dim = cfg.qk_rope_head_dim
        self.max_positions = int(max_positions or cfg.max_position_embeddings)
        self.inv_freq = rope_inv_freq(self.dim, cfg.rope_theta, cfg.rope_scaling)  # [R/2] f32
        m = rope_mscale(cfg.rope_scaling)
        t = torch.arange(self.max_positions, dtype=torch.float64)  # [P]
        ang = torch.outer(t, self.inv_freq.double())  # [P, R/2]
        self.cos_cache = (ang.cos() * m).float().to(device)  # [P, R/2]
        self.sin_cache = (ang.sin() * m).float().to(device)  # [P, R/2]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos [T, R/2], sin [T, R/2]) float32. Positions must be < max_positions."""
        return self.cos_cache[positions], self.sin_cache[positions]

    def __call__(
        self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rope q_pe [T, H, R] and k_pe [T, R] at `positions` [T]; returns both, interleaved, input dtypes."""
        cos, sin = self.cos_sin(positions)
        return apply_rope_interleaved(q_pe, cos, sin), apply_rope_interleaved(k_pe, cos, sin)
