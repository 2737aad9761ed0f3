"""RMSNorm in the two forms MoE checkpoints use."""

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, or * (1 + w) when `zero_centered` (Qwen3.5 / Qwen3-Next).

    Statistics in fp32; the weight is applied after casting back, as the reference does.
    """

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centered)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    if x.dtype == weight.dtype == torch.float32:
        # nothing to cast: one native call for a few rows (decode runs a few of these per layer)
        return kernels.rms_norm(x, weight, eps, 1.0 if zero_centered else 0.0)
    x32 = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)  # one fused op instead of four
    if zero_centered:
        # the zero-centred form multiplies in fp32 before casting back
        return (x32 * (1.0 + weight.float())).to(x.dtype)
    return weight * x32.to(x.dtype)
