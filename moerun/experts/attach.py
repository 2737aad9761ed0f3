"""Putting a store behind a model: `StoreExperts` replaces each `Experts` module.

Two ways in:
- `load(path, options=StoreOptions(...))`: builds the net without ever materialising the
  routed experts (only their byte ranges are kept), so the RAM budget holds from the
  start; this is what the CLI uses.
- `attach_store(net, path, options)`: for a net already loaded the ordinary way; its
  stacked expert tensors are freed once the store is in place (peak RAM at load was the
  full model, but it is not kept).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch
from torch import nn

from ..errors import MoerunError
from ..layers.moe import Experts, dispatch, group_by_expert, swiglu
from .store import ExpertStore, LayerExperts, StoreOptions, expert_pieces

# N tokens, H hidden, I expert width, E experts, K experts per token


class StoreExperts(nn.Module):
    """Same call as `Experts`: x [N, H], ids [N, K], weights [N, K] -> [N, H]; weights come
    from the store. The arithmetic is `expert_mlp`'s, op for op, so outputs are
    bit-identical to the plain model whatever the tiers hold."""

    def __init__(self, layer: int, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.layer, self.num_experts, self.hidden, self.inter = layer, num_experts, hidden, inter
        self.store: ExpertStore | None = None

    def extra_repr(self) -> str:
        return f"layer={self.layer}, experts={self.num_experts}, hidden={self.hidden}, inter={self.inter}"

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        N, K = ids.shape
        order, counts = group_by_expert(ids, self.num_experts)
        needed = [e for e, c in enumerate(counts) if c]
        where: dict[int, str] = {}
        got = self.store.get(self.layer, needed, n_tokens=N, counts=counts, where=where)
        ran = []

        def run_expert(e, xs):
            gate, up, down = got[e]
            t0 = time.perf_counter()
            if gate.device != xs.device:  # experts on a real GPU (UNTESTED path)
                y = swiglu(xs.to(gate.device, non_blocking=True), gate, up, down).to(xs.device)
            else:
                y = swiglu(xs, gate, up, down)
            ran.append((e, where[e], xs.shape[0], time.perf_counter() - t0))
            return y

        try:
            return dispatch(x, ids, weights, order, counts, run_expert)
        finally:
            self.store.release(self.layer, needed, ran)


def _layer_index(name: str, fallback: int) -> int:
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return int(m.group(1)) if m else fallback


def _swap_experts(net: nn.Module) -> list[tuple[str, StoreExperts]]:
    """Replace every `Experts` in `net` with a `StoreExperts`; returns (name, new module)."""
    found = [(n, m) for n, m in net.named_modules() if isinstance(m, Experts)]
    # trunk layers keep their index; others (an MTP head's `mtp.layers.0`) get fresh ones after
    trunk = [n for n, _ in found if not (n.startswith("mtp") or ".mtp." in n)]
    ids: dict[str, int | None] = {}
    for n in trunk:
        i = _layer_index(n, len(ids))
        ids[n] = i if i not in ids.values() else None
    nxt = max((i for i in ids.values() if i is not None), default=-1) + 1
    for n, _ in found:
        if ids.get(n) is None:
            ids[n] = nxt
            nxt += 1
    out = []
    for name, mod in found:
        E, I, H = mod.gate_proj.shape
        new = StoreExperts(ids[name], E, H, I)
        parent_name, _, attr = name.rpartition(".")
        setattr(net.get_submodule(parent_name) if parent_name else net, attr, new)
        out.append((name, new))
    if not out:
        raise MoerunError("this model has no routed experts for an expert store to hold")
    return out


def _make_store(net, swapped, model_dir: Path, dtype, options: StoreOptions | None) -> ExpertStore:
    from ..loaders.hf import _renamed
    from ..loaders.safetensors import Checkpoint

    ckpt = Checkpoint(model_dir)
    names = _renamed(ckpt, getattr(net, "checkpoint_renames", ()))
    layers = [
        LayerExperts(m.layer, m.num_experts, m.hidden, m.inter, expert_pieces(names, name, m.num_experts, m.hidden, m.inter))
        for name, m in swapped
    ]
    top_k = getattr(getattr(net, "args", None), "num_experts_per_tok", 8)
    store = ExpertStore(layers, dtype, options, top_k=top_k)
    for _, m in swapped:
        m.store = store
    net.expert_store = store
    return store


def attach_store(net: nn.Module, model_dir, options: StoreOptions | None = None) -> ExpertStore:
    """Put an `ExpertStore` behind an already loaded net (its expert tensors are dropped)."""
    dtype = next(m for m in net.modules() if isinstance(m, Experts)).gate_proj.dtype
    swapped = _swap_experts(net)
    return _make_store(net, swapped, Path(model_dir), dtype, options)


def build(model_dir, dtype="auto", options: StoreOptions | None = None):
    """Like `moerun.loaders.hf.build`, with routed experts in a store and never materialised.
    Returns (architecture module, args, net, dtype, store)."""
    from ..loaders.hf import build as build_net

    swapped = []
    # swap before loading: the expert parameters are then gone from what the loader reads
    arch, args, net, dtype = build_net(model_dir, dtype, prepare=lambda n: swapped.extend(_swap_experts(n)))
    store = _make_store(net, swapped, Path(model_dir), dtype, options)
    return arch, args, net, dtype, store


def load(path=None, dtype="auto", threads: int | None = None, options: StoreOptions | None = None):
    """`moerun.load` with an expert store: returns an `LLM` whose `.store` is the ExpertStore."""
    from ..engine.llm import LLM, default_model_path, set_threads
    from ..tokenizer import Tokenizer

    path = default_model_path() if path is None else Path(path)
    set_threads(threads)
    arch, args, net, dtype, store = build(path, dtype, options)
    tokenizer = Tokenizer(path) if (path / "tokenizer.json").is_file() else None
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    llm = LLM(net, args, arch, tokenizer, path, dtype, gen)
    llm.store = store
    return llm
