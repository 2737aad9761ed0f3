"""qwen3_5_moe against transformers: DeltaNet math, whole model, multimodal config, MTP head."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

import moerun
from conftest import check_against_reference, hf_greedy, rel_err, save_and_load
from moerun.layers.cache import Cache
from moerun.errors import MoerunError
from moerun import kernels
from moerun.kernels import reference
from moerun.layers import deltanet

TINY = dict(
    vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
    linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=16,
    shared_expert_intermediate_size=24, num_experts=6, num_experts_per_tok=2,
)


def make_reference(**overrides) -> Qwen3_5MoeForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3_5MoeTextConfig(**{**TINY, **overrides}, experts_implementation="eager")
    ref = Qwen3_5MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # transformers starts every norm at its identity; move them off it
        for name, p in ref.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(0.2 * torch.randn_like(p))
    return ref


def load(ref, path):
    llm = save_and_load(ref, path)
    torch.set_num_threads(1)
    return llm


def test_deltanet_matches_transformers():
    torch.manual_seed(0)
    B, T, Hk, Hv, Dk, Dv = 2, 150, 2, 4, 8, 6
    q, k = torch.randn(B, T, Hk, Dk), torch.randn(B, T, Hk, Dk)
    v, g, beta = torch.randn(B, T, Hv, Dv), -torch.rand(B, T, Hv), torch.rand(B, T, Hv)
    s0 = torch.randn(B, Hv, Dk, Dv)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    o, s = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, s0)
    assert rel_err(o, o_ref) < 1e-6 and rel_err(s, s_ref) < 1e-6

    o_ref, s_ref = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    s, outs = s0.clone(), []  # the step updates an fp32 state in place
    for t in range(T):
        o, s = reference.recurrent_gated_delta_step(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1], beta[:, t : t + 1], s)
        outs.append(o)
    assert rel_err(torch.cat(outs, 1), o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5

    x, w = torch.randn(B, T, 10), torch.randn(10, 1, 4)
    y_ref = hf.causal_conv1d_fn(x.transpose(1, 2), w.squeeze(1), None, activation="silu").transpose(1, 2)
    y, state = reference.causal_conv1d(x[:, :70], w)
    ys = [y]
    for t in range(70, T):
        y, state = reference.causal_conv1d(x[:, t : t + 1], w, state)
        ys.append(y)
    assert rel_err(torch.cat(ys, 1), y_ref) < 1e-6


def test_text_mrope_is_plain_rope():
    from moerun.layers.rope import Rope

    cfg = Qwen3_5MoeTextConfig(**TINY, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
        mrope_section=[1, 1, 0], mrope_interleaved=True))
    ref = hf.Qwen3_5MoeTextRotaryEmbedding(cfg)
    pos = torch.arange(50)[None]
    cos_ref, sin_ref = ref(torch.zeros(1, dtype=torch.float32), pos)
    cos, sin = Rope(cfg.rope_parameters, 4, cfg.max_position_embeddings)(pos, torch.float32)
    assert torch.equal(cos[:, 0], cos_ref) and torch.equal(sin[:, 0], sin_ref)


def test_rope_span_is_forward_over_consecutive_positions():
    """Rope.span(pos0, T): forward(pos0[:, None] + arange(T)), for one row (views of the
    tables, grown past their first size here) and for several; in bf16 too."""
    from moerun.layers.rope import Rope

    for pos0, T, dtype in ((torch.tensor([3]), 4, torch.float32), (torch.tensor([300]), 2, torch.bfloat16),
                           (torch.tensor([5, 0, 9]), 3, torch.float32)):
        rope = Rope(dict(rope_type="default", rope_theta=10000.0), 8, 64)
        got = rope.span(pos0, T, dtype)
        want = Rope(dict(rope_type="default", rope_theta=10000.0), 8, 64)(pos0[:, None] + torch.arange(T), dtype)
        assert all(a.shape == b.shape and a.dtype == dtype and torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # three DeltaNet layers then one full-attention layer; grouped DeltaNet heads
        dict(  # explicit pattern, equal key/value heads, tied head, biases, other rotary fraction
            num_hidden_layers=5, layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"],
            linear_num_key_heads=3, linear_num_value_heads=3, linear_conv_kernel_dim=3, tie_word_embeddings=True,
            attention_bias=True, hidden_size=36, moe_intermediate_size=13,
            rope_parameters=dict(rope_type="default", rope_theta=1000.0, partial_rotary_factor=0.5),
        ),
    ],
)
def test_matches_transformers(tmp_path, overrides):
    ref = make_reference(**overrides)
    llm = load(ref, tmp_path)
    assert llm.net.args.layer_types == tuple(ref.config.layer_types)
    assert not llm.net.has_mtp and llm.net.mtp_cache_spec() == []
    first_linear = llm.net.args.layer_types.index("linear_attention")
    state = Cache(llm.net.cache_spec(), 1, 8, torch.bfloat16).layers[first_linear]
    assert state.tensors["recurrent"].dtype == state.tensors["conv"].dtype == torch.float32  # fp32 in a bf16 cache
    # 140 tokens: the uncached pass and the cache check cross three 64-token DeltaNet chunks
    check_against_reference(ref, llm, ref.config.vocab_size, seq=140)
    if not overrides:  # greedy after a prompt that spans chunks
        prompt = torch.randint(0, ref.config.vocab_size, (135,), generator=torch.Generator().manual_seed(1)).tolist()
        assert llm.generate_ids([prompt], max_tokens=32, temperature=0.0)[0] == hf_greedy(ref, prompt, 32)


def test_prompt_through_the_chunked_form_with_a_cache(tmp_path, monkeypatch):
    """Natively, a prompt with a cache runs between the projections as one call
    (`deltanet.native_pass`: the chunked form inside); with that off, the modules' chunked
    form (`gated_delta_rule`) carries the cache's states from one pass to the next and
    matches transformers too."""
    ref = make_reference()
    llm = load(ref, tmp_path)
    layer = llm.net.model.layers[llm.net.args.layer_types.index("linear_attention")].linear_attn
    assert layer._token_by_token(140) == kernels.native()
    monkeypatch.setattr(deltanet, "NATIVE_PASSES", False)
    assert not layer._token_by_token(140) and layer._token_by_token(reference.FEW)
    check_against_reference(ref, llm, ref.config.vocab_size, seq=140)


def test_multimodal_checkpoint_loads(tmp_path):
    """The full qwen3_5_moe layout: text under text_config and model.language_model., a vision tower to skip."""
    ref = make_reference()
    ref.save_pretrained(tmp_path)
    tensors = {
        ("model.language_model." + k.removeprefix("model.") if k.startswith("model.") else k): v
        for k, v in load_file(tmp_path / "model.safetensors").items()
    }
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(48, 16)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    text = json.loads((tmp_path / "config.json").read_text())
    cfg = dict(model_type="qwen3_5_moe", architectures=["Qwen3_5MoeForConditionalGeneration"], text_config=text,
               vision_config=dict(model_type="qwen3_5_moe_vision", depth=1, hidden_size=16), tie_word_embeddings=False)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = moerun.load(tmp_path, dtype="float32")
    torch.set_num_threads(1)
    ids = torch.randint(0, TINY["vocab_size"], (2, 30))
    with torch.no_grad():
        assert rel_err(llm.forward(ids), ref(ids).logits) < 1e-4
    assert llm.model_type == "qwen3_5_moe"


class ReferenceMTP(nn.Module):
    """Qwen3.5's MTP head composed from transformers' own blocks (transformers does not ship one)."""

    def __init__(self, config, full_layer: int):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = hf.Qwen3_5MoeRMSNorm(H, eps)
        self.pre_fc_norm_hidden = hf.Qwen3_5MoeRMSNorm(H, eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList([hf.Qwen3_5MoeDecoderLayer(config, full_layer)])
        self.norm = hf.Qwen3_5MoeRMSNorm(H, eps)

    def forward(self, lm, hidden, next_ids):
        B, T, _ = hidden.shape
        e = self.pre_fc_norm_embedding(lm.model.embed_tokens(next_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        pos = torch.arange(T)[None].expand(B, T)  # the positions of the hidden states' tokens
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        x = self.layers[0](x, position_embeddings=lm.model.rotary_emb(x, pos), attention_mask=mask)
        return lm.lm_head(self.norm(x))


def test_mtp_head(tmp_path):
    ref = make_reference()
    full_layer = ref.config.layer_types.index("full_attention")
    torch.manual_seed(1)
    mtp = ReferenceMTP(ref.config, full_layer).eval()
    with torch.no_grad():
        for p in mtp.parameters():
            p.normal_(0.0, 0.2)
    ref.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors.update({f"mtp.{k}": v.contiguous() for k, v in mtp.state_dict().items()})
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))

    llm = moerun.load(tmp_path, dtype="float32")
    torch.set_num_threads(1)
    net = llm.net
    assert net.has_mtp
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, TINY["vocab_size"], (2, 41), generator=g)
    inputs, nxt = ids[:, :-1], ids[:, 1:]
    with torch.inference_mode():
        hidden_ref = ref.model(inputs).last_hidden_state
        want = mtp(ref, hidden_ref, nxt)
        logits, hidden = net(inputs, return_hidden=True)
        assert rel_err(hidden, hidden_ref) < 1e-5
        assert rel_err(net.mtp_logits(hidden, nxt), want) < 1e-4
        # decode: the head's own KV cache, fed a prefix then one position at a time
        cache = Cache(net.mtp_cache_spec(), 2, ids.shape[1], torch.float32)
        steps = [net.mtp_logits(hidden[:, :17], nxt[:, :17], cache)]
        for t in range(17, nxt.shape[1]):
            steps.append(net.mtp_logits(hidden[:, t : t + 1], nxt[:, t : t + 1], cache))
        assert rel_err(torch.cat(steps, 1), want) < 1e-4

    # a config that claims an MTP head over a checkpoint stripped of it: loads, without the head
    save_file({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    stripped = moerun.load(tmp_path, dtype="float32").net
    assert not stripped.has_mtp and stripped.mtp_cache_spec() == []
    with pytest.raises(RuntimeError, match="no MTP head"):
        stripped.mtp_logits(hidden, nxt)
    # a checkpoint with only part of the head is broken: the loader names what is missing
    save_file({k: v for k, v in tensors.items() if k != "mtp.fc.weight"}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MoerunError, match="missing tensor 'mtp.fc.weight'"):
        moerun.load(tmp_path, dtype="float32")


def test_long_prompt_segments(monkeypatch):
    """Prompts longer than one segment run the chunked form segment by segment, carrying the state."""
    monkeypatch.setattr(deltanet, "SEGMENT", 128)
    torch.manual_seed(3)
    B, T, H, D = 1, 300, 2, 8
    q, k, v = torch.randn(B, T, H, D), torch.randn(B, T, H, D), torch.randn(B, T, H, D)
    g, beta = -torch.rand(B, T, H), torch.rand(B, T, H)
    o_ref, s_ref = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = deltanet.chunk_gated_delta_rule(q, k, v, g, beta)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


def test_bf16_conv_of_a_prompt_equals_torchs():
    """A bf16 prompt's causal conv runs in float32 and rounds to bf16 (torch's bf16 depthwise
    conv goes channel by channel on a CPU without bf16 arithmetic): the same values as
    torch's own bf16 conv, and its state."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(2, 40, 24, generator=g).bfloat16(), torch.randn(24, 1, 4, generator=g).bfloat16()
    state = torch.randn(2, 24, 3, generator=g).bfloat16()
    with torch.inference_mode():
        y, new_state = reference.causal_conv1d(x, w, state)
    xs = torch.cat([state, x.transpose(1, 2)], dim=-1)
    assert torch.equal(y, F.silu(F.conv1d(xs, w, groups=24)).transpose(1, 2))
    assert torch.equal(new_state, xs[..., -3:])
