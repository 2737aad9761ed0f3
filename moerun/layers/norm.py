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
        if x.dtype == torch.bfloat16 and x.numel() <= kernels.RMS_NORM_MAX and kernels.native() and not torch.is_grad_enabled():
            # a bf16 decode step: the native norm in float32, rounded once at the end, where
            # torch's ops cost ~100 us a row in bf16
            return kernels.rms_norm(x, kernels.float32_weight(self), self.eps, 1.0 if self.zero_centered else 0.0,
                                    dtype=x.dtype)
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


def rms_norm_cat(owner: nn.Module, norm_names: tuple[str, ...], xs: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat([owner.<name>(x) for name, x in zip(norm_names, xs)], dim=-1) for inputs of one
    shape: as one native call over the concatenation (each column block normed with its own
    weight, `kernels.rms_norm` with a [G, D] weight; bit-identical to the separate norms) when
    the inputs are float32 (or bf16 of decode size), the norms share eps, none has hooks and
    autograd is off; otherwise the norms one by one. An MTP head's input (the next token's embedding and the hidden state, each normed,
    side by side) is the user: once per draft, so the norms and their stacked weights are
    kept on `owner` (`kernels.native_views`)."""

    def plan(*weights):
        norms = [owner.get_submodule(n) for n in norm_names]
        return norms, stacked_norm_weights(norms)

    norms, weights = kernels.native_views(owner, tuple(f"{n}.weight" for n in norm_names), plan)
    dtype = xs[0].dtype
    if (weights is not None and kernels.native() and all(x.dtype == dtype and x.shape == xs[0].shape for x in xs)
            and (dtype == torch.float32 or (dtype == torch.bfloat16 and xs[0].numel() * len(xs) <= kernels.RMS_NORM_MAX))
            and not torch.is_grad_enabled() and not kernels.has_hooks(*norms)):
        # bf16 (decode sizes): float32 in, rounded once at the end, as each RMSNorm's own bf16 path
        u = torch.cat(xs, dim=-1)
        return kernels.rms_norm(u.view(-1, len(xs), xs[0].shape[-1]), weights, norms[0].eps, dtype=dtype).view(u.shape)
    return torch.cat([n(x) for n, x in zip(norms, xs)], dim=-1)


def stacked_norm_weights(norms) -> torch.Tensor | None:
    """RMSNorms' effective weights (w, or 1 + w zero-centred) stacked [G, D] in float32: one
    native norm over their column blocks (`kernels.rms_norm` with a [G, D] weight) stands in
    for them all. None unless they share eps."""
    if len({n.eps for n in norms}) != 1:
        return None
    return torch.stack([n.weight.detach().float() + (1.0 if n.zero_centered else 0.0) for n in norms])
