"""Qwen2-MoE (q/k/v biases, a shared expert with a sigmoid gate, softmax top-k without
renormalisation), OLMoE (q/k norms across all heads) and Mixtral with a sliding window on the
native layer stack: decode steps take it (`decode_path`), and its logits and hidden states are
those of the module path bit for bit, in float32 and bf16, plain and int4; a batch's decode
step (the fused attention over the rows, `attn_block_rows`) gives each row the bits it gets
alone. The fused attention block against each module's own torch forward is in
test_attention.py."""

from __future__ import annotations

import pytest
import torch

from moerun import kernels
from moerun.layers import stack
from moerun.layers.attention import attention_fuses
from test_stack import passes

pytestmark = pytest.mark.skipif(kernels.isa() == "torch", reason="needs the native extension")

V = 97


def _randomise(ref, norms=False):
    """transformers' init leaves biases at zero and norms at one: make them count."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("proj.bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif norms and name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
    return ref


def make_qwen2(**over):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = dict(vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, **over)
    return _randomise(Qwen2MoeForCausalLM(Qwen2MoeConfig(**cfg, experts_implementation="eager")))


def make_olmoe(**over):
    from transformers import OlmoeConfig, OlmoeForCausalLM

    cfg = dict(vocab_size=V, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, **over)
    return _randomise(OlmoeForCausalLM(OlmoeConfig(**cfg, eos_token_id=None, pad_token_id=None,
                                                   experts_implementation="eager")), norms=True)


def make_mixtral(**over):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = dict(vocab_size=V, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2, **over)
    return MixtralForCausalLM(MixtralConfig(**cfg, eos_token_id=None, experts_implementation="eager"))


ARCHS = {
    "qwen2_moe": lambda: make_qwen2(),
    # windows of 6 on layers 0 and 2 (transformers' rule), which the decode steps cross
    "qwen2_moe-window": lambda: make_qwen2(use_sliding_window=True, sliding_window=6, max_window_layers=3),
    "olmoe": lambda: make_olmoe(),
    "mixtral-window": lambda: make_mixtral(sliding_window=5),
}


@pytest.fixture(scope="module")
def arch_path(tmp_path_factory):
    made = {}

    def make(name):
        if name not in made:
            torch.manual_seed(0)
            path = tmp_path_factory.mktemp(name)
            ARCHS[name]().eval().save_pretrained(path)
            made[name] = path
        return made[name]

    return make


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quant", [None, "int4"])
def test_stack_is_bit_identical_to_the_modules(arch_path, arch, dtype, quant):
    import moerun

    net = moerun.load(arch_path(arch), dtype=dtype, threads=1, quant=quant).net
    assert all(attention_fuses(layer.self_attn) for layer in net.model.layers)  # the fused block takes them
    kv = net.model.embed_tokens.weight.dtype
    with torch.inference_mode():
        want, want_cache = passes(net, kv, None, keep_cache=True)  # (positions reach 22: past the windows)
        plans = {}
        got, got_cache = passes(net, kv, plans, keep_cache=True)
    path = stack.decode_path(plans)
    # the prefill runs the modules; every decode pass the stack (its first of each shape too:
    # the stack is built before it runs)
    assert path == {"native_stack_passes": 8, "module_passes": 0, "why": None}, path
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want, strict=True))
    for a, b in zip(got_cache.layers, want_cache.layers):  # the keys and values written, too
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def batch_steps(net, dtype, plans, rows, steps=5):
    """Rows of different lengths prefilled one by one into slots (2, 0) of a 3-slot cache,
    then `steps` decode steps of the batch (or, with one row, of that row alone) -> per step
    the logits [rows, V]."""
    from moerun.layers.cache import Cache

    g = torch.Generator().manual_seed(11)
    prompts = {2: torch.randint(0, V, (1, 9), generator=g), 0: torch.randint(0, V, (1, 4), generator=g)}
    nexts = torch.randint(0, V, (2, steps), generator=g)
    cache = Cache(net.cache_spec(), 3, 32, dtype)
    kw = {} if plans is None else {"plans": plans}
    for s in rows:
        net(prompts[s], cache, torch.tensor([s]), **kw)
    slots = torch.tensor(rows)
    pick = [list(prompts).index(s) for s in rows]
    return [net(nexts[pick, i : i + 1], cache, slots, **kw)[:, -1] for i in range(steps)]


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_batch_row_has_the_bits_of_the_row_alone(arch_path, arch, dtype, monkeypatch):
    """A batch's decode steps against each row decoded alone, both through the native stack
    (the first step too: no step runs the modules' fused block over the rows,
    `attn_block_rows`): the same logits, bit for bit."""
    import moerun

    net = moerun.load(arch_path(arch), dtype=dtype, threads=1, quant="int4").net
    kv = net.model.embed_tokens.weight.dtype
    rows_calls = []
    real = kernels.attn_block_rows_run
    monkeypatch.setattr(kernels, "attn_block_rows_run", lambda *a, **k: rows_calls.append(1) or real(*a, **k))
    with torch.inference_mode():
        plans = {}
        batch = batch_steps(net, kv, plans, (2, 0))
        assert not rows_calls  # every step the stack
        assert stack.decode_path(plans)["native_stack_passes"] == 6  # 5 steps and the 4-token prompt
        alone = {}
        for r, s in enumerate((2, 0)):
            plans = {}
            alone[r] = batch_steps(net, kv, plans, (s,))
            assert stack.decode_path(plans)["native_stack_passes"] == 5 + (s == 0)  # (slot 0's prompt: 4 tokens)
    for i, step in enumerate(batch):
        for r in (0, 1):
            assert torch.equal(step[r], alone[r][i][0]), (i, r)


@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe", "mixtral-window"])
def test_generate_reports_the_native_stack(arch_path, arch):
    """`generate`'s decode path (what `moerun generate --verbose` and `bench --json` show):
    every decode step after the first through the native stack, greedy tokens those of the
    modules' path (no plans)."""
    import moerun

    llm = moerun.load(arch_path(arch), dtype="float32", threads=1, quant="int4")
    prompt = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    got = llm.generate_ids([prompt], max_tokens=10, temperature=0.0)[0]
    path = llm.last_stats.decode_path
    assert path["native_stack_passes"] >= 8 and path["why"] is None, path
    net = llm.net
    with torch.inference_mode():  # the same tokens greedily through the modules alone
        from moerun.layers.cache import Cache

        cache = Cache(net.cache_spec(), 1, 32, net.model.embed_tokens.weight.dtype)
        ids = torch.tensor([prompt])
        want = []
        for _ in range(10):
            t = int(net(ids, cache, last_only=True)[0, -1].argmax())
            want.append(t)
            ids = torch.tensor([[t]])
    assert got == want


def test_clip_qkv_keeps_olmoe_on_the_modules(arch_path, tmp_path):
    """OLMoE with clip_qkv: the fused block does not clip, so its attention stays a module and
    the stack steps aside, saying why."""
    import moerun

    torch.manual_seed(0)
    make_olmoe(clip_qkv=1.5).eval().save_pretrained(tmp_path)
    llm = moerun.load(tmp_path, dtype="float32", threads=1)
    assert not any(attention_fuses(layer.self_attn) for layer in llm.net.model.layers)
    llm.generate_ids([[1, 2, 3, 4]], max_tokens=4, temperature=0.0)
    path = llm.last_stats.decode_path
    assert path["native_stack_passes"] == 0 and "attention half" in path["why"], path


@pytest.mark.parametrize("arch", ["qwen2_moe-window", "olmoe", "mixtral-window"])
def test_bench_json_reports_the_native_stack(arch_path, arch, capsys):
    """`moerun bench --json`'s decode_path: every timed decode pass as one native call."""
    import json

    from moerun.cli import main

    argv = ["bench", "-m", arch_path(arch), "--prompt-tokens", "8", "--gen-tokens", "6", "--threads", "1", "--json"]
    assert main([*map(str, argv), "--quant", "int4"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["decode_path"] == {"native_stack_passes": 6, "module_passes": 0, "why": None}, d["decode_path"]


# -- DeepSeek-V3: its MLA half and its MLP halves on the native stack --------------------------

def make_deepseek_v3(**over):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = dict(vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
               topk_group=2, n_shared_experts=1, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
               qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1, routed_scaling_factor=2.5,
               max_position_embeddings=256, num_mtp_layers=0, **over)
    ref = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg, experts_implementation="eager"))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # transformers starts the router near zero and the bias at zero: make both matter
        for name, p in ref.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for name, b in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return ref


@pytest.fixture(scope="module")
def deepseek_path(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("deepseek_v3")
    make_deepseek_v3().eval().save_pretrained(path)
    return path


def _halves(monkeypatch, fused: bool) -> list:
    """Count the native MLP halves' calls (`moe_block_run`, `mlp_block_run`); with fused False
    the modules run one by one instead."""
    from moerun.layers import moe

    calls = []
    for name in ("moe_block_run", "mlp_block_run"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    if not fused:
        monkeypatch.setattr(moe, "moe_fusable", lambda *a: None)
        monkeypatch.setattr(moe, "mlp_fusable", lambda *a: None)
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quant", [None, "int4"])
def test_deepseek_v3_stack_is_bit_identical_to_the_modules(deepseek_path, dtype, quant, monkeypatch):
    """DeepSeek-V3's decode passes through the native stack (the MLA half `add_mla`, the dense
    first layer's MLP half, the MoE layers' grouped sigmoid routing): the logits, hidden states
    and caches of the modules one by one bit for bit, the MLP halves there running torch's
    modules (the MLA half runs its one native call on both paths: `mla_residual`; against the
    torch module, within float rounding, in test_mla.py)."""
    import moerun

    net = moerun.load(deepseek_path, dtype=dtype, threads=1, quant=quant).net
    kv = net.model.embed_tokens.weight.dtype
    with torch.inference_mode(), monkeypatch.context() as m:
        calls = _halves(m, fused=False)
        want, want_cache = passes(net, kv, None, keep_cache=True)
        assert not calls  # (the MLP halves ran as modules)
    plans = {}
    with torch.inference_mode():
        got, got_cache = passes(net, kv, plans, keep_cache=True)
    # the prefill runs the modules; every decode pass the stack (its first of each shape too:
    # the stack is built before it runs)
    path = stack.decode_path(plans)
    assert path == {"native_stack_passes": 8, "module_passes": 0, "why": None}, path
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want, strict=True))
    for a, b in zip(got_cache.layers, want_cache.layers):  # the joined rows written, too
        assert a.joined is not None and torch.equal(a.joined, b.joined)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deepseek_v3_batch_row_has_the_bits_of_the_row_alone(deepseek_path, dtype):
    """A DeepSeek-V3 batch's decode steps through the native stack (each row's MLA half at its own
    slot and position, the MLP halves' tokens each on its own) against each row alone: the same
    logits, bit for bit."""
    import moerun

    net = moerun.load(deepseek_path, dtype=dtype, threads=1, quant="int4").net
    kv = net.model.embed_tokens.weight.dtype
    with torch.inference_mode():
        plans = {}
        batch = batch_steps(net, kv, plans, (2, 0))
        assert stack.decode_path(plans)["native_stack_passes"] == 6  # 5 steps and the 4-token prompt
        alone = {r: batch_steps(net, kv, {}, (s,)) for r, s in enumerate((2, 0))}
    for i, step in enumerate(batch):
        for r in (0, 1):
            assert torch.equal(step[r], alone[r][i][0]), (i, r)
