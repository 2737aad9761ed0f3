"""Several linear maps of one input."""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from .quantized import QuantizedLinear


def project(x: torch.Tensor, *mods: nn.Module) -> list[torch.Tensor]:
    """[m(x) for m in mods]. When they are all packed quantized linears without bias
    (`QuantizedLinear`), or, for a decode-sized x, plain float linears (`packed_views`), and
    the native kernels run, one call computes them together (`kernels.qlinear_multi`: one
    pool job, one activation quantization for packed weights; each output is a column slice
    of one buffer, bit-identical to the separate calls). In decode, where a small
    projection's call costs tens of microseconds of overhead, this is the difference."""
    views = packed_views(*mods, x=x) if len(mods) > 1 else None
    if views is not None:
        outs = kernels.qlinear_multi(x, list(views), dtype=x.dtype)
        return outs if x.dtype in kernels.FLOAT_DTYPES else [o.to(x.dtype) for o in outs]
    return [m(x) for m in mods]


def packed_views(*mods: nn.Module, x: torch.Tensor | None = None) -> tuple | None:
    """Each module's weight as the native ops take it (`kernels.Packed`) when the native
    kernels run and every module is a packed quantized linear without bias
    (`QuantizedLinear`) or, given an x of decode size (or bf16 where torch's bf16 GEMM is
    slow: `kernels.float_native_rows`), a `plain_float_linear` (`kernels.float_linear_views`:
    read as it is; torch's GEMM is the better one for more float32 rows); None otherwise."""
    if not kernels.native():
        return None
    packed = [type(m) is QuantizedLinear and m.bias is None for m in mods]  # (list comprehensions: one call each)
    if all(packed):
        return tuple([m.views() for m in mods])
    if (x is None or not kernels.float_native_rows(x)
            or not all([p or plain_float_linear(m) for p, m in zip(packed, mods)])):
        return None
    return tuple([m.views() if p else kernels.float_linear_views(m) for p, m in zip(packed, mods)])


def plain_float_linear(lin: nn.Module) -> bool:
    """A float32 or bf16 `nn.Linear` without bias or hooks, its weight contiguous in CPU
    memory: a native op may read the weight in place of calling the module (a predictor's or
    a profiler's hook must see the call)."""
    if type(lin) is not nn.Linear:
        return False
    # the dicts behind nn.Module's attribute lookup, read directly: decode asks this of a few
    # dozen linears a token, and the lookup costs more than the checks
    params = lin._parameters
    w = params.get("weight")
    return (w is not None and "bias" in params and params["bias"] is None and w.dtype in kernels.FLOAT_DTYPES
            and w.is_cpu and w.is_contiguous() and not kernels.has_hooks(lin))


def native_call_views(lin: nn.Module, x: torch.Tensor) -> kernels.Packed | None:
    """The weight's `kernels.Packed` when `lin(x)` is exactly one native `qlinear_multi` over
    it (out rounded once to x's dtype), so that a fused op may stand in for the call: a
    `QuantizedLinear` without bias, or a plain float linear of x's dtype whose forward
    `kernels.native_float_linears` wrapped, for a decode-sized x; no hooks. None otherwise."""
    if kernels.has_hooks(lin):
        return None
    if type(lin) is QuantizedLinear:
        return lin.views() if lin.bias is None and kernels.native() else None
    fwd = lin.__dict__.get("forward")
    if (fwd is None or getattr(fwd, "__func__", None) is not kernels.float_linear_forward or not plain_float_linear(lin)
            or lin.weight.dtype != x.dtype or not kernels.float_decode_rows(x) or not kernels.native()):
        return None
    return kernels.float_linear_views(lin)
