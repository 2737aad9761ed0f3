"""The `lookahead_mtp` prefetcher (issue 37): after each sampled token the MTP head drafts the
token after it, and the next token's layer 0 is hinted from that draft's embedding through
layer 0's router instead of from this token's choice. On a tiny qwen3_5_moe with an MTP head:
outputs unchanged, the hints are the draft's router top-k, and the layer-0 precision/recall
and draft accuracy it reports are what an independent observer of the routing counts."""

from __future__ import annotations

import pytest
import torch

import moerun
from moerun.errors import MoerunError

K = 2  # experts per token


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    from test_speculative import build_qwen

    path = build_qwen(tmp_path_factory.mktemp("qwen_mtp_draft"), vocab_size=120, num_experts=16,
                      num_experts_per_tok=K)
    plain = moerun.load(path, dtype="float32", threads=1)
    prompt = torch.randint(0, 120, (7,), generator=torch.Generator().manual_seed(3)).tolist()
    greedy = plain.generate_ids([prompt], max_tokens=10, temperature=0.0)[0]
    return path, prompt, greedy


def load_with_driver(path, budget="40%"):
    from moerun.experts import StoreOptions, load
    from moerun.experts.predict import attach_predictor

    llm = load(path, dtype="float32", threads=1, options=StoreOptions(ram_budget=budget))
    llm.predictor = attach_predictor(llm.net, llm.store, "lookahead_mtp", factor=1.0)
    return llm, llm.predictor


class Hints:
    """Records the store's prefetch calls (layer, ids, replace) in order."""

    def __init__(self, store):
        self.calls, inner = [], store.prefetch

        def prefetch(layer, ids, *a, **k):
            self.calls.append((layer, [int(e) for e in ids], k.get("replace", False), k.get("for_step")))
            return inner(layer, ids, *a, **k)
        store.prefetch = prefetch


def layer0_routes(llm) -> list:
    """Each decode pass's layer-0 experts, seen by a route observer of its own."""
    from moerun.experts.profile import moe_blocks
    from moerun.layers.routes import observe_routes

    seen = []
    _, blk = moe_blocks(llm.net)[0]
    observe_routes(blk.experts, lambda h, ids, w: seen.append(ids[-1].tolist()) if ids.shape[0] == 1 else None)
    return seen


@pytest.mark.parametrize("budget", ["100%", "40%"])
def test_outputs_unchanged_and_drafts_made(mtp_model, budget):
    path, prompt, greedy = mtp_model
    llm, drv = load_with_driver(path, budget)
    try:
        llm.store.evict_all()
        assert drv.uses_draft and drv.name == "lookahead_mtp"
        assert llm._mtp_prefetch() == drv.mtp_draft  # the engine calls the draft after each sampled token
        assert llm.generate_ids([prompt], max_tokens=10, temperature=0.0)[0] == greedy
        st, c = llm.store.stats(), drv.layer0_stats()
        assert c["drafts"] >= 9 and c["drafts_scored"] >= 8
        assert c["draft_hinted"] > 0 and c["passes"] >= 8
        assert st["tiers"]["host"]["peak_bytes"] <= st["tiers"]["host"]["budget_bytes"]
        assert st["requests"] == st["tiers"]["host"]["hits"] + st["demand_misses"] + st["prefetch_late"]
    finally:
        llm.store.close()


def test_layer0_hints_follow_the_draft_and_are_scored(mtp_model, monkeypatch):
    """With the head's logits replaced by an oracle (a one-hot on the true token after next),
    every draft is right, each next-token layer-0 hint is the top-k of that token's layer-0
    router scores, and the reported precision/recall are the overlap an independent observer
    of layer 0's routing counts; this token's choice is scored beside it."""
    path, prompt, greedy = mtp_model
    llm, drv = load_with_driver(path, "100%")
    try:
        calls = []
        real = llm.net.mtp_logits

        def oracle(hidden, tok, cache=None, slots=None, **k):
            real(hidden, tok, cache, slots, **k)  # the head still runs (its cache, its experts)
            j = len(calls)
            assert int(tok.reshape(-1)[0]) == greedy[j]  # call j follows the j-th sampled token
            calls.append(j)
            out = torch.zeros(1, 1, 120)
            out[0, 0, greedy[j + 1] if j + 1 < len(greedy) else 0] = 1.0
            return out
        monkeypatch.setattr(llm.net, "mtp_logits", oracle)
        hints = Hints(llm.store)
        routes = layer0_routes(llm)
        assert llm.generate_ids([prompt], max_tokens=10, temperature=0.0)[0] == greedy
        c = drv.layer0_stats()
        assert c["drafts_scored"] >= 8 and c["draft_accuracy"] == 1.0

        assert c["drafts"] == 10 and c["drafts_scored"] == 9  # after the prompt's pass and each decode pass
        # pass 1 is the prompt, pass p >= 2 decodes greedy[p - 2]; the layer-0 hints for the next
        # token are made at each pass's last layer (replacing): pass 1's from its choice, pass
        # p >= 2's from the draft made after pass p - 1, i.e. token greedy[p - 1]
        first = drv.layer_ids[0]
        l0 = [ids for layer, ids, replace, _ in hints.calls if layer == first and replace]
        assert len(l0) == 10
        for p in range(2, 11):
            want = torch.from_numpy(drv.router0_scores(greedy[p - 1])).topk(K).indices.tolist()
            assert set(l0[p - 1]) == set(want), p
        # scored: passes 3..10, each against what its layer 0 then chose (routes[p - 2])
        assert len(routes) == 9 and c["passes"] == 8
        draft_hits = sum(len(set(l0[p - 2]) & set(routes[p - 2])) for p in range(3, 11))
        last_hits = sum(len(set(routes[p - 3]) & set(routes[p - 2])) for p in range(3, 11))
        assert c["draft_hits"] == draft_hits and c["last_hits"] == last_hits
        assert c["draft_hinted"] == c["draft_actual"] == c["last_hinted"] == c["last_actual"] == 8 * K
        assert c["draft_precision"] == c["draft_recall"] == draft_hits / (8 * K)
        assert c["last_precision"] == last_hits / (8 * K)
        assert c["token_hits"] == draft_hits and c["token_hinted"] == 8 * K  # every draft right: the ceiling met
    finally:
        llm.store.close()


def test_draft_scores_are_layer0s_router_on_the_normed_embedding(mtp_model):
    from moerun.experts.profile import moe_blocks

    path, _, _ = mtp_model
    llm, drv = load_with_driver(path, "100%")
    try:
        net = llm.net
        name, blk = moe_blocks(net)[0]
        layer = net.get_submodule(name.rsplit(".mlp", 1)[0])
        with torch.inference_mode():
            for t in (0, 5, 119):
                u = layer.post_attention_layernorm(net.model.embed_tokens(torch.tensor([[t]])))
                want = blk.gate(u).reshape(-1).float()
                assert torch.allclose(torch.from_numpy(drv.router0_scores(t)), want, rtol=1e-5, atol=1e-6)
            # different tokens route differently (the scores carry the token)
            assert not torch.equal(torch.from_numpy(drv.router0_scores(0)), torch.from_numpy(drv.router0_scores(5)))
    finally:
        llm.store.close()


def test_lookahead_mtp_needs_an_mtp_head(tmp_path):
    from test_speculative import build_qwen

    from moerun.experts import StoreOptions, load
    from moerun.experts.predict import attach_predictor, check_name, make_predictors
    from moerun.experts.profile import Trace

    check_name("lookahead_mtp")
    with pytest.raises(MoerunError, match="unknown predictor"):
        check_name("lookahead_mtpx")
    import numpy as np
    tr = Trace.from_ids(np.zeros((4, 2, 1), dtype=np.int64), 4)
    assert make_predictors(tr, ("lookahead_mtp",)) == {}  # live prefetch only: nothing to replay
    path = build_qwen(tmp_path / "m", mtp=False, vocab_size=50)
    llm = load(path, dtype="float32", threads=1, options=StoreOptions(ram_budget="50%"))
    try:
        with pytest.raises(MoerunError, match="this model has none"):
            attach_predictor(llm.net, llm.store, "lookahead_mtp")
    finally:
        llm.store.close()
