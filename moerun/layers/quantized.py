"""Drop-in quantized modules: `QuantizedLinear` for `nn.Linear`, `QuantizedExperts` for
`moerun.layers.moe.Experts`. Same forward signatures; weights kept packed as buffers (so a
state_dict holds the quantized checkpoint) and run through `moerun.kernels`."""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from ..kernels import formats
from ..layers.routes import routed

# N tokens, H hidden, I expert width, E experts, K experts per token

CHUNK_ROWS = 4096  # quantize a big linear (an LM head of 150k rows) this many rows at a time


class QuantizedLinear(nn.Module):
    native_kernels = True  # runs moerun.kernels (kernels.split_threads looks for this)

    keeps_dtype = True  # the loader keeps the buffers' dtypes (fp16 scales, fp32 bias)

    def __init__(self, in_features: int, out_features: int, fmt: str, bias: bool = False):
        super().__init__()
        if fmt not in formats.FORMATS:
            raise ValueError(f"unknown quantization format {fmt!r}")
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        # raw GGUF formats: uint8 rows of their blocks, no separate scales (ValueError unless
        # in_features is a whole number of blocks)
        row, nb, qdtype = formats.packed_shape(fmt, in_features)
        self.register_buffer("qweight", torch.zeros(out_features, row, dtype=qdtype))
        self.register_buffer("scales", torch.zeros(out_features, nb, dtype=torch.float16))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    @classmethod
    def from_linear(cls, lin: nn.Linear, fmt: str) -> "QuantizedLinear":
        """`lin` quantized to fmt, or to llama.cpp's fallback for it where in_features is not a
        whole number of fmt's blocks (`formats.fit`)."""
        fmt = formats.fit(fmt, lin.in_features)
        m = cls(lin.in_features, lin.out_features, fmt, bias=lin.bias is not None)
        w = lin.weight.detach()
        for i in range(0, lin.out_features, CHUNK_ROWS):  # rows are independent: bounded float32 temporaries
            m.qweight[i : i + CHUNK_ROWS], m.scales[i : i + CHUNK_ROWS] = formats.quantize(w[i : i + CHUNK_ROWS], fmt)
        if lin.bias is not None:
            m.bias = lin.bias.detach().float().clone()
        return m

    @property
    def formats(self) -> str:
        return self.fmt

    def views(self) -> kernels.Packed:
        """The weight as the native ops take it (kept until a buffer is replaced)."""
        return kernels.native_views(self, ("qweight", "scales"), lambda q, s: kernels.packed(q, s, self.fmt))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        views = self.views() if kernels.native() else None
        y = kernels.qlinear(x.reshape(-1, self.in_features), self.qweight, self.scales, self.fmt, self.in_features,
                            views)
        if self.bias is not None:
            y = y + self.bias
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


BUFFERS = ("gate_q", "gate_scales", "up_q", "up_scales", "down_q", "down_scales")  # QuantizedExperts' packed weights


class QuantizedExperts(nn.Module):
    """Routed experts with gate/up [E, I, H] packed in `fmt` and down [E, H, I] in `down_fmt`
    (default: the same; llama.cpp's Q4_K_M gives some layers' down projections Q6_K)."""

    routed_experts = True  # tells `moerun info` and the expert machinery what this module is
    native_kernels = True
    keeps_dtype = True

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, fmt: str,
                 down_fmt: str | None = None):
        super().__init__()
        down_fmt = down_fmt or fmt
        for f in (fmt, down_fmt):
            if f not in formats.FORMATS:
                raise ValueError(f"unknown quantization format {f!r}")
        self.num_experts, self.hidden_size, self.intermediate_size, self.fmt, self.down_fmt = (
            num_experts, hidden_size, intermediate_size, fmt, down_fmt)
        E, H, I = num_experts, hidden_size, intermediate_size
        for name, rows, cols, f in (("gate", I, H, fmt), ("up", I, H, fmt), ("down", H, I, down_fmt)):
            row, nb, qdtype = formats.packed_shape(f, cols)
            self.register_buffer(f"{name}_q", torch.zeros(E, rows, row, dtype=qdtype))
            self.register_buffer(f"{name}_scales", torch.zeros(E, rows, nb, dtype=torch.float16))

    @classmethod
    def from_experts(cls, experts: nn.Module, fmt: str, down_fmt: str | None = None) -> "QuantizedExperts":
        """gate/up in fmt, down in down_fmt (default fmt), each fitted to its row width
        (`formats.fit`: llama.cpp's fallback where it is not a whole number of blocks)."""
        E, I, H = experts.gate_proj.shape
        m = cls(E, H, I, formats.fit(fmt, H), formats.fit(down_fmt or fmt, I))
        with torch.no_grad():
            for name, p, f in (("gate", experts.gate_proj, m.fmt), ("up", experts.up_proj, m.fmt),
                               ("down", experts.down_proj, m.down_fmt)):
                q, s = getattr(m, f"{name}_q"), getattr(m, f"{name}_scales")
                for e in range(E):  # one expert at a time: no float32 copy of the whole stack
                    q[e], s[e] = formats.quantize(p[e], f)
        return m

    def fused_views(self, x: torch.Tensor) -> kernels.ExpertViews | None:
        """The experts as `kernels.moe_block_args` takes them, when the native kernels run (see
        `layers.moe.moe_residual`)."""
        if not kernels.native():
            return None
        views = kernels.native_views(self, BUFFERS, kernels.expert_views)  # the forward's own
        return kernels.ExpertViews(formats.expert_code(self.fmt, self.down_fmt), *views)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], ids [N, K] expert indices, weights [N, K] -> [N, H]."""
        routed(self, x, ids, weights)
        views = kernels.native_views(self, BUFFERS, kernels.expert_views) if kernels.native() else None
        y = kernels.moe_experts(x, ids, weights, self.gate_q, self.gate_scales, self.up_q, self.up_scales,
                                self.down_q, self.down_scales, self.fmt, self.intermediate_size, views, dtype=x.dtype,
                                down_fmt=self.down_fmt)
        return y.to(x.dtype)

    @property
    def formats(self) -> str:
        """fmt, or `fmt/down_fmt` where down differs (a checkpoint's `modules` entry)."""
        return self.fmt if self.down_fmt == self.fmt else f"{self.fmt}/{self.down_fmt}"

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, fmt={self.fmt}"
                + (f", down_fmt={self.down_fmt}" if self.down_fmt != self.fmt else ""))
