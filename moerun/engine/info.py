"""What a model is and what one decoded token costs: parameters and bytes by component."""

from __future__ import annotations

from collections import defaultdict

import torch

from ..layers.moe import Experts

# Order matters: the first matching key names the component.
COMPONENTS = [
    ("mtp", ("mtp.",)),
    ("embedding", ("embed_tokens",)),
    ("head", ("lm_head",)),
    ("shared expert", ("shared_expert",)),
    ("router", ("mlp.gate.", "block_sparse_moe.gate.", "mlp.gate.e_score")),
    ("deltanet", ("linear_attn",)),
    ("attention", ("self_attn",)),
    ("dense mlp", ("mlp.",)),
]


def component_of(name: str) -> str:
    for comp, keys in COMPONENTS:
        if any(k in name for k in keys):
            return comp
    return "norms"


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def describe(net: torch.nn.Module, args) -> dict:
    """Totals per component: parameters, bytes held, bytes read per decoded token.

    Counts every tensor of the state dict (parameters and the packed buffers of quantized
    modules), each shared tensor once.
    """
    k = getattr(args, "num_experts_per_tok", 0)
    # Experts modules and their replacements (quantized, store-backed) mark themselves
    routed = {
        name + ".": mod.num_experts
        for name, mod in net.named_modules()
        if isinstance(mod, Experts) or getattr(mod, "routed_experts", False)
    }
    params: dict[str, int] = defaultdict(int)
    held: dict[str, int] = defaultdict(int)
    per_token: dict[str, float] = defaultdict(float)
    hidden = getattr(args, "hidden_size", 0)
    seen = set()
    for name, t in net.state_dict().items():
        if t.data_ptr() in seen and t.numel():
            continue
        seen.add(t.data_ptr())
        comp = component_of(name)
        prefix = next((p for p in routed if name.startswith(p)), None)
        if prefix is not None and comp != "mtp":
            comp = "routed experts"
        params[comp] += t.numel() if t.dtype != torch.uint8 else 2 * t.numel()  # uint8 packs two int4
        held[comp] += tensor_bytes(t)
        if comp == "routed experts":
            per_token[comp] += tensor_bytes(t) * k / routed[prefix]
        elif comp == "embedding":
            per_token[comp] += hidden * t.element_size()  # one row per token
        elif comp != "mtp":
            per_token[comp] += tensor_bytes(t)
    total = sum(params.values())
    n_routed = params.get("routed experts", 0)
    n_experts = _num_experts(args)
    active = total - params.get("mtp", 0) - params.get("embedding", 0) - n_routed + (n_routed * k / n_experts if n_experts else 0)
    return {
        "parameters": total,
        "active_parameters": int(active),
        "params_by_component": dict(params),
        "bytes_by_component": dict(held),
        "bytes_per_token_by_component": {c: int(v) for c, v in per_token.items()},
        "bytes_per_token": int(sum(per_token.values())),
    }


def _num_experts(args) -> int:
    for field in ("num_experts", "n_routed_experts", "num_local_experts"):
        v = getattr(args, field, None)
        if v:
            return int(v)
    return 0


def layer_pattern(args) -> str | None:
    types = getattr(args, "layer_types", None)
    if not types or "linear_attention" not in types:  # only hybrid models have a pattern to show
        return None
    return "".join("F" if t == "full_attention" else "L" for t in types)


def human_count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return str(int(n))
