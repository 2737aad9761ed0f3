"""int8 KV cache (`--kv-cache int8`): the quantization bound, the cache against the float
cache, the logits and tokens of real models, memory, batches, speculative decoding, bad input."""

import json

import pytest
import torch

import moerun
from moerun import kernels
from conftest import make_tiny_model, rel_err
from moerun.layers.cache import (Cache, Int8KVCache, KVCache, KVSpec, RecurrentState, dequantize_int8,
                                 kv_bytes_per_token, quantize_int8)
from moerun.errors import MoerunError

# Per-token absmax int8 moves every key and value by at most 1/254 of its row's largest
# magnitude (0.4%); through the few layers of these tiny fp32 models the logits moved by
# 0.15-0.3% of their largest magnitude (measured), so 1% leaves room without hiding a bug
# (a wrong scale or position moves them by tens of percent).
LOGITS_TOL = 1e-2


def test_round_trip_error_is_at_most_half_a_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 50, 64, generator=g) * torch.logspace(-6, 3, 50)[:, None]  # magnitudes 1e-6 .. 1e3
    x[0, 0, 0] = 0.0  # an all-zero head
    x[1, 2, 3, 5] = 500.0  # an outlier
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.shape == (3, 4, 50, 1)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    back = dequantize_int8(q, scale, torch.float32)
    err = (back - x).abs()
    assert bool((err <= scale / 2 * (1 + 1e-6)).all())
    assert bool((back[0, 0, 0] == 0).all())
    assert float((err / scale.clamp_min(1e-30)).max()) > 0.4  # the bound is tight, not vacuous
    assert dequantize_int8(q, scale, torch.bfloat16).dtype == torch.bfloat16


def test_int8_cache_returns_the_float_cache_quantized_per_token():
    """Same writes into both caches (one row, a contiguous batch, scattered slots, chunks):
    the int8 cache returns exactly the float cache's keys and values after a round trip."""
    spec, slots_total, L = KVSpec(kv_heads=2, k_dim=8, v_dim=6), 4, 12
    ref, q8 = KVCache(spec, slots_total, L, torch.float32), Int8KVCache(spec, slots_total, L)
    lengths = torch.zeros(slots_total, dtype=torch.long)
    g = torch.Generator().manual_seed(1)
    for slots, T in [([2], 5), ([0, 1], 3), ([3, 0], 2), ([1, 2, 3], 1), ([2], 4)]:
        slots = torch.tensor(slots)
        pos0 = lengths[slots].clone()
        k = torch.randn(len(slots), 2, T, 8, generator=g)
        v = torch.randn(len(slots), 2, T, 6, generator=g) * 10
        k_ref, v_ref = ref.update(slots, pos0, k, v)
        k8, v8 = q8.update(slots, pos0, k, v)
        assert k8.shape == k_ref.shape and v8.shape == v_ref.shape
        assert torch.equal(k8, dequantize_int8(*quantize_int8(k_ref), torch.float32))
        assert torch.equal(v8, dequantize_int8(*quantize_int8(v_ref), torch.float32))
        lengths[slots] += T
    with pytest.raises(ValueError, match="exceeds"):
        q8.update(torch.tensor([2]), torch.tensor([10]), k[:1], v[:1])


@pytest.mark.parametrize("dtype, most", [(torch.bfloat16, 0.52), (torch.float32, 0.26)])
def test_memory_is_about_half_of_bf16_and_a_quarter_of_fp32(dtype, most):
    """Qwen3-30B-A3B attention (4 KV heads of 128) next to a recurrent layer that keeps its dtype."""
    specs = [KVSpec(4, 128, 128), None, KVSpec(4, 128, 128)]
    float_cache = Cache(specs, 2, 100, dtype)
    int8_cache = Cache(specs, 2, 100, dtype, torch.int8)
    assert all(isinstance(layer, Int8KVCache) for layer in int8_cache.layers[::2])
    ratio = int8_cache.nbytes() / float_cache.nbytes()
    assert ratio == (128 + 4) / (128 * dtype.itemsize)
    assert ratio <= most
    # bytes per token as reported by `info` and `bench --json` are the tensors' bytes
    assert kv_bytes_per_token(specs, torch.int8) * 2 * 100 == int8_cache.nbytes()
    assert kv_bytes_per_token(specs, dtype) * 2 * 100 == float_cache.nbytes()


def test_recurrent_state_keeps_the_model_dtype():
    from moerun.layers.cache import StateSpec

    cache = Cache([StateSpec((("s", (3, 4)),)), KVSpec(1, 4, 4)], 2, 8, torch.bfloat16, torch.int8)
    assert isinstance(cache.layers[0], RecurrentState) and cache.layers[0].tensors["s"].dtype == torch.bfloat16


def test_float_kv_cache_type_is_read_back_in_the_compute_dtype(tiny_qwen3):
    """--kv-cache float16 on a float32 model: fp16 storage, fp32 attention, logits close."""
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(3))
    cache = Cache(tiny_qwen3.net.cache_spec(), 2, 20, torch.float32, torch.float16)
    assert cache.layers[0].k.dtype == torch.float16
    assert rel_err(cached_logits(tiny_qwen3, ids, torch.float16), tiny_qwen3.forward(ids)) < 1e-2


def cached_logits(llm, ids, kv_dtype):
    """Logits of a prefill of half the tokens, then one token at a time, through the cache."""
    net = llm.net
    B, T = ids.shape
    cache = Cache(net.cache_spec(), B, T, llm.dtype, kv_dtype)
    with torch.inference_mode():
        steps = [net(ids[:, : T // 2], cache)]
        steps += [net(ids[:, t : t + 1], cache) for t in range(T // 2, T)]
    return torch.cat(steps, dim=1).float()


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    make_tiny_model(path, max_position_embeddings=128)
    return moerun.load(path, dtype="float32", threads=1)


@pytest.fixture(scope="module")
def tiny_qwen35(tmp_path_factory):
    """qwen3_5_moe (DeltaNet + gated attention) with a random MTP head."""
    from test_speculative import build_qwen

    path = build_qwen(tmp_path_factory.mktemp("qwen3_5_moe"))
    return moerun.load(path, dtype="float32", threads=1)


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    from test_deepseek_v3 import make_reference

    path = tmp_path_factory.mktemp("deepseek_v3")
    make_reference().save_pretrained(path)
    return moerun.load(path, dtype="float32", threads=1)


@pytest.mark.parametrize("model", ["tiny_qwen3", "tiny_qwen35", "tiny_deepseek"])
def test_logits_close_to_the_float_cache(model, request):
    """DeepSeek-V3 is supported: its cached MLA latent and rotary key are quantized per token."""
    llm = request.getfixturevalue(model)
    ids = torch.randint(0, llm.args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    float_logits = cached_logits(llm, ids, None)
    int8_logits = cached_logits(llm, ids, torch.int8)
    assert rel_err(float_logits, llm.forward(ids)) < 1e-5
    err = rel_err(int8_logits, float_logits)
    assert 1e-5 < err < LOGITS_TOL  # the int8 path ran, and stayed close


@pytest.fixture
def allocated(monkeypatch):
    """Every Cache the generate loops make for their runs, so a test can check the loops
    used int8."""
    caches = []
    from moerun.engine import generate, speculative

    class Recorded(Cache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            caches.append(self)

    monkeypatch.setattr(generate, "Cache", Recorded)
    monkeypatch.setattr(speculative, "Cache", Recorded)
    return caches


def all_int8(caches) -> bool:
    kv = [layer for c in caches for layer in c.layers if isinstance(layer, (KVCache, Int8KVCache))]
    return bool(kv) and all(isinstance(layer, Int8KVCache) for layer in kv)


@pytest.mark.parametrize("model", ["tiny_qwen3", "tiny_qwen35"])
def test_batch_of_different_lengths_equals_one_by_one(model, request, allocated):
    llm = request.getfixturevalue(model)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, llm.args.vocab_size, (n,), generator=g).tolist() for n in (3, 11, 6)]
    llm.kv_dtype = torch.int8
    try:
        batched = llm.generate_ids(prompts, max_tokens=8, temperature=0.0)
        singles = [llm.generate_ids([p], max_tokens=8, temperature=0.0)[0] for p in prompts]
    finally:
        llm.kv_dtype = None
    assert batched == singles and all(len(o) == 8 for o in batched)
    # the batch's cache and each single run's
    assert len(allocated) == 4 and all_int8(allocated)


@pytest.mark.parametrize("draft_tokens", [1, 3, "auto"])
def test_speculative_with_int8_cache_equals_plain_greedy(tiny_qwen35, draft_tokens, allocated):
    from test_speculative import random_prompts

    llm = tiny_qwen35
    prompts = random_prompts(4, llm.args.vocab_size, seed=5)
    llm.kv_dtype = torch.int8
    try:
        plain = llm.generate_ids(prompts, max_tokens=12, temperature=0.0)
        spec = llm.generate_ids(prompts, max_tokens=12, temperature=0.0, speculative="mtp", draft_tokens=draft_tokens)
        stats = llm.last_stats
    finally:
        llm.kv_dtype = None
    assert spec == plain
    assert len(allocated) == 3 and all_int8(allocated)  # plain, then the trunk's and the MTP head's
    assert stats.drafted > stats.accepted  # rejections happened: rollback was exercised


def test_demo_model_greedy_tokens_identical(allocated):
    """The shipped bf16 demo model: 32 greedy tokens per prompt, int8 cache vs bf16 cache,
    plain and speculative (the MTP head's own cache is int8 too)."""
    llm = moerun.load(threads=1)
    prompts = [llm.encode_prompt(p) for p in ("def fib(n):", "import os\n", "class Stack:\n    def __init__(self):",
                                               "The Python tutorial", "# Read a file line by line\n")]
    base = llm.generate_ids(prompts, max_tokens=32, temperature=0.0)
    int8 = moerun.load(threads=1, kv_cache="int8")
    assert int8.kv_dtype == torch.int8
    assert int8.generate_ids(prompts, max_tokens=32, temperature=0.0) == base
    assert all_int8(allocated[1:])
    assert int8.generate_ids(prompts[:2], max_tokens=32, temperature=0.0, speculative="mtp", draft_tokens=2) == base[:2]


def test_server_scheduler_allocates_the_chosen_format(tiny_qwen3):
    from moerun.server.scheduler import Scheduler

    tiny_qwen3.kv_dtype = torch.int8
    try:
        sched = Scheduler(tiny_qwen3, max_concurrency=2, max_len=32)
    finally:
        tiny_qwen3.kv_dtype = None
    try:
        assert all(isinstance(layer, Int8KVCache) for layer in sched.cache.layers)
    finally:
        sched.close()


def test_bad_kv_cache_value():
    with pytest.raises(MoerunError, match="unknown KV cache type 'q4'"):
        moerun.load(kv_cache="q4")


def cli(capsys, *args) -> tuple[int, str, str]:
    from moerun.cli import main

    rc = main([*args, "--threads", "1"])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("command", [["generate", "x", "--max-tokens", "1"], ["chat"], ["info"], ["bench"], ["serve"]])
def test_cli_bad_kv_cache_is_one_line(command, capsys):
    rc, _, err = cli(capsys, *command, "--kv-cache", "int4")
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc != 0 and len(lines) == 1 and "Traceback" not in err
    assert "unknown KV cache type 'int4'" in lines[0]


def test_info_and_bench_report_kv_bytes_per_token(capsys):
    """The demo model's reported bytes per token are the allocated tensors' bytes."""
    info = {}
    for kind in ("auto", "int8"):
        rc, out, err = cli(capsys, "info", "--json", "--kv-cache", kind)
        assert rc == 0, err
        info[kind] = json.loads(out)
    llm = moerun.load(threads=1)
    specs = llm.net.cache_spec()
    for kind, kv_dtype in (("auto", None), ("int8", torch.int8)):
        cache = Cache(specs, 1, 10, llm.dtype, kv_dtype)
        kv_bytes = sum(layer.nbytes() for layer in cache.layers if isinstance(layer, (KVCache, Int8KVCache)))
        assert info[kind]["kv_bytes_per_token"] * 10 == kv_bytes
    assert info["auto"]["kv_cache"] == "bfloat16" and info["int8"]["kv_cache"] == "int8"
    # the bf16 demo model: which code multiplies its prefill's matrices
    want = ("torch" if not kernels.native() else "native kernels at every size" if kernels.torch_bf16_is_slow()
            else "native kernels up to 16 rows")
    assert info["auto"]["bf16_products"].startswith(want)
    rc, out, err = cli(capsys, "bench", "--json", "--kv-cache", "int8", "--prompt-tokens", "8", "--gen-tokens", "2")
    assert rc == 0, err
    bench = json.loads(out)
    assert bench["kv_cache"] == "int8" and bench["kv_bytes_per_token"] == info["int8"]["kv_bytes_per_token"]


def test_cli_passes_the_format_with_the_expert_store(tmp_path):
    from moerun.cli import _load, build_parser

    make_tiny_model(tmp_path)
    a = build_parser().parse_args(["generate", "x", "-m", str(tmp_path), "--ram-budget", "50%", "--kv-cache", "int8"])
    llm = _load(a)
    assert llm.store is not None and llm.kv_dtype == torch.int8


def test_one_token_attention_reads_the_int8_cache_in_place():
    """A decode step over an int8 cache goes to the native kernel, which applies each
    position's scales while reading; it equals attention over the dequantized cache."""
    import torch.nn.functional as F

    from moerun import kernels
    from moerun.layers.attention import attend

    g = torch.Generator().manual_seed(3)
    cache = Cache([KVSpec(2, 16, 16)], 1, 40, torch.float32, torch.int8)
    kv, slots = cache.layers[0], torch.tensor([0])
    q, k, v = (torch.randn(1, h, 31, 16, generator=g) for h in (4, 2, 2))
    attend(q[:, :, :30], k[:, :, :30], v[:, :, :30], kv, slots, torch.tensor([0]), 0.25)
    got = attend(q[:, :, 30:], k[:, :, 30:], v[:, :, 30:], kv, slots, torch.tensor([30]), 0.25)
    kd = dequantize_int8(kv.k[:, :, :31], kv.k_scale[:, :, :31], torch.float32)
    vd = dequantize_int8(kv.v[:, :, :31], kv.v_scale[:, :, :31], torch.float32)
    want = F.scaled_dot_product_attention(q[:, :, 30:], kd, vd, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with kernels.use_isa("torch"):  # the dequantizing path says the same
        kv2 = Cache([KVSpec(2, 16, 16)], 1, 40, torch.float32, torch.int8).layers[0]
        attend(q[:, :, :30], k[:, :, :30], v[:, :, :30], kv2, slots, torch.tensor([0]), 0.25)
        ref = attend(q[:, :, 30:], k[:, :, 30:], v[:, :, 30:], kv2, slots, torch.tensor([30]), 0.25)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
