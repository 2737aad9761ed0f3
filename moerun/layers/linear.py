"""Several linear maps of one input."""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
    `native_float_linears` wrapped, for a decode-sized x; no hooks. None otherwise."""
    if kernels.has_hooks(lin):
        return None
    if type(lin) is QuantizedLinear:
        return lin.views() if lin.bias is None and kernels.native() else None
    fwd = lin.__dict__.get("forward")
    if (fwd is None or getattr(fwd, "__func__", None) is not float_linear_forward or not plain_float_linear(lin)
            or lin.weight.dtype != x.dtype or not kernels.float_decode_rows(x) or not kernels.native()):
        return None
    return kernels.float_linear_views(lin)


def head_logits(lm_head: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The LM head's logits of the final normed states h, in float32 whatever h's dtype. The
    native products accumulate in float32; a bf16 model's logits are kept at that precision,
    not rounded to bf16, as llama.cpp keeps its logits: rounded, two logits within 1/256 of
    each other tie, and argmax then takes the lower id. On the demo model's BF16 GGUF 70 of
    4080 held-out positions had a tied top logit, and top-1 agreement with llama.cpp on the
    same file was 98.90% (2026-12-03, benchmarks/gguf_parity.py). Without the native kernels,
    with hooks, or for a head of another type, the module's own bf16 output is widened."""
    if h.dtype != torch.float32 and kernels.native() and not torch.is_grad_enabled() and not kernels.has_hooks(lm_head):
        if type(lm_head) is QuantizedLinear and lm_head.bias is None:
            return kernels.qlinear_multi(h, [lm_head.views()], dtype=torch.float32)[0]
        if plain_float_linear(lm_head) and lm_head.weight.dtype == h.dtype:
            return kernels.qlinear_multi(h, [kernels.float_linear_views(lm_head)], dtype=torch.float32)[0]
    return lm_head(h).float()


def native_float_linears(net: torch.nn.Module) -> int:
    """Run each plain float linear's few-row calls (`layers.linear.plain_float_linear`:
    float32 or bf16 weight, no bias, no hooks when wrapped; at most FLOAT_LINEAR_MAX_TOKENS
    rows, or any number of bf16 rows where torch's bf16 GEMM is slow (`kernels.float_native_rows`),
    no autograd) as one native call over its weight as it is (`kernels.qlinear_multi` with
    `float_packed`), where torch's bf16 product of one row costs ~0.2 ms on a CPU without
    bf16 arithmetic. Other calls, and the module's weights and state_dict, are untouched:
    only the instance's forward is wrapped (hooks still see every call). Returns how many
    modules it wrapped. On 4 Qwen3-30B-A3B-shaped int4 layers (whose float linears are only
    the routers, inside the native MoE call) decode was 54.5 tok/s with it against 52.3
    without (median of 3 interleaved rounds, per-round ratios 0.79 / 0.96 / 1.00: within
    this shared machine's noise, 2026-12-03); what it is for is a bf16 model's one-row
    products, where torch's bf16 GEMM is slow. It replaces a module's `forward` at load, which
    issue 34 allows only with a 3% gain on the Qwen3-30B- or Qwen3.6-shaped model: not shown
    (the int4 figure above is within noise, and this Zen 4 has bf16 hardware, so torch's bf16
    GEMM is not the slow one here). Kept, not measured against the rule, because on a CPU
    without it (AVX2) a bf16 model's prefill products run through it (`kernels.float_native_rows`:
    98 against 817 ms for 512 tokens of a 2048 -> 4096 product), and `native_call_views`
    reads a float head or out_proj natively only where it wrapped them."""
    if kernels._native() is None:
        return 0
    n = 0
    for m in net.modules():
        if type(m) is torch.nn.Linear and plain_float_linear(m) and "forward" not in m.__dict__:
            m.forward = float_linear_forward.__get__(m)
            n += 1
    return n


def float_linear_forward(self, x):
    w = self._parameters["weight"]
    if (x.dtype != w.dtype or not kernels.float_native_rows(x) or not w.is_cpu or self.bias is not None
            or kernels._native() is None):
        return F.linear(x, w, self.bias)
    return kernels.qlinear_multi(x, [kernels.float_linear_views(self)], dtype=x.dtype)[0]
