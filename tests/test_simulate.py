"""The hybrid simulator: ordering of policies, monotonicity in link bandwidth, a hand-computed case."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moerun.bench.simulate import GEOMETRIES, cache_share, geometry, hardware, run_policy, simulate
from moerun.errors import MoerunError
from moerun.experts.profile import Trace

L, E, K = 4, 16, 2


def skewed_trace(n=120, seed=0):
    """Zipf-like expert use with reuse between neighbouring tokens, and useful ahead / MTP signals."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, E + 1)
    p /= p.sum()
    ids = np.zeros((n, L, K), dtype=np.int16)
    for t in range(n):
        for l in range(L):
            if t and rng.random() < 0.5:
                ids[t, l] = ids[t - 1, l]
            else:
                ids[t, l] = rng.choice(E, K, replace=False, p=p)
    truth = np.zeros((n, L, E), dtype=np.float16)
    np.put_along_axis(truth, ids.astype(np.int64), 1.0, axis=-1)
    noisy = (truth + rng.random((n, L, E)) * 0.8).astype(np.float16)
    ahead = np.zeros((2, n, L, E), dtype=np.float16)
    ahead[0, :, :-1] = noisy[:, 1:]
    ahead[1, :, :-2] = noisy[:, 2:]
    return Trace.from_ids(ids, E, seq=np.repeat([0, 1], n // 2), ahead=ahead, mtp_route=noisy,
                          mtp_valid=np.ones(n, dtype=bool))


@pytest.mark.parametrize("vram_gb", [None, 12.0])
def test_policies_between_on_demand_and_all_resident(vram_gb, capsys):
    res = simulate(skewed_trace(), "pcie4+rtx4090", "qwen3.6-35b-a3b", vram_gb=vram_gb, as_json=True)
    printed = json.loads(capsys.readouterr().out)
    assert set(printed) == set(res)
    tok = {k: v["decode_tok_s"] for k, v in res.items() if not k.startswith("_")}
    assert {"on_demand", "lru", "lru_pinned", "all_resident", "pred:temporal", "pred:layer_ahead1", "pred:mtp"} <= set(tok)
    for name, v in tok.items():
        assert tok["on_demand"] <= v + 1e-9 <= tok["all_resident"] + 2e-9, name
    # the seeds' shape: on demand is link bound (tens of tok/s), all resident VRAM bound (hundreds)
    assert 15 < tok["on_demand"] < 60 and 150 < tok["all_resident"] < 400
    for v in res.values():
        if isinstance(v, dict) and "stall_s" in v:
            assert v["stall_s"] >= 0 and v["compute_s"] > 0


def test_doubling_the_link_never_slows():
    tr = skewed_trace(80, seed=3)
    for name in ("on_demand", "lru", "lru_pinned"):
        slow = run_policy(name, tr, hardware("pcie4+rtx4090", vram_gb=12), geometry(), 0.4, warmup=0)
        fast = run_policy(name, tr, hardware("pcie4+rtx4090", vram_gb=12, link_gbps=50), geometry(), 0.4, warmup=0)
        assert fast["decode_tok_s"] >= slow["decode_tok_s"] - 1e-9, name
    res1 = simulate(tr, "pcie4+rtx4090", vram_gb=12, quiet=True)
    res2 = simulate(tr, "pcie4+rtx4090", vram_gb=12, link_gbps=50, quiet=True)
    for name, r in res1.items():
        if not name.startswith("_"):
            assert res2[name]["decode_tok_s"] >= r["decode_tok_s"] * (1 - 1e-9), name


def test_on_demand_matches_the_hand_sum():
    ids = np.array([[[0, 1]] * L, [[2, 3]] * L], dtype=np.int16)
    tr = Trace.from_ids(ids, E)
    hw = hardware("pcie4+rtx4090")
    geo = geometry("qwen3.6-35b-a3b")
    r = run_policy("on_demand", tr, hw, geo, 0.5, warmup=0)
    vram = 1008e9 * 0.8
    m = 8 / 2  # each traced expert stands for 4 of the target's 8
    layer = 60e-6 + geo.dense_bytes_per_layer / vram + 2 * m * (10e-6 + geo.expert_bytes / 25e9) \
        + 2 * m * geo.expert_bytes / vram
    token = 40 * layer + 150e-6 + geo.head_bytes / vram
    assert r["ms_per_token"] == pytest.approx(1e3 * token, rel=1e-9)
    assert r["decode_tok_s"] == pytest.approx(1 / token, rel=1e-9)
    assert r["transfer_s"] == pytest.approx(2 * 40 * 2 * m * (10e-6 + geo.expert_bytes / 25e9), rel=1e-9)
    assert r["stall_s"] == pytest.approx(r["transfer_s"], rel=1e-9)
    assert r["transfers_per_token"] == 320


def test_presets_and_errors():
    assert set(GEOMETRIES) == {"qwen3.6-35b-a3b", "qwen3-30b-a3b", "mixtral-8x7b"}
    g = geometry("qwen3.6-35b-a3b")
    assert 17e9 < g.layers * g.experts * g.expert_bytes < 19e9  # 4.5 bpw routed experts
    assert cache_share(hardware("pcie4+rtx4090"), geometry("mixtral-8x7b")) < 1.0
    assert hardware("pcie5+h100").link_gbps == 50
    with pytest.raises(MoerunError, match="unknown hardware"):
        hardware("pcie9+abacus")
    with pytest.raises(MoerunError, match="unknown model geometry"):
        geometry("gpt-5")
