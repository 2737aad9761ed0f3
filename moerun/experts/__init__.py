"""Where routed experts live (device / RAM / disk), which stay, and what moves ahead of use.

Entry points: `load(path, options=StoreOptions(...))` (an `LLM` whose `.store` is an
`ExpertStore`), `attach_store(net, path, options)`, `StoreOptions`, `ExpertStore.stats()`.
"""

from .attach import StoreExperts, attach_store, build, load
from .store import ExpertStore, StoreOptions, format_stats, load_profile, parse_budget, save_profile

__all__ = ["ExpertStore", "StoreExperts", "StoreOptions", "attach_store", "build", "format_stats", "load", "load_profile",
           "parse_budget", "save_profile"]
