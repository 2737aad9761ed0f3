"""Expert predictors on hand-made traces whose right answer is known."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moerun.errors import MoerunError
from moerun.experts.predict import (LayerAhead, Temporal, attach_predictor, evaluate, fit_probes, make_predictors,
                                    predict_eval, replay, score)
from moerun.experts.profile import Trace

L, E, K = 3, 8, 2


def repeating(n=20):
    """Every token uses experts {l, l+1} at layer l."""
    ids = np.array([[[l, l + 1] for l in range(L)]] * n)
    return Trace.from_ids(ids, E, seq=np.repeat([0, 1], n // 2))


def random_ids(rng, n):
    return np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(n)])


def one_hot_scores(ids):
    """[N, L, E] scores that are 1 on the used experts."""
    s = np.zeros((*ids.shape[:2], E), dtype=np.float16)
    np.put_along_axis(s, ids.astype(np.int64), 1.0, axis=-1)
    return s


def test_temporal_and_frequency_on_a_repeating_trace():
    res = evaluate(repeating(), ("temporal", "frequency"))
    for name in ("temporal", "frequency"):
        assert res[name]["1.0"]["recall"] == 1.0 and res[name]["1.0"]["precision"] == 1.0
        assert res[name]["2.0"]["recall"] == 1.0 and res[name]["2.0"]["precision"] == 0.5
        assert res[name]["1.5"]["budget"] == 3
    assert res["temporal"]["1.0"]["lead_layers"] == L  # known one token (L layers) ahead
    assert res["frequency"]["1.0"]["lead_layers"] is None  # static


def test_temporal_ranks_by_recency():
    p = Temporal(1, E)
    for ids in ([0, 1], [2, 3], [4, 5]):
        p.begin_token()
        p.observe(0, ids)
    assert set(p.predict(0, 2)) == {4, 5}
    assert set(p.predict(0, 4)) == {2, 3, 4, 5}


def test_layer_ahead_reads_the_next_layers_router():
    rng = np.random.default_rng(0)
    ids = random_ids(rng, 40)
    ids[:, 0] = [0, 1]  # layer 0 has no layer before it: the temporal fallback is exact there
    truth = one_hot_scores(ids)
    ahead = np.zeros((2, 40, L, E), dtype=np.float16)
    ahead[0, :, :-1] = truth[:, 1:]  # the router of layer l+1 applied at layer l
    ahead[1, :, :-2] = truth[:, 2:]
    tr = Trace.from_ids(ids, E, seq=np.repeat([0, 1], 20), ahead=ahead)
    res = evaluate(tr, ("layer_ahead1", "layer_ahead2", "temporal"))
    assert res["layer_ahead1"]["1.0"]["recall"] == 1.0
    assert res["layer_ahead1"]["1.0"]["lead_layers"] == pytest.approx((L + 1 + 1) / L)  # layer 0: a token; then 1
    assert res["temporal"]["1.0"]["recall"] < 0.7
    # d = 2 sees layer 2 from layer 0 only; layer 1 falls back to temporal (random here)
    assert 0.6 < res["layer_ahead2"]["1.0"]["recall"] < 1.0
    p = LayerAhead(L, E, d=1)
    assert [p.lead(l) for l in range(L)] == [(1, 0), (0, 1), (0, 1)]


def test_mtp_and_learned_probes():
    rng = np.random.default_rng(1)
    n = 200
    pattern = rng.integers(0, 2, n)  # which of two routings the next token takes
    table = np.array([[[0, 1], [2, 3], [4, 5]], [[6, 7], [0, 2], [1, 3]]])
    ids = table[pattern]
    hidden = np.zeros((n, 4), dtype=np.float16)
    hidden[np.arange(n), pattern] = 1.0  # the MTP hidden state encodes the pattern
    hidden[:, 2:] = rng.normal(size=(n, 2))  # and some noise
    valid = np.ones(n, dtype=bool)
    tr = Trace.from_ids(ids, E, seq=np.repeat([0, 1], n // 2), mtp_route=one_hot_scores(ids), mtp_hidden=hidden,
                        mtp_valid=valid)
    res = evaluate(tr, ("mtp", "mtp_learned", "temporal"))
    assert res["mtp"]["1.0"]["recall"] == 1.0
    assert res["mtp_learned"]["1.0"]["recall"] == 1.0
    assert res["temporal"]["1.0"]["recall"] < 0.8
    assert res["mtp"]["1.0"]["lead_layers"] == pytest.approx(L + (L + 1) / 2)  # a token, plus l + 1
    W = fit_probes(tr)
    assert W.shape == (L, 5, E)


def test_token_predictors():
    """`token` reads the current token's routing signal, known at the start of its pass."""
    rng = np.random.default_rng(3)
    ids = random_ids(rng, 40)
    truth = one_hot_scores(ids)
    ahead = np.zeros((1, 40, L, E), dtype=np.float16)
    ahead[0, :, :-1] = truth[:, 1:]
    tr = Trace.from_ids(ids, E, seq=np.repeat([0, 1], 20), token_route=truth, ahead=ahead)
    res = evaluate(tr, ("token", "token_ahead", "mtp_oracle"))
    for name in ("token", "token_ahead", "mtp_oracle"):
        assert res[name]["1.0"]["recall"] == 1.0
    assert res["token"]["1.0"]["lead_layers"] == pytest.approx((1 + 2 + 3) / L)
    assert res["token_ahead"]["1.0"]["lead_layers"] == pytest.approx((1 + 1 + 1) / L)
    assert res["mtp_oracle"]["1.0"]["lead_layers"] == pytest.approx(L + (1 + 2 + 3) / L)


def test_predictions_are_prefixes_and_scores_agree():
    rng = np.random.default_rng(2)
    tr = Trace.from_ids(random_ids(rng, 30), E)
    p = make_predictors(tr, ("frequency",))["frequency"]
    out, _ = replay(tr, p, 4)
    small, _ = replay(tr, p, 2)
    np.testing.assert_array_equal(out[..., :2], small)
    s = score(tr, out, 4)
    assert s["precision"] == pytest.approx(s["recall"] * K / 4)


def test_predict_eval_json(tmp_path, capsys):
    repeating().save(tmp_path / "t.npz")
    res = predict_eval(str(tmp_path / "t.npz"), as_json=True)
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(res))
    assert set(printed) == {"frequency", "temporal"}  # no ahead / MTP signals in this trace
    assert set(printed["temporal"]) == {"1.0", "1.5", "2.0"}
    assert {"recall", "precision", "lead_layers", "cost_us"} <= set(printed["temporal"]["1.0"])
    with pytest.raises(MoerunError, match="unknown predictor"):
        predict_eval(str(tmp_path / "t.npz"), predictors="nope")


def test_driver_hints_the_store():
    """The prefetch driver feeds layer_ahead from live router inputs and hints the store."""
    import torch

    from test_profile import tiny_qwen3_5

    from moerun.experts.profile import moe_blocks

    class FakeStore:
        step = 0

        def __init__(self):
            self.hints = []

        def prefetch(self, layer, ids, priority=0.0, for_step=None):
            self.hints.append((layer, tuple(ids)))

    torch.set_num_threads(1)
    llm = tiny_qwen3_5(mtp=False)
    store = FakeStore()
    drv = attach_predictor(llm.net, store, "layer_ahead1", factor=1.0)
    routed = []
    with torch.inference_mode():
        h = [b.experts.register_forward_pre_hook(lambda m, a: routed.append(tuple(a[1][0].tolist())))
             for _, b in moe_blocks(llm.net)]
        llm.net(torch.tensor([[3]]))
    for x in h:
        x.remove()
    drv.close()
    ahead_hints = [hint for hint in store.hints if hint[0] in (1, 2, 3)]
    assert [l for l, _ in ahead_hints][:3] == [1, 2, 3] and all(len(ids) == 2 for _, ids in ahead_hints)
    assert routed and not any(b.experts._forward_pre_hooks for _, b in moe_blocks(llm.net))


def test_driver_with_the_expert_store(tmp_path):
    """layer_ahead1 drives a real store (emulated device): prefetches are used, tokens unchanged."""
    import torch

    from moerun.bench.random_model import write_random_model
    from moerun.experts import StoreOptions
    from moerun.experts import load as store_load

    cfg = dict(model_type="qwen3_5_moe_text", vocab_size=64, hidden_size=32, num_hidden_layers=4,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_key_head_dim=8,
               linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2, moe_intermediate_size=16,
               shared_expert_intermediate_size=16, num_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
               layer_types=["linear_attention", "full_attention"] * 2, torch_dtype="float32")
    write_random_model(tmp_path, cfg, dtype=torch.float32)
    outs, stats = [], []
    for name in (None, "layer_ahead1", "token_ahead"):
        llm = store_load(tmp_path, threads=1, options=StoreOptions(vram_budget="50%", emulate_link="pcie4"))
        drv = attach_predictor(llm.net, llm.store, name) if name else None
        try:
            outs.append(llm.generate_ids([[1, 2, 3]], max_tokens=12, temperature=0.0)[0])
            stats.append(llm.store.stats())
        finally:
            if drv:
                drv.close()
            llm.store.close()
    assert outs[0] == outs[1] == outs[2]
    assert stats[0]["prefetch_issued"] == 0
    for st in stats[1:]:
        assert st["prefetch_issued"] > 0 and st["prefetch_used"] > 0


def test_driver_mtp_step_hints_the_token_after_next():
    """mtp_step runs the MTP head and hints every layer of the token after next (two steps on)."""
    import torch

    from test_profile import tiny_qwen3_5

    class FakeStore:
        step = 5

        def __init__(self):
            self.hints = []

        def prefetch(self, layer, ids, priority=0.0, for_step=None):
            self.hints.append((layer, for_step, tuple(ids)))

    torch.set_num_threads(1)
    llm = tiny_qwen3_5(mtp=True)
    from moerun.experts.predict import MTP, PrefetchDriver

    store = FakeStore()
    drv = PrefetchDriver(llm.net, store, MTP(4, 8), factor=1.0)
    with torch.inference_mode():
        _, hidden = llm.net(torch.tensor([[3, 4]]), return_hidden=True)
    drv.mtp_step(hidden, torch.tensor([[7]]), candidates=4)
    assert [(l, s) for l, s, _ in store.hints] == [(l, 7) for l in range(4)]
    assert all(len(ids) == 2 for _, _, ids in store.hints)
    assert drv.mtp_info and list(drv.mtp_info) == [drv.passes + 2]
    drv.close()
