import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.modeling_layers import MtpModel
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import moerun
from conftest import check_against_reference, rel_err
from moerun.layers.cache import Cache
from moerun.errors import MoerunError
from moerun.layers.rope import inv_frequencies

BASE = dict(
    vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    n_routed_experts=8, num_experts_per_tok=3, n_group=1, topk_group=1, n_shared_experts=1,
    q_lora_rank=None, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=5,
    first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=256, num_mtp_layers=0,
)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0,
            beta_fast=32, beta_slow=1, rope_theta=10000.0)



def save_and_load(hf_model, path):
    hf_model.save_pretrained(path)
    return moerun.load(path, dtype="float32", threads=1)


def make_reference(**overrides) -> DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    cfg = DeepseekV3Config(**{**BASE, **overrides}, experts_implementation="eager")
    model = DeepseekV3ForCausalLM(cfg).eval()
    randomize_routers(model)
    return model


def randomize_routers(module):
    # transformers starts the bias at zero and the router near zero: make both matter
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(q_lora_rank=None, norm_topk_prob=True),
        dict(q_lora_rank=16, n_group=4, topk_group=2, norm_topk_prob=False, rope_interleave=False,
             rope_parameters=YARN),
        dict(q_lora_rank=16, n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=2,
             first_k_dense_replace=0, attention_bias=True,
             rope_parameters={**YARN, "mscale": 0.9, "mscale_all_dim": 0.7, "factor": 8.0}),
    ],
    ids=["direct-q", "q-lora-groups-yarn", "yarn-mscale-bias"],
)
def test_matches_transformers(tmp_path, overrides):
    ref = make_reference(**overrides)
    llm = save_and_load(ref, tmp_path)
    assert not llm.net.has_mtp
    with pytest.raises(MoerunError, match="no MTP"):
        llm.net.mtp_logits(torch.zeros(1, 1, BASE["hidden_size"]), torch.zeros(1, 1, dtype=torch.long))
    assert (llm.args.n_routed_experts, llm.args.num_experts_per_tok) == (ref.config.n_routed_experts,
                                                                         ref.config.num_experts_per_tok)
    check_against_reference(ref, llm, BASE["vocab_size"])
    check_chunked_prefill(llm.net)


def check_chunked_prefill(net):
    """Prefill in chunks over a partly filled cache (the expanded path with S > T) == one pass."""
    ids = torch.randint(0, BASE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        full = net(ids)
        cache = Cache(net.cache_spec(), 2, 16, torch.float32)
        chunks = [net(ids[:, i : i + 5], cache) for i in range(0, 16, 5)]
        assert rel_err(torch.cat(chunks, dim=1), full) < 1e-4
        cache = Cache(net.cache_spec(), 3, 16, torch.float32)  # one row, in slot 2
        chunks = [net(ids[1:, i : i + 6], cache, torch.tensor([2])) for i in range(0, 16, 6)]
        assert rel_err(torch.cat(chunks, dim=1), full[1:]) < 1e-4


@pytest.mark.parametrize(
    "rope",
    [YARN, {**YARN, "mscale": 0.9, "mscale_all_dim": 0.7}, {**YARN, "factor": 40.0, "beta_fast": 16},
     {**YARN, "attention_factor": 1.3, "truncate": False}],
)
def test_yarn_frequencies_match_transformers(rope):
    cfg = DeepseekV3Config(**{**BASE, "rope_parameters": dict(rope)})
    ref_freq, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    freq, scale = inv_frequencies(rope, BASE["qk_rope_head_dim"], BASE["max_position_embeddings"])
    torch.testing.assert_close(freq, ref_freq, rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-12)


def write_mtp_weights(mtp: MtpModel, path, num_hidden_layers: int):
    """Add the MTP modules to the checkpoint under DeepSeek-V3's own names (layers L, L+1, ...)."""
    tensors = load_file(path / "model.safetensors")
    for name, t in mtp.state_dict().items():
        m = re.match(r"layers\.(\d+)\.(mtp_block\.)?(.*)", name)
        if m is None:  # the shared embedding and head: DeepSeek stores a copy per MTP layer
            for k in range(len(mtp.layers)):
                prefix = f"model.layers.{num_hidden_layers + k}."
                tensors[prefix + ("shared_head.head.weight" if name.startswith("shared_head") else name)] = t.clone()
            continue
        prefix = f"model.layers.{num_hidden_layers + int(m[1])}."
        rest = m[3].replace("post_norm.", "shared_head.norm.")
        if rest.startswith("mlp.experts."):  # one tensor per expert, as DeepSeek stores them
            proj = rest.rpartition(".")[2]
            for e, w in enumerate(t):
                parts = zip(("gate_proj", "up_proj"), w.chunk(2, dim=0)) if proj == "gate_up_proj" else [(proj, w)]
                for p, part in parts:
                    tensors[f"{prefix}mlp.experts.{e}.{p}.weight"] = part.contiguous()
            continue
        tensors[prefix + rest] = t.contiguous().clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_matches_transformers(tmp_path, depth):
    ref = make_reference(q_lora_rank=16, n_group=2, topk_group=1, num_mtp_layers=depth, rope_parameters=YARN)
    torch.manual_seed(1)
    mtp = MtpModel(ref, depth).eval()
    with torch.no_grad():  # transformers leaves some of these uninitialised; the head and embedding are ref's
        for name, p in mtp.layers.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    randomize_routers(mtp)
    ref.save_pretrained(tmp_path)
    write_mtp_weights(mtp, tmp_path, BASE["num_hidden_layers"])
    # transformers reads the MTP module back from our checkpoint names: the naming is DeepSeek's
    main = DeepseekV3ForCausalLM.from_pretrained(tmp_path, experts_implementation="eager")
    # transformers finds the MTP tensors by the pattern it ignores in the trunk, written for 61 layers
    L = BASE["num_hidden_layers"]
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{L + k}\..*" for k in range(depth)]
    loaded = MtpModel.from_pretrained(main)
    for (name, a), (_, b) in zip(sorted(mtp.state_dict().items()), sorted(loaded.state_dict().items())):
        assert torch.equal(a, b), name

    net = moerun.load(tmp_path, dtype="float32", threads=1).net
    assert net.has_mtp and len(net.model.layers) == BASE["num_hidden_layers"]

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, BASE["vocab_size"], (2, 17), generator=g)
    inp, nxt = ids[:, :-1], ids[:, 1:]
    T = inp.shape[1]
    with torch.no_grad():
        hf_hidden = ref(inp, output_hidden_states=True).hidden_states[-1]
        h = mtp.forward_layer(0, hf_hidden, torch.arange(1, T + 1)[None].expand(2, -1), None, input_ids=nxt)
        expected = mtp._project_to_logits(h)
    with torch.inference_mode():
        logits, hidden = net(inp, return_hidden=True)
        assert rel_err(hidden, hf_hidden) < 1e-4
        ours = net.mtp_logits(hidden, nxt)
    assert ours.shape == (2, T, BASE["vocab_size"])
    assert rel_err(ours, expected) < 1e-4
    if depth == 2:  # the second module drafts one further, from the first one's (normed) output
        with torch.no_grad():
            h1 = mtp.forward_layer(1, h[:, :-1], torch.arange(2, T + 1)[None].expand(2, -1), None, input_ids=ids[:, 2:])
            expected1 = mtp._project_to_logits(h1)
        with torch.inference_mode():
            _, ours_h = net.mtp_logits(hidden, nxt, return_hidden=True)
            ours1 = net.mtp_logits(ours_h[:, :-1], ids[:, 2:], depth=1)
        assert rel_err(ours1, expected1) < 1e-4

    # decode with the MTP's own cache: prefill then one pair at a time == one full pass
    with torch.inference_mode():
        cache = Cache(net.mtp_cache_spec(), 2, T, torch.float32)
        split = T // 2
        steps = [net.mtp_logits(hidden[:, :split], nxt[:, :split], cache)]
        for t in range(split, T):
            steps.append(net.mtp_logits(hidden[:, t : t + 1], nxt[:, t : t + 1], cache))
        assert rel_err(torch.cat(steps, dim=1), ours) < 1e-4
        # one row on its own, in slot 1 of the cache, while the other slot is idle
        cache = Cache(net.mtp_cache_spec(), 2, T, torch.float32)
        one = [net.mtp_logits(hidden[1:, :5], nxt[1:, :5], cache, torch.tensor([1]))]
        one += [net.mtp_logits(hidden[1:, t : t + 1], nxt[1:, t : t + 1], cache, torch.tensor([1])) for t in range(5, 9)]
        assert rel_err(torch.cat(one, dim=1), ours[1:, :9]) < 1e-4


def test_checkpoint_without_mtp_tensors_loads_without_the_head(tmp_path):
    ref = make_reference(num_mtp_layers=1)
    ref.save_pretrained(tmp_path)  # transformers writes num_nextn_predict_layers but not the module
    llm = moerun.load(tmp_path, dtype="float32", threads=1)
    assert not llm.net.has_mtp
    with pytest.raises(MoerunError):
        llm.net.mtp_logits(torch.zeros(1, 1, BASE["hidden_size"]), torch.zeros(1, 1, dtype=torch.long))


def test_partial_mtp_tensors_fail_naming_the_missing_one(tmp_path):
    ref = make_reference(num_mtp_layers=1)
    mtp = MtpModel(ref, 1).eval()
    ref.save_pretrained(tmp_path)
    write_mtp_weights(mtp, tmp_path, BASE["num_hidden_layers"])
    w = load_file(tmp_path / "model.safetensors")
    victim = f"model.layers.{BASE['num_hidden_layers']}.enorm.weight"
    del w[victim]
    save_file(w, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MoerunError, match="missing tensor 'mtp.0.enorm"):
        moerun.load(tmp_path, dtype="float32", threads=1)


# config.json of deepseek-ai/DeepSeek-V3 (the fields that matter here; the old rope_scaling form)
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
    n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
    first_k_dense_replace=3, norm_topk_prob=True, routed_scaling_factor=2.5, scoring_func="sigmoid",
    topk_method="noaux_tc", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, num_nextn_predict_layers=1, max_position_embeddings=163840, rms_norm_eps=1e-6,
    rope_theta=10000, rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                                        mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1),
)


def test_real_config_parses_like_transformers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    from moerun.models.deepseek_v3 import ModelArgs

    args = ModelArgs.from_dict(DEEPSEEK_V3)
    assert args.rope["rope_type"] == "yarn" and args.num_nextn_predict_layers == 1 and args.rope_interleave
    with torch.device("meta"):
        ref = DeepseekV3Attention(DeepseekV3Config(**DEEPSEEK_V3), layer_idx=0)
    assert args.softmax_scale == pytest.approx(ref.scaling, rel=1e-12)
    assert ModelArgs.from_dict({k: v for k, v in DEEPSEEK_V3.items() if k != "num_nextn_predict_layers"}).num_nextn_predict_layers == 0
    with pytest.raises(MoerunError, match="FP8"):
        ModelArgs.from_dict({**DEEPSEEK_V3, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})


def test_bfloat16_runs_close_to_float32(tmp_path):
    ref = make_reference(q_lora_rank=16, n_group=2, topk_group=1, rope_parameters=YARN)
    ref.save_pretrained(tmp_path)
    ids = torch.randint(0, BASE["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    full = moerun.load(tmp_path, dtype="float32", threads=1).forward(ids)
    llm = moerun.load(tmp_path, dtype="bfloat16", threads=1)
    gate = llm.net.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert llm.net.model.layers[1].mlp.experts.gate_proj.dtype == torch.bfloat16
    assert rel_err(llm.forward(ids), full) < 0.05
    assert len(llm.generate_ids([ids[0].tolist(), ids[1, :4].tolist()], max_tokens=4, temperature=0.0)[1]) == 4


def test_the_decode_path_reports_the_native_stack(tmp_path):
    """DeepSeek-V3's decode passes run as the native layer stack (its MLA half one native call,
    `add_mla`): a run's decode path counts them (what `generate --verbose`, `bench --json` and
    `info` show); with an int8 KV cache the MLA half is not native and the path says so."""
    llm = save_and_load(make_reference(), tmp_path)
    llm.generate_ids([[1, 2, 3]], max_tokens=4, temperature=0.0)
    # the run's program is built before its first pass: the three-token prompt and every step
    # run the stack
    assert llm.last_stats.decode_path == {"native_stack_passes": 4, "module_passes": 0, "why": None}
    int8 = moerun.load(tmp_path, dtype="float32", threads=1, kv_cache="int8")
    assert int8.generate_ids([[1, 2, 3]], max_tokens=4, temperature=0.0) == llm.generate_ids([[1, 2, 3]], max_tokens=4,
                                                                                            temperature=0.0)
    path = int8.last_stats.decode_path
    assert path["native_stack_passes"] == 0 and path["module_passes"] == 4 and "int8 KV cache" in path["why"], path


def test_random_model_preset_has_deepseek_v3_shapes():
    """`moerun random-model deepseek-v3`: the public config's shapes and YaRN, read as moerun reads a checkpoint."""
    import math

    from moerun.bench.random_model import preset_config
    from moerun.models import build_on_meta, module_for

    cfg = preset_config("deepseek-v3", layers=2, n_routed_experts=16, vocab_size=256)
    module = module_for(cfg["model_type"])
    a = module.ModelArgs.from_dict(cfg)
    assert (a.hidden_size, a.kv_lora_rank, a.q_lora_rank, a.num_attention_heads) == (7168, 512, 1536, 128)
    assert (a.n_group, a.topk_group, a.num_experts_per_tok, a.first_k_dense_replace) == (8, 4, 8, 3)
    assert a.rope["rope_type"] == "yarn" and a.rope["factor"] == 40
    assert math.isclose(a.softmax_scale, 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)
    net = build_on_meta(module, a)
    assert all(layer.mlp.gate_proj.weight.shape == (18432, 7168) for layer in net.model.layers)  # both dense (< 3)
    assert not net.has_mtp
    net = build_on_meta(module, module.ModelArgs.from_dict({**cfg, "first_k_dense_replace": 1}))
    assert net.model.layers[1].mlp.experts.gate_proj.shape == (16, 2048, 7168)
