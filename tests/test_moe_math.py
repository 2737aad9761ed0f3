"""MoE math with hand-set weights whose answer is known in closed form, and the grouped
expert dispatch against a plain per-token loop.

Hand-set experts: gate_e = up_e = identity and down_e = (e + 1) * identity, so expert e maps
a token v to (e + 1) * v * silu(v) elementwise; a token's output is then
sum_k w_k * (ids_k + 1) * v * silu(v), which the tests write out as numbers.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from moerun.kernels.reference import expert_mlp, group_by_expert
from moerun.layers.moe import Experts

E, H = 4, 4  # experts; hidden = expert width, so identity matrices fit



def v_silu_v(v: float) -> float:
    return v * v / (1.0 + math.exp(-v))


def hand_experts() -> Experts:
    ex = Experts(E, H, H)
    eye = torch.eye(H)
    with torch.no_grad():
        ex.gate_proj.copy_(eye.expand(E, H, H))
        ex.up_proj.copy_(eye.expand(E, H, H))
        ex.down_proj.copy_(torch.stack([(e + 1) * eye for e in range(E)]))
    return ex


def test_group_by_expert():
    ids = torch.tensor([[2, 0], [0, 3], [2, 3]])
    order, counts = group_by_expert(ids, 5)
    assert counts == [2, 0, 2, 2, 0]
    # flattened pairs 0..5 are experts 2,0,0,3,2,3; stable sort by expert
    assert order.tolist() == [1, 2, 0, 4, 3, 5]


def test_experts_hand_set_ids_and_weights():
    ex = hand_experts()
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0], [3.0, 1.0, -1.0, 2.0], [-0.5, 0.25, 4.0, -3.0]])
    ids = torch.tensor([[0, 2], [3, 2], [2, 0]])  # expert 1 is chosen by no token
    weights = torch.tensor([[0.75, 0.25], [0.5, 0.5], [1.0, 0.0]])
    # token 0: 0.75*1 + 0.25*3 = 1.5; token 1: 0.5*4 + 0.5*3 = 3.5; token 2: 1*3 + 0*1 = 3
    scale = [1.5, 3.5, 3.0]
    expected = torch.tensor([[s * v_silu_v(v) for v in row] for s, row in zip(scale, x.tolist())])
    torch.testing.assert_close(ex(x, ids, weights), expected, rtol=1e-6, atol=1e-6)


# Router logits chosen as log-probabilities, so the softmax gives these numbers back.
PROBS = [
    [0.5, 0.3, 0.15, 0.05],  # top-2: experts 0, 1
    [0.1, 0.2, 0.6, 0.1],  # top-2: experts 2, 1
    [0.05, 0.15, 0.2, 0.6],  # top-2: experts 3, 2
]
# sum_k p_k * (e_k + 1) over the top-2, as raw probabilities and renormalised over the two
SCALE_RAW = [0.5 * 1 + 0.3 * 2, 0.6 * 3 + 0.2 * 2, 0.6 * 4 + 0.2 * 3]  # 1.1, 2.2, 3.0
SCALE_RENORM = [0.625 * 1 + 0.375 * 2, 0.75 * 3 + 0.25 * 2, 0.75 * 4 + 0.25 * 3]  # 1.375, 2.75, 3.75


def routed_block(module, **fields):
    """A model file's sparse MoE block with hand-set router and experts."""
    cfg = dict(
        model_type=module.__name__.rsplit(".", 1)[-1], vocab_size=8, hidden_size=H, intermediate_size=H,
        moe_intermediate_size=H, shared_expert_intermediate_size=H, num_hidden_layers=1,
        num_attention_heads=1, num_key_value_heads=1, num_experts=E, num_local_experts=E, num_experts_per_tok=2, **fields,
    )
    block = module.SparseMoeBlock(module.ModelArgs.from_dict(cfg))
    hand = hand_experts()
    with torch.no_grad():
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(block.experts, name).copy_(getattr(hand, name))
        # token n is one_hot(n), so its router logits are column n of the router weight
        block.gate.weight.zero_()
        block.gate.weight[:, : len(PROBS)] = torch.tensor(PROBS).log().T
    return block


def tokens() -> torch.Tensor:
    return torch.eye(H)[: len(PROBS)][None]  # [1, 3, H]: token n = one_hot(n)


def expected_from(scales) -> torch.Tensor:
    out = torch.zeros(len(scales), H)
    for n, s in enumerate(scales):
        out[n, n] = s * v_silu_v(1.0)
    return out[None]


@pytest.mark.parametrize("norm_topk_prob, scales", [(False, SCALE_RAW), (True, SCALE_RENORM)])
@pytest.mark.parametrize("arch", ["olmoe", "qwen3_moe"])
def test_router_top2_hand_set(arch, norm_topk_prob, scales):
    import importlib

    block = routed_block(importlib.import_module(f"moerun.models.{arch}"), norm_topk_prob=norm_topk_prob)
    torch.testing.assert_close(block(tokens()), expected_from(scales), rtol=1e-6, atol=1e-6)


def test_mixtral_router_always_renormalises():
    from moerun.models import mixtral

    block = routed_block(mixtral)
    torch.testing.assert_close(block(tokens()), expected_from(SCALE_RENORM), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("norm_topk_prob, scales", [(False, SCALE_RAW), (True, SCALE_RENORM)])
def test_qwen2_moe_shared_expert_sigmoid_gate(norm_topk_prob, scales):
    from moerun.models import qwen2_moe

    block = routed_block(qwen2_moe, norm_topk_prob=norm_topk_prob)
    with torch.no_grad():
        for lin in (block.shared_expert.gate_proj, block.shared_expert.up_proj, block.shared_expert.down_proj):
            lin.weight.copy_(torch.eye(H))
        # sigmoid(ln 3) = 3/4, sigmoid(0) = 1/2, sigmoid(-ln 3) = 1/4 for tokens 0, 1, 2
        block.shared_expert_gate.weight.copy_(torch.tensor([[math.log(3), 0.0, -math.log(3), 0.0]]))
    shared = [0.75, 0.5, 0.25]
    expected = expected_from([s + g for s, g in zip(scales, shared)])
    torch.testing.assert_close(block(tokens()), expected, rtol=1e-6, atol=1e-6)


def naive_experts(x, ids, weights, gate, up, down):
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[n, k])
            h = F.silu(gate[e] @ x[n]) * (up[e] @ x[n])
            out[n] += weights[n, k] * (down[e] @ h)
    return out


@pytest.mark.parametrize("N, E_, K", [(1, 5, 2), (37, 6, 3), (64, 16, 4), (9, 3, 3)])
def test_grouped_dispatch_equals_per_token_loop(N, E_, K):
    g = torch.Generator().manual_seed(N * 100 + E_)
    Hd, I = 16, 11
    x = torch.randn(N, Hd, generator=g, dtype=torch.float64)
    gate = torch.randn(E_, I, Hd, generator=g, dtype=torch.float64)
    up = torch.randn(E_, I, Hd, generator=g, dtype=torch.float64)
    down = torch.randn(E_, Hd, I, generator=g, dtype=torch.float64)
    # distinct experts per token, as top-k gives; some experts may go unused
    ids = torch.rand(N, E_, generator=g).argsort(-1)[:, :K]
    weights = torch.rand(N, K, generator=g, dtype=torch.float64)
    ref = naive_experts(x, ids, weights, gate, up, down)
    torch.testing.assert_close(expert_mlp(x, ids, weights, gate, up, down), ref, rtol=1e-12, atol=1e-12)

    ex = Experts(E_, Hd, I)
    with torch.no_grad():
        ex.gate_proj.copy_(gate), ex.up_proj.copy_(up), ex.down_proj.copy_(down)
    torch.testing.assert_close(ex(x.float(), ids, weights.float()), ref.float(), rtol=1e-4, atol=1e-4)
