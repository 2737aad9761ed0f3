"""Quantization: block formats (`formats`), drop-in modules (`modules`) and the
per-component policy applied to a loaded model by `quantize_model`.

Default policy (`DEFAULT_POLICY`, "int4-q6k"): routed experts and attention / DeltaNet
projections int4, shared experts and dense MLPs int8, the LM head llama.cpp's Q6_K (`q6_k`);
routers (`gate`, `shared_expert_gate`), norms and embeddings stay in the model's float dtype
(they are tiny, and the router decides which experts run at all). It reads fewer bytes per
decoded token than llama.cpp's Q4_K_M of the same model (519 against 533 MB on 8 of
Qwen3-30B-A3B's layers) and keeps the demo model's held-out perplexity within 1% of bf16
with >= 95% of greedy tokens bf16's: the candidates' table, and how it was chosen, is in
docs/benchmarks.md (benchmarks/quant_policies.py). "int4" (the default
before: attention and head int8, 669 MB a token there) stays for the checkpoints written
with it.

A component may also take one of llama.cpp's raw formats (`q4_k`, `q5_k`, `q6_k`, `q5_0`;
docs/design/gguf.md), quantized by its reference quantizers (`kernels.ggml_quant.quantize`). Where
a weight's rows are not a whole number of the format's blocks (the K-quants' 256: the demo
model's hidden size is 128) the module falls back as llama.cpp does: q4_k -> q5_0, q5_k and
q6_k -> int8 (moerun's int8 is Q8_0), per matrix (`formats.fit`), so a policy names what a
component gets where the shapes allow it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from ..kernels.formats import FORMATS
from ..layers.moe import Experts
from ..layers.quantized import QuantizedExperts, QuantizedLinear

# module names never quantized: routers, and projections whose weight a model reads directly
KEEP_FLOAT = ("gate", "shared_expert_gate", "router", "kv_b_proj")


@dataclass(frozen=True)
class QuantPolicy:
    """Format per component; None keeps the component in float."""

    experts: str | None = "int4"         # routed experts (Experts modules)
    shared_experts: str | None = "int8"  # shared experts and dense MLP layers
    attention: str | None = "int8"       # attention / linear-attention projections
    lm_head: str | None = "int8"

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None and v not in FORMATS:
                raise ValueError(f"{f.name}: unknown format {v!r}; formats: {', '.join(FORMATS)} or None")


POLICIES = {
    "int4": QuantPolicy(),  # routed experts int4, everything else int8 (the default until 2026-12-03)
    "int8": QuantPolicy(experts="int8"),
    "int4-all": QuantPolicy(experts="int4", shared_experts="int4", attention="int4", lm_head="int4"),
    # candidates against llama.cpp's Q4_K_M bytes (docs/benchmarks.md);
    # int4-q6k is the default (DEFAULT_POLICY)
    "int4-q6k": QuantPolicy(experts="int4", shared_experts="int8", attention="int4", lm_head="q6_k"),
    "int4-kq": QuantPolicy(experts="int4", shared_experts="q4_k", attention="q4_k", lm_head="q6_k"),
    "kq": QuantPolicy(experts="q4_k", shared_experts="q4_k", attention="q4_k", lm_head="q6_k"),
    "none": None,
}
DEFAULT_POLICY = "int4-q6k"  # what `moerun quantize` and `quantize_model` apply unless told otherwise


def resolve_policy(policy) -> QuantPolicy | None:
    if policy is None or isinstance(policy, QuantPolicy):
        return policy
    if isinstance(policy, str) and policy in POLICIES:
        return POLICIES[policy]
    raise ValueError(f"unknown quantization policy {policy!r}; choose one of {', '.join(POLICIES)}")


def component_of(name: str, module: nn.Module) -> str | None:
    """Which policy component a module (float or already quantized) belongs to (None: leave it alone)."""

    if isinstance(module, (Experts, QuantizedExperts)):
        return "experts"
    if not isinstance(module, (nn.Linear, QuantizedLinear)):
        return None
    leaf = name.rpartition(".")[2]
    if leaf in KEEP_FLOAT:
        return None
    if leaf == "lm_head":
        return "lm_head"
    parts = name.split(".")
    if any("attn" in p for p in parts):
        return "attention"
    if "mlp" in parts or any(p.startswith("shared_expert") for p in parts):
        return "shared_experts"
    return None  # anything else (MTP projections, unknown heads) stays as loaded


def quantize_model(net: nn.Module, policy: str | QuantPolicy | None = DEFAULT_POLICY) -> dict[str, int]:
    """Swap `net`'s modules in place for quantized ones following `policy`.

    policy: a POLICIES name (default DEFAULT_POLICY), "none"/None, or a QuantPolicy. Returns how many modules were quantized per component.
    """

    policy = resolve_policy(policy)
    counts: dict[str, int] = {}
    if policy is None:
        return counts
    plan = []
    for name, mod in net.named_modules():
        comp = component_of(name, mod)
        already = isinstance(mod, (QuantizedExperts, QuantizedLinear))  # left as they are
        if comp is not None and getattr(policy, comp) is not None and not already:
            plan.append((name, mod, comp))
    for name, mod, comp in plan:
        fmt = getattr(policy, comp)
        new = (QuantizedExperts.from_experts(mod, fmt) if comp == "experts"
               else QuantizedLinear.from_linear(mod, fmt))
        replace_module(net, name, new)
        counts[comp] = counts.get(comp, 0) + 1
    return counts


def replace_module(net: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(net.get_submodule(parent_name) if parent_name else net, child, new)


def formats_in_use(net: nn.Module) -> dict[str, str]:
    """{component: format} of `net`'s quantized modules ("int4+int8" if a component mixes
    them, "q4_k/q6_k" for experts whose down projection has another); empty when nothing is
    quantized."""

    found: dict[str, set[str]] = {}
    for name, mod in net.named_modules():
        if isinstance(mod, (QuantizedExperts, QuantizedLinear)):
            found.setdefault(component_of(name, mod) or "other", set()).add(mod.formats)
    return {comp: "+".join(sorted(f)) for comp, f in found.items()}


def policy_name(policy: QuantPolicy | None) -> str:
    """A policy as its POLICIES name, or as its components (`experts=int4 attention=none ...`)."""
    named = next((k for k, v in POLICIES.items() if v == policy), None)
    if named is not None:
        return named
    return " ".join(f"{f.name}={getattr(policy, f.name) or 'none'}" for f in fields(policy))




def compute_in_float32(net: nn.Module) -> bool:
    """Make a quantized net run its activations in float32: the float weights left beside
    the quantized ones (norms, routers, gates, convolutions, MTP projections) become float32,
    and the token embeddings keep their dtype (they are big and read a row at a time) but
    hand float32 rows on. The native kernels take and return float32, so a bf16 net pays a
    cast at every call, and torch's bf16 ops on a CPU without bf16 arithmetic are slower
    than its float32 ones. Returns False (and changes nothing) when the net has no
    quantized module."""

    quantized = (QuantizedExperts, QuantizedLinear)
    if not any(isinstance(m, quantized) for m in net.modules()):
        return False
    floats = [m for m in net.modules() if not isinstance(m, quantized)]
    embeddings = [m for m in floats if isinstance(m, nn.Embedding)]
    kept = {m.weight.data_ptr() for m in embeddings}
    if any(isinstance(m, nn.Linear) and m.weight.data_ptr() in kept for m in floats):
        kept = set()  # a float linear reads an embedding table (a tied LM head): both float32
    # by storage, so that tied weights stay tied; the old tensors are held until the end, so
    # that no new one can take an address seen here
    cast: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for m in floats:
        for p in m.parameters(recurse=False):
            if p.is_floating_point() and p.data_ptr() not in kept:
                p.data = cast.setdefault(p.data_ptr(), (p.data, p.data.float()))[1]
        for name, b in list(m.named_buffers(recurse=False)):
            if b is not None and b.is_floating_point():
                setattr(m, name, b.float())
    for m in embeddings:
        if m.weight.dtype != torch.float32:
            m.__class__ = Float32RowsEmbedding  # same state, a forward that widens the rows
    return True


class Float32RowsEmbedding(nn.Embedding):
    """An embedding table kept in its dtype whose looked-up rows come out float32."""

    def forward(self, input):
        return super().forward(input).float()


__all__ = ["QuantPolicy", "POLICIES", "DEFAULT_POLICY", "quantize_model", "resolve_policy", "component_of", "formats_in_use",
           "policy_name", "replace_module", "compute_in_float32", "Float32RowsEmbedding"]
