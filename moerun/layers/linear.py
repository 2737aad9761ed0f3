"""Several linear maps of one input."""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from ..quant.modules import QuantizedLinear


def project(x: torch.Tensor, *mods: nn.Module) -> list[torch.Tensor]:
    """[m(x) for m in mods]. When they are all packed quantized linears without bias
    (`QuantizedLinear`) and the native kernels run, one call computes them together
    (`kernels.qlinear_multi`: one activation quantization, one pool job; each output is a
    column slice of one buffer, bit-identical to the separate calls). In decode, where a
    small projection's call costs tens of microseconds of overhead, this is the difference."""
    views = packed_views(*mods) if len(mods) > 1 else None
    if views is not None:
        outs = kernels.qlinear_multi(x, list(views))
        return outs if x.dtype == torch.float32 else [o.to(x.dtype) for o in outs]
    return [m(x) for m in mods]


def packed_views(*mods: nn.Module) -> tuple | None:
    """Each module's `kernels.Packed` when all are packed quantized linears without bias
    (`QuantizedLinear`) and the native kernels run; None otherwise."""
    if not kernels.native() or not all(type(m) is QuantizedLinear and m.bias is None for m in mods):
        return None
    return tuple(m.views() for m in mods)
