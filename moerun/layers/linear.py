"""Several linear maps of one input."""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels


def project(x: torch.Tensor, *mods: nn.Module) -> list[torch.Tensor]:
    """[m(x) for m in mods]. When they are all packed quantized linears without bias
    (`QuantizedLinear`) and the native kernels run, one call computes them together
    (`kernels.qlinear_multi`: one activation quantization, one pool job; each output is a
    column slice of one buffer, bit-identical to the separate calls). In decode, where a
    small projection's call costs tens of microseconds of overhead, this is the difference."""
    from ..quant.modules import QuantizedLinear

    if (len(mods) > 1 and kernels.native()
            and all(type(m) is QuantizedLinear and m.bias is None for m in mods)):
        outs = kernels.qlinear_multi(x, [m.views() for m in mods])
        return outs if x.dtype == torch.float32 else [o.to(x.dtype) for o in outs]
    return [m(x) for m in mods]
