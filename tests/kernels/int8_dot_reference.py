"""Our int8-dot kernels' activation rounding in torch (``kernels/cpu/int8_dot.h``
``quantize_row``), for the kernels' reference products."""

from __future__ import annotations

import torch


def round_activations(x: torch.Tensor, act_bits: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [m, k] fp32 -> (xg [m, k / 32, 32] the groups of x, q the same shape: each group's
    codes, dx [m, k / 32, 1]: its step), so the rounded activations are ``q * dx``. Groups of 32
    to int8 (dx = max|x| / 127, round to nearest even); with 16 bits ``q`` also carries the
    residual x - dx q rounded to 1/256 steps of dx (clamped to +-127)."""
    m, k = x.shape
    xg = x.view(m, k // 32, 32)
    dx = xg.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(dx > 0, 1 / dx, torch.zeros(()))
    q = torch.round(xg * inv)
    if act_bits == 16:
        q = q + torch.round((xg - dx * q) * (inv * 256)).clamp(-127, 127) / 256
    return xg, q, dx
