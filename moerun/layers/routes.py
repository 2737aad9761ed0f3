"""Who watches a MoE layer's routing: route observers and the route mask.

A *route observer* (a predictor driving the prefetcher, a profiler recording a trace) is
registered on a layer's experts module with `observe_routes(experts, fn)`: fn(h [N, H],
ids [N, K], weights [N, K]) is called once the router has picked and before the experts
run, on every path a pass can take: the modules (each Experts kind calls `routed`), one
native call per layer (`layers.moe.moe_residual`), or the whole layer stack as one native
call (`layers.stack`), where the native op calls back into Python between layers. Unlike a
forward pre-hook it keeps the pass on the native path.

The *route mask* (`routes_seen`) is cheaper still: a uint8 array an expert tracker reads
(which experts ran), marked natively by the fused ops, with no call at all.

Apart from `layers.moe` so that the quantized and store-backed experts can import it.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn


def routes_seen(experts: nn.Module):
    """The experts' route mask, when something watches which experts run (an expert tracker,
    `engine.speculative.ExpertTracker`, sets it as `experts.routes_seen`): uint8 [E + 1], 1 at
    each expert routed to since it was cleared and the calls' top-k at [E]. None otherwise.
    Every Experts kind marks it (`routed`), the fused ops natively."""
    return experts.__dict__.get("routes_seen")


_epoch = [0]  # counts observers added and removed anywhere: a stack built before may be stale


def observers_epoch() -> int:
    """Changes whenever a route observer is added or removed (`layers.stack` rebuilds then)."""
    return _epoch[0]


def route_observers(experts: nn.Module) -> list:
    """The experts' route observers (a list, empty when nobody watches)."""
    return experts.__dict__.get("route_observers") or []


class ObserverHandle:
    """What `observe_routes` returns: `remove()` stops the observer."""

    def __init__(self, experts: nn.Module, fn):
        self._experts, self._fn = weakref.ref(experts), fn

    def remove(self) -> None:
        experts = self._experts()
        if experts is not None:
            observers = experts.__dict__.get("route_observers") or []
            if self._fn in observers:
                observers.remove(self._fn)
                _epoch[0] += 1


def observe_routes(experts: nn.Module, fn) -> ObserverHandle:
    """Call fn(h, ids, weights) at each pass through `experts` once its routing is known (h
    [N, H] the experts' input in the model's dtype, ids [N, K] int64, weights [N, K]); fn
    must not change them. Passes already planned for a run see the new observer from their
    next pass on."""
    experts.__dict__.setdefault("route_observers", []).append(fn)
    _epoch[0] += 1
    return ObserverHandle(experts, fn)


def routed(experts: nn.Module, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
    """An Experts kind's forward, before its experts run: mark the route mask, if any
    (`routes_seen`), and call the route observers, if any."""
    seen = experts.__dict__.get("routes_seen")
    if seen is not None:
        seen[ids.reshape(-1).numpy()] = 1
        seen[-1] = ids.shape[-1]
    for fn in route_observers(experts):
        fn(h, ids, weights)


def native_observer(experts: nn.Module, dtype: torch.dtype):
    """The callable a native MoE half calls with its routing (numpy h [N, H] float32, ids
    [N, K], weights [N, K] float32) when the experts have observers, else None: it hands them
    on as `routed` would, in `dtype`. It holds the experts weakly (the native half that holds
    it is kept by the module's plans: a strong reference back would be a cycle through C++)."""
    if not route_observers(experts):
        return None
    made = experts.__dict__.get("_native_observer")
    if made is not None and made[0] == dtype:
        return made[1]
    ref = weakref.ref(experts)

    def observer(h, ids, weights):
        e = ref()
        if e is not None:
            h, ids, weights = torch.from_numpy(h).to(dtype), torch.from_numpy(ids), torch.from_numpy(weights).to(dtype)
            for fn in route_observers(e):
                fn(h, ids, weights)

    experts.__dict__["_native_observer"] = (dtype, observer)
    return observer
