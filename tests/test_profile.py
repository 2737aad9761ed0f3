"""Routing traces: recording with hooks on a tiny random model, the file format, cache replays, plots."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moerun.errors import MoerunError
from moerun.experts.profile import Trace, moe_blocks, plot_trace, record_trace, replay_cache, summarize



def tiny_qwen3_5(mtp: bool = True):
    """A tiny random qwen3_5_moe (4 layers, 8 experts, top-2, MTP head), built in memory."""
    from moerun.models import qwen3_5_moe

    cfg = dict(model_type="qwen3_5_moe_text", vocab_size=64, hidden_size=32, num_hidden_layers=4,
               num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_key_head_dim=8,
               linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2, moe_intermediate_size=16,
               shared_expert_intermediate_size=16, num_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
               mtp_num_hidden_layers=int(mtp), layer_types=["linear_attention", "full_attention"] * 2)
    args = qwen3_5_moe.ModelArgs.from_dict(cfg)
    torch.manual_seed(0)
    net = qwen3_5_moe.Model(args)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.fill_(0.0)
    net.eval()
    return SimpleNamespace(net=net, args=args, path="tiny")


def test_record_round_trip(tmp_path):
    llm = tiny_qwen3_5()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 64, (12,), generator=g).tolist() for _ in range(2)]
    tr = record_trace(llm, seqs, [0, 4], logits=True, ahead=2, mtp_candidates=4)
    N = 12 + 8
    assert tr.ids.shape == (N, 4, 2) and tr.ids.dtype == np.int16 and tr.weights.dtype == np.float16
    assert tr.logits.shape == (N, 4, 8) and tr.ahead.shape == (2, N, 4, 8)
    assert tr.mtp_route.shape == (N, 4, 8) and tr.mtp_hidden.shape == (N, 32) and tr.mtp_cand.shape == (N, 4)
    assert tr.token_route.shape == (N, 4, 8)
    np.testing.assert_allclose(tr.token_route.astype(np.float32).sum(-1), 1.0, atol=1e-2)  # routing probabilities
    # the recorded experts are the router's top-k, with renormalised weights
    top = np.sort(np.argsort(-tr.logits.astype(np.float32), axis=-1, kind="stable")[..., :2], axis=-1)
    assert (top == np.sort(tr.ids, axis=-1)).mean() > 0.99
    np.testing.assert_allclose(tr.weights.astype(np.float32).sum(-1), 1.0, atol=2e-3)
    # positions and sequences; the MTP head predicts from position n-2, so two invalid rows per sequence
    assert tr.seq.tolist() == [0] * 12 + [1] * 8 and tr.pos[12:].tolist() == list(range(4, 12))
    assert tr.mtp_valid.tolist() == [False, False] + [True] * 10 + [True] * 8
    assert np.all(tr.ahead[0, :, 3] == 0) and np.all(tr.ahead[1, :, 2:] == 0)
    # the hooks are gone afterwards
    assert all(not b.experts._forward_pre_hooks and not b.gate._forward_pre_hooks for _, b in moe_blocks(llm.net))

    path = tr.save(tmp_path / "t.npz")
    back = Trace.load(path)
    for k in ("ids", "weights", "tokens", "seq", "pos", *Trace.OPTIONAL):
        np.testing.assert_array_equal(getattr(back, k), getattr(tr, k))
    assert back.meta["num_experts"] == 8 and back.meta["top_k"] == 2 and back.meta["moe_layers"] == [0, 1, 2, 3]
    assert not list(tmp_path.glob("*.tmp*"))
    s = summarize(back)
    assert s["tokens"] == N and 0 <= s["mtp_next_token_top4"] <= 1


def test_bad_trace_files(tmp_path):
    with pytest.raises(MoerunError, match="does not exist"):
        Trace.load(tmp_path / "missing.npz")
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip file")
    with pytest.raises(MoerunError, match="cannot read trace"):
        Trace.load(bad)
    with pytest.raises(MoerunError, match="does not exist"):
        Trace.from_ids(np.zeros((2, 1, 1)), 2).save(tmp_path / "no" / "t.npz")
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(MoerunError, match="not a moerun routing trace"):
        Trace.load(tmp_path / "other.npz")


def test_cache_replays_known_answers():
    # one layer, 4 experts, top-1: the sequence 0 1 0 1 ... 2 3
    ids = np.array([0, 1] * 10 + [2, 3]).reshape(-1, 1, 1)
    tr = Trace.from_ids(ids, 4)
    # a cache of 2 holds {0, 1}: only the 2 + 2 first uses of each expert miss
    assert replay_cache(tr, 2, "lru") == pytest.approx(18 / 22)
    assert replay_cache(tr, 2, "lfu") == pytest.approx(18 / 22)
    assert replay_cache(tr, 2, "static") == pytest.approx(20 / 22)  # the hot set, known in advance
    assert replay_cache(tr, 1, "lru") == 0.0  # alternating experts thrash one slot
    assert replay_cache(tr, 4, "lru") == pytest.approx(18 / 22)


def test_plots(tmp_path):
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(8, size=(30, 2), replace=True, p=np.arange(8, 0, -1) / 36) for _ in range(3)], 1)
    ids[..., 1] = (ids[..., 0] + 1) % 8  # distinct experts per token
    paths = plot_trace(Trace.from_ids(ids, 8), tmp_path, curves={"lru": {0.25: 0.3, 1.0: 0.9}})
    assert [p.rsplit("/", 1)[1] for p in paths] == ["heatmap.png", "rank_frequency.png", "hit_rate.png"]
    assert all((tmp_path / p).stat().st_size > 1000 for p in paths)
