"""Routed experts: weights stacked [E, out, in], tokens grouped per expert.

A model file computes the router, its top-k and any renormalisation itself, then calls
`experts(x, ids, weights)`. Everything about *where* an expert's weights live and *which
kernel* runs it sits behind that call: the engine may swap this module for a quantized or
store-backed one with the same signature, and the model never knows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..kernels.reference import expert_mlp
from .linear import packed_views, plain_float_linear, project
from .norm import RMSNorm
from .routes import native_observer, route_observers, routed, routes_seen

# N tokens, H hidden, I expert width, E experts, K experts per token


class Experts(nn.Module):
    native_kernels = True  # decode-sized passes run kernels.moe_experts_float (kernels.split_threads)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], ids [N, K] expert indices, weights [N, K] -> [N, H]. Decode-sized passes
        run as one native call (`kernels.moe_experts_float`), the rest expert by expert."""
        routed(self, x, ids, weights)
        if native_float_experts(x, self.gate_proj):
            views = kernels.native_views(self, EXPERT_WEIGHTS, kernels.expert_views)
            return kernels.moe_experts_float(x, ids, weights, self.gate_proj, self.up_proj, self.down_proj,
                                             views=views, dtype=x.dtype).to(x.dtype)
        return expert_mlp(x, ids, weights, self.gate_proj, self.up_proj, self.down_proj)

    def fused_views(self, x: torch.Tensor) -> kernels.ExpertViews | None:
        """The experts as `kernels.moe_block_args` takes them, for a pass that would run natively
        here (`native_float_experts`; see `moe_residual`)."""
        if not native_float_experts(x, self.gate_proj):
            return None
        g, u, d = kernels.native_views(self, EXPERT_WEIGHTS, kernels.expert_views)  # the forward's own
        return kernels.ExpertViews(kernels.FLOAT_FORMATS[self.gate_proj.dtype][1], g, [], u, [], d, [])


EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


def native_float_experts(x: torch.Tensor, gate: torch.Tensor) -> bool:
    """Whether x [N, H] goes through the native float experts kernel: a decode-sized pass, or a
    bf16 one of any size where torch's bf16 GEMMs are slow, without autograd
    (`kernels.float_native_rows`), float32 or bf16 weights contiguous in CPU memory (up and
    down are alike wherever gate is), and the extension in use."""
    return (gate.dtype in kernels.FLOAT_DTYPES and gate.is_cpu and gate.is_contiguous()
            and kernels.float_native_rows(x) and kernels.native())



def softmax_topk(gate: nn.Linear, h: torch.Tensor, k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax top-k routing of Qwen-MoE, Mixtral and OLMoE: probabilities over all experts
    in fp32, the k largest, renormalised over them when `renorm` -> (weights [N, k] in h's
    dtype, ids [N, k]). Decode-sized passes through a float router without hooks run as one
    native call (`kernels.route_softmax_topk`, logits in float32 from the weights as they
    are); hooks on the router (predictors, profilers) see it called as before."""
    if h.shape[0] <= kernels.ROUTE_MAX_TOKENS and native_float_linear(gate, h) and kernels.native():
        weights, ids = kernels.route_softmax_topk(h, kernels.float32_weight(gate), k, renorm)
        return (weights if h.dtype == torch.float32 else weights.to(h.dtype)), ids
    probs = gate(h).float().softmax(-1)  # [N, E]
    weights, ids = probs.topk(k, dim=-1)  # [N, k]
    if renorm:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(h.dtype), ids


def sigmoid_grouped_topk(router: nn.Module, h: torch.Tensor, k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's grouped sigmoid routing of h [N, H] by `router` (its `weight` and
    `routing()`, a `kernels.SigmoidRouting`) -> (weights [N, k] in fp32, ids [N, k]):
    decode-sized passes as one native call (`kernels.route_sigmoid_grouped`), the rest as its
    torch reference."""
    if sigmoid_native(router, h):
        return kernels.route_sigmoid_grouped(h, kernels.float32_weight(router), k, renorm, router.routing())
    return kernels.route_sigmoid_grouped_ref(h, router.weight, k, renorm, router.routing())


def sigmoid_native(router: nn.Module, h: torch.Tensor) -> bool:
    """Whether h's grouped sigmoid routing runs natively (also inside the fused MoE half): a
    decode-sized float pass without autograd, float router weight and bias."""
    return (h.shape[0] <= kernels.ROUTE_MAX_TOKENS and h.dtype in kernels.FLOAT_DTYPES
            and router.weight.dtype in kernels.FLOAT_DTYPES and router.routing().bias.dtype in kernels.FLOAT_DTYPES
            and not torch.is_grad_enabled() and kernels.native())


def moe_residual(x: torch.Tensor, norm: nn.Module, block: nn.Module) -> torch.Tensor:
    """x + block(norm(x)): a decoder layer's MLP half. For a decode-sized x through a softmax
    top-k MoE block (`gate`: the router, `top_k`, `norm_topk_prob`, `experts`, and maybe a
    shared expert with its gate, `shared_expert` and `shared_expert_gate`) whose parts all
    run natively, one native call (`kernels.moe_block_run`) instead of four and two torch adds:
    bit-identical to the modules one by one, which run otherwise (`moe_fusable`). Route
    observers on the experts (predictors, profilers: `layers.routes`) are called by the
    native op once the router has picked. Forward pre-hooks on the experts are called after
    it with the arguments the experts would have had; one that returns new arguments cannot
    be honoured there and raises. A route mask on the experts is marked natively.
    A dense `GatedMLP` block is `mlp_residual`'s."""
    if type(block) is GatedMLP:
        return mlp_residual(x, norm, block)
    plan = moe_fusable(x, norm, block)
    if plan is None:
        return x + block(norm(x))
    experts, args = plan
    hooks = experts._forward_pre_hooks
    r = kernels.moe_block_run(x.reshape(-1, x.shape[-1]), args, observe=bool(hooks), seen=routes_seen(experts),
                              observer=native_observer(experts, x.dtype))
    if not hooks:
        return r.view(x.shape)
    call_observers(experts, r[1:], routes=False)
    return r[0].view(x.shape)


def mlp_residual(x: torch.Tensor, norm: nn.Module, mlp: "GatedMLP") -> torch.Tensor:
    """x + mlp(norm(x)): a decoder layer's dense MLP half (DeepSeek-V3's first layers, Qwen3-MoE's
    `mlp_only_layers`). For a decode-sized x whose parts all run natively, one native call
    (`kernels.mlp_block_run`) in place of the norm, the MLP and a torch add: bit-identical to
    them, which run otherwise (`mlp_fusable`). Its plan, (None, the op's arguments), is what the
    layer stack takes as the layer's MLP half (`layers.stack`)."""
    plan = mlp_fusable(x, norm, mlp)
    if plan is None:
        return x + mlp(norm(x))
    return kernels.mlp_block_run(x.reshape(-1, x.shape[-1]), plan[1]).view(x.shape)


def mlp_half_plan(x: torch.Tensor, norm: nn.Module, block: nn.Module) -> tuple | None:
    """A layer's MLP half as one native call (the experts module or None for a dense MLP, and
    the op's arguments): `moe_fusable`'s or `mlp_fusable`'s, as `moe_residual` runs it; None
    where it is not one native call. The decode program (`layers.stack`) builds its MLP
    halves from it once a run."""
    return mlp_fusable(x, norm, block) if type(block) is GatedMLP else moe_fusable(x, norm, block)


def mlp_fusable(x: torch.Tensor, norm: nn.Module, mlp: "GatedMLP") -> tuple | None:
    """(None, `kernels.mlp_block_args`) when x may run through norm and mlp in one native call:
    a decode-sized float32 or bf16 pass without autograd, a plain or zero-centred `RMSNorm`
    of x's dtype, the MLP's linears packed or plain float ones (`GatedMLP._packed_views`), no
    hooks on any of them; None otherwise. Kept on the MLP (`kernels.module_plan`)."""
    if (type(norm) is not RMSNorm or x.dtype not in kernels.FLOAT_DTYPES or torch.is_grad_enabled()
            or not _decode_sized(x) or x.numel() > kernels.RMS_NORM_MAX or not kernels.native()):
        return None
    mods = (norm, mlp, *mlp._modules.values())
    if kernels.has_hooks(*mods):
        return None
    key = (x.dtype, norm.eps, norm.zero_centered)
    return kernels.module_plan(mlp, mods, key, lambda: _mlp_plan(x, norm, mlp))


def _mlp_plan(x: torch.Tensor, norm: nn.Module, mlp: "GatedMLP") -> tuple | None:
    h = x.reshape(-1, x.shape[-1])
    views = mlp._packed_views(h)
    if norm.weight.dtype != x.dtype or views is None:
        return None
    return None, kernels.mlp_block_args(*kernels.norm_args(norm), views)


def call_observers(experts: nn.Module, args: tuple, routes: bool = True) -> None:
    """Call the experts' route observers (`layers.routes`; unless `routes` is False: the op
    called them) and forward pre-hooks with the arguments (h, ids, weights) a fused op ran
    them on in their stead; a hook that returns new arguments cannot be honoured there and
    raises."""
    if routes:
        for fn in route_observers(experts):
            fn(*args)
    for key, hook in list(experts._forward_pre_hooks.items()):
        kw = key in experts._forward_pre_hooks_with_kwargs
        if (hook(experts, args, {}) if kw else hook(experts, args)) is not None:
            raise RuntimeError(f"a forward pre-hook on {type(experts).__name__} returned new arguments: "
                               "the fused MoE block cannot take them (moerun.layers.moe.moe_residual)")


def moe_fusable(x: torch.Tensor, norm: nn.Module, block: nn.Module) -> tuple | None:
    """What `moe_residual` passes to `kernels.moe_block_run` (the experts module, and the op's
    weights and settings from `kernels.moe_block_args`: the norm's and the router's float32
    weights, the experts' `fused_views`, the shared expert's packed views and its gate as
    float32 [H] or None) when it may run x through norm and block in one
    native call: a decode-sized float32 or bf16 pass without autograd, a zero-centred or plain
    `RMSNorm` of x's dtype, a block of the shape above whose parts all run natively on their
    own, no hooks on the norm, the block, the router or the shared expert, no forward hooks on
    the experts and none global; None otherwise. Kept on the block (`kernels.module_plan`)."""
    mods = block._modules
    experts = mods.get("experts")
    if (type(norm) is not RMSNorm or not hasattr(experts, "fused_views") or x.dtype not in kernels.FLOAT_DTYPES
            or torch.is_grad_enabled()
            or not _decode_sized(x) or x.numel() > kernels.RMS_NORM_MAX or not kernels.native()):
        return None
    gate = mods["gate"]
    se = mods.get("shared_expert")
    others = (norm, block, gate)
    if se is not None:
        others += (se, *se._modules.values(), mods["shared_expert_gate"])
    shared = mods.get("shared_experts")  # DeepSeek-V3's: no gate
    if shared is not None:
        others += (shared, *shared._modules.values())
    if kernels.has_hooks(*others) or experts._forward_hooks:
        return None
    # the key: what the plan takes besides the modules' tensors (settings are plain attributes)
    sigmoid = hasattr(gate, "routing")
    routing = (gate.top_k, gate.norm_topk_prob, gate.n_group, gate.topk_group, gate.scaling) if sigmoid else \
        (block.top_k, block.norm_topk_prob)
    key = (x.dtype, norm.eps, norm.zero_centered, *routing)
    return kernels.module_plan(block, (experts, *others), key, lambda: _moe_plan(x, norm, block))


def _decode_sized(x: torch.Tensor) -> bool:
    """A pass the MoE half runs as one native call: a few tokens (FLOAT_LINEAR_MAX_TOKENS,
    ROUTE_MAX_TOKENS; a prompt's torch GEMMs are better above), or a batch's decode step or
    verification pass of up to FUSED_MAX_ROWS tokens in all, whose rows must each get the bits
    of a decode step alone (a batch of 10 rows verifying one draft each is 20 tokens)."""
    rows = x.numel() // x.shape[-1]
    if rows <= min(kernels.FLOAT_LINEAR_MAX_TOKENS, kernels.ROUTE_MAX_TOKENS):
        return True
    return x.dim() == 3 and x.shape[0] > 1 and x.shape[1] <= kernels.FUSED_MAX_TOKENS and rows <= kernels.FUSED_MAX_ROWS


def _moe_plan(x: torch.Tensor, norm: nn.Module, block: nn.Module) -> tuple | None:
    """The plan of `moe_fusable`. The router is a softmax top-k `gate` linear with the block's
    `top_k` and `norm_topk_prob`, or a grouped sigmoid router (DeepSeek-V3's: a `gate` with
    `routing()`, `top_k` and `norm_topk_prob`: `sigmoid_grouped_topk`); the shared expert is
    `shared_expert` with its scalar `shared_expert_gate`, or `shared_experts` without one."""
    h = x.reshape(-1, x.shape[-1])
    gate = block.gate
    sigmoid = hasattr(gate, "routing")
    if norm.weight.dtype != x.dtype or not (sigmoid_native(gate, h) if sigmoid else native_float_linear(gate, h)):
        return None
    views = block.experts.fused_views(h)
    if views is None:
        return None
    shared = shared_gate = None
    se = getattr(block, "shared_expert", None)
    if se is not None:
        shared = se._packed_views(h)
        if shared is None or not native_float_linear(block.shared_expert_gate, h):
            return None
        shared_gate = kernels.float32_weight(block.shared_expert_gate).view(-1)
    elif getattr(block, "shared_experts", None) is not None:
        shared = block.shared_experts._packed_views(h)
        if shared is None:
            return None
    route = gate.routing() if sigmoid else None
    k, renorm = (gate.top_k, gate.norm_topk_prob) if sigmoid else (block.top_k, block.norm_topk_prob)
    return block.experts, kernels.moe_block_args(*kernels.norm_args(norm), kernels.float32_weight(gate), k, renorm,
                                                 views, shared, shared_gate, route=route)


def native_float_linear(lin: nn.Linear, x: torch.Tensor) -> bool:
    """Whether a native op taking float32 weights may read this linear's (`kernels.float32_weight`)
    in place of calling it on x: a `plain_float_linear`, a float32 or bf16 input of its
    dtype, no autograd."""
    return (x.dtype == lin.weight.dtype and x.dtype in kernels.FLOAT_DTYPES and plain_float_linear(lin)
            and not torch.is_grad_enabled())


class GatedMLP(nn.Module):
    """Dense SwiGLU MLP (dense layers and shared experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        views = self._packed_views(x)
        if views is not None:  # packed quantized linears (or decode-sized float ones): one native call
            y = kernels.swiglu_mlp(x.reshape(-1, x.shape[-1]), *views, dtype=x.dtype)
            return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)
        g, u = project(x, self.gate_proj, self.up_proj)
        return self.down_proj(F.silu(g) * u)

    def gated(self, x: torch.Tensor, gate: nn.Linear) -> torch.Tensor:
        """sigmoid(gate(x)) * self(x), x [N, H]: a shared expert with its scalar gate
        (Qwen2-MoE, Qwen3.5), one native call when the MLP runs natively (`packed_views`)
        and the gate is a plain float linear."""
        views = self._packed_views(x)
        if views is not None and native_float_linear(gate, x):
            return kernels.swiglu_mlp(x, *views, gate_vec=kernels.float32_weight(gate), dtype=x.dtype).to(x.dtype)
        return torch.sigmoid(gate(x)) * self(x)

    def _packed_views(self, x: torch.Tensor) -> tuple | None:
        return packed_views(self.gate_proj, self.up_proj, self.down_proj, x=x)
