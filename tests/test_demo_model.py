"""The bundled demo model (moerun/demo_model): shape of the checkpoint, and moerun runs it."""

import json
from pathlib import Path

import pytest
import torch

import moerun

DEMO = Path(moerun.__file__).resolve().parent / "demo_model"
HAS_QWEN3_5_LOADER = (Path(moerun.__file__).resolve().parent / "models" / "qwen3_5_moe.py").is_file()

pytestmark = pytest.mark.skipif(not (DEMO / "model.safetensors").is_file(), reason="demo model not shipped")


def _config():
    return json.loads((DEMO / "config.json").read_text())


def test_config_is_qwen3_5_moe_hybrid():
    cfg = _config()
    assert cfg["model_type"] in ("qwen3_5_moe", "qwen3_5_moe_text")
    cfg = cfg.get("text_config", cfg)
    types = cfg["layer_types"]
    # the 3:1 pattern of Qwen3.5/3.6-MoE: three Gated DeltaNet layers, then one gated full-attention layer
    assert types == (["linear_attention"] * 3 + ["full_attention"]) * (len(types) // 4)
    assert cfg["num_experts"] >= 32 and 4 <= cfg["num_experts_per_tok"] <= 8
    assert cfg["shared_expert_intermediate_size"] > 0
    assert cfg["mtp_num_hidden_layers"] == 1


def test_checkpoint_has_mtp_head_and_fits_budget():
    from safetensors import safe_open

    path = DEMO / "model.safetensors"
    assert path.stat().st_size <= 40 * 2**20
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
    for name in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.fc.weight",
                 "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.gate.weight",
                 "mtp.layers.0.mlp.experts.0.gate_proj.weight", "mtp.layers.0.mlp.shared_expert.up_proj.weight",
                 "mtp.layers.0.input_layernorm.weight"):
        assert name in keys, name
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "MODEL_CARD.md"):
        assert (DEMO / name).is_file(), name
    assert "chat_template" in json.loads((DEMO / "tokenizer_config.json").read_text())


@pytest.fixture(scope="module")
def llm():
    if not HAS_QWEN3_5_LOADER:
        pytest.skip("moerun/models/qwen3_5_moe.py does not exist yet, so moerun cannot load the demo model")
    return moerun.load(threads=1)  # no path: the bundled demo model


def test_moerun_loads_demo_by_default(llm):
    assert llm.path.resolve() == DEMO.resolve()
    assert llm.model_type in ("qwen3_5_moe", "qwen3_5_moe_text")
    assert llm.net.has_mtp


def test_greedy_generation_is_deterministic(llm):
    prompt = "def read_file(path):\n"
    a = "".join(llm.generate(prompt, max_tokens=12, temperature=0.0))
    b = "".join(llm.generate(prompt, max_tokens=12, temperature=0.0))
    assert a == b and a.strip()


def test_mtp_head_predicts_token_after_next(llm):
    ids = torch.tensor([llm.tokenizer.encode("import os\nimport sys\n\n\ndef main():\n    ")])
    with torch.inference_mode():
        logits, hidden = llm.net(ids, return_hidden=True)
        mtp = llm.net.mtp_logits(hidden[:, :-1], ids[:, 1:])
    assert mtp.shape == (1, ids.shape[1] - 1, logits.shape[-1])
    assert torch.isfinite(mtp).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_native_decode_steps_match_torch_forward(dtype):
    """The demo model's decode steps (native kernels on its float weights: experts, linears,
    attention blocks, DeltaNet, norms, routers) against one float32 forward pass (torch's
    GEMMs) over the same tokens. float32: within 1e-4 everywhere. bf16: within its rounding
    at almost every position (median and 90th percentile; one position may route a near-tie
    to another expert, as bf16 prefill may too) and the same greedy picks."""
    from moerun.layers.cache import Cache

    llm = moerun.load(dtype=dtype, threads=2)
    ref = moerun.load(dtype="float32", threads=2).net if dtype != "float32" else llm.net
    net = llm.net
    errs, agree = [], []
    for text in ("import os\nimport sys\n\n\ndef main(argv):\n    parser = ", "class Foo:\n    def __init__(self, x):\n"):
        ids = torch.tensor([llm.tokenizer.encode(text)])
        T = ids.shape[1]
        with torch.inference_mode():
            full = ref(ids)[0].float()
            cache = Cache(net.cache_spec(), 1, T, llm.dtype)
            steps = [net(ids[:, :4], cache)[0]] + [net(ids[:, t : t + 1], cache)[0] for t in range(4, T)]
        steps = torch.cat(steps).float()
        errs += ((steps - full).abs().amax(-1) / full.abs().amax(-1)).tolist()
        agree += (steps.argmax(-1) == full.argmax(-1)).tolist()
    errs.sort()
    if dtype == "float32":
        assert errs[-1] < 1e-4 and all(agree)
    else:
        assert errs[len(errs) // 2] < 1e-2 and errs[9 * len(errs) // 10] < 2e-2
        assert sum(agree) >= 0.9 * len(agree)


def test_loading_skips_initializers_on_meta():
    """The net is built on the meta device with its initializers skipped there
    (`models.build_on_meta`): nn.Embedding's normal_ would import torch._dynamo, most of this
    model's load. A fresh interpreter loads the model without importing it. Only meta tensors
    of the building thread are left uninitialised: a module made on the CPU meanwhile, on
    that thread or another, is initialised, and everything is as before once it returns,
    also when building fails."""
    import subprocess
    import sys
    import threading
    import types

    from moerun.models import build_on_meta

    code = ("import sys, torch, moerun; moerun.load(sys.argv[1]); print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(DEMO)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"

    def seeded(**kw):  # an embedding initialised from seed 0 (as torch draws it)
        torch.manual_seed(0)
        return torch.nn.Embedding(4, 2, **kw).weight.detach().clone()

    seen = {}

    def fails(args):
        seen["meta"] = torch.nn.Embedding(4, 2).weight.is_meta
        seen["here"] = seeded(device="cpu")
        other = threading.Thread(target=lambda: seen.update(other=seeded()))
        other.start()
        other.join()
        raise ValueError("bad args")

    with pytest.raises(ValueError):
        build_on_meta(types.SimpleNamespace(Model=fails), None)
    expected = seeded()
    assert seen["meta"] and torch.equal(seen["here"], expected) and torch.equal(seen["other"], expected)
    assert expected.std() > 0  # initialised again off the meta device
