"""The benchmark scripts' own bad-input paths: one clear line, not a traceback or a dead process."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # a dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


def test_llamacpp_failure_names_a_crash_and_a_failure():
    bench = _load("vs_llamacpp")
    cmd = ["/x/llama-bench", "-m", "/w/m.gguf", "-p", "512"]
    # a tool that dies on an illegal instruction, as llama.cpp's AMX path does on some Xeons
    msg = bench.llamacpp_failure(-4, cmd, "")
    assert "llama-bench died with SIGILL" in msg and "m.gguf" in msg and "-DGGML_NATIVE=OFF" in msg
    assert "\n" not in msg
    msg = bench.llamacpp_failure(1, cmd, "loading\nerror: failed to load model\n")
    assert msg == "llama-bench failed (exit status 1): error: failed to load model"


def test_gemm_benchmark_refuses_an_unknown_kernel_path():
    r = subprocess.run([sys.executable, str(BENCH / "gemm.py"), "--isas", "avx9000", "--shapes", "1x8x32",
                        "--formats", "int8", "--rounds", "1"], capture_output=True, text=True, cwd=BENCH)
    assert r.returncode == 1
    assert r.stdout.strip().splitlines() == [r.stdout.strip()]  # one line
    assert r.stdout.startswith("error: kernel path 'avx9000' is not available here") and "Traceback" not in r.stderr


def test_gemm_benchmark_sum_column():
    """--sum-column: one more header cell and, per shape, torch.sum's GB/s over the same bytes
    (a positive number) after the product's figures."""
    r = subprocess.run([sys.executable, str(BENCH / "gemm.py"), "--shapes", "1x64x256,1x32x512", "--formats",
                        "q6_k", "--rounds", "1", "--sum-column"], capture_output=True, text=True, cwd=BENCH)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("|")]
    assert lines[0].endswith("| torch.sum GB/s, same bytes |")
    rows = [ln.strip("|").split("|") for ln in lines[2:]]
    assert [c[1].strip() for c in rows] == ["1x64x256", "1x32x512"]
    for c in rows:
        assert len(c) == 5 and float(c[4]) > 0


def test_native_ab_times_a_models_own_calls(tmp_path):
    """--model against this very build: every fused op of the demo model's passes listed, and
    both builds' logits the same; a checkpoint that is not there is one line and exit 1."""
    from moerun import kernels

    nat = kernels._native()
    if nat is None:
        pytest.skip("the native extension is not built")
    cmd = [sys.executable, str(BENCH / "native_ab.py"), "--other", nat.__file__, "--rounds", "1"]
    r = subprocess.run(cmd + ["--model", "--tokens", "1,2", "--dtype", "bfloat16"], capture_output=True, text=True,
                       cwd=BENCH)
    assert r.returncode == 0, r.stderr
    for T in (1, 2):
        assert f"T={T} deltanet_block (6 calls a pass)" in r.stdout and f"T={T} moe_block (8 calls a pass)" in r.stdout
        assert any(line.startswith(f"T={T} whole pass") and line.endswith("same logits") for line in r.stdout.splitlines())
    r = subprocess.run(cmd + ["--model", str(tmp_path / "nothing")], capture_output=True, text=True, cwd=BENCH)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("script", ["speculative", "sampled_decode"])
def test_decode_benchmarks_name_a_missing_model_in_one_line(script, tmp_path):
    r = subprocess.run([sys.executable, str(BENCH / f"{script}.py"), "-m", str(tmp_path / "none")],
                       capture_output=True, text=True, cwd=BENCH)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"error: model path {tmp_path / 'none'} does not exist"


def test_speculative_oracle_runs_and_refuses_bad_input(tmp_path, capsys):
    """The oracle benchmark on a tiny Qwen3.5 checkpoint with an MTP head: its table, with the
    acceptance marked simulated (it checks the output against plain decoding itself); a
    checkpoint that is not there, and an acceptance outside [0, 1], one line each and exit
    non-zero."""
    from test_speculative import build_qwen

    bench = _load("speculative_oracle")
    path = build_qwen(tmp_path / "q", vocab_size=300)
    assert bench.main(["-m", str(path), "--quant", "none", "--threads", "1", "--gen-tokens", "12", "--rounds", "1",
                       "--drafts", "1,2", "--acceptance", "0.9"]) == 0
    out = capsys.readouterr().out
    assert "SIMULATED acceptance 0.9" in out and "mtp_1" in out and "mtp_2" in out
    r = subprocess.run([sys.executable, str(BENCH / "speculative_oracle.py"), "-m", str(tmp_path / "nothing")],
                       capture_output=True, text=True, cwd=BENCH)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run([sys.executable, str(BENCH / "speculative_oracle.py"), "-m", str(path), "--acceptance", "2"],
                       capture_output=True, text=True, cwd=BENCH)
    assert r.returncode == 2 and "--acceptance must be between 0 and 1" in r.stderr and "Traceback" not in r.stderr


def test_vs_llamacpp_small_model_bytes_and_moerun_turn(tmp_path):
    # the equal-bytes rows hand llama.cpp moerun's own blocks: the GGUF's bytes per decoded
    # token (its tensor sizes, experts by top-k) match moerun's (`moerun info`'s) part by part
    bench = _load("vs_llamacpp")
    small = dict(vocab_size=512, hidden_size=256, moe_intermediate_size=64, num_experts=16, intermediate_size=512,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    src = bench.Qwen3MoeRandom(2, **small)
    for name in ("int4", "int8"):
        row = bench.ROWS[name]
        llm, args = src.moerun(row)
        path = src.gguf(row, llm, tmp_path, False, 1)
        ours = bench.describe(llm.net, args)["bytes_per_token_by_component"]
        theirs = bench.gguf_bytes_per_token(path, args.num_experts_per_tok, args.num_experts)
        for comp in ("routed experts", "attention", "head", "router"):
            assert ours[comp] == theirs["by_component"][comp], (name, comp)
        assert set(theirs["tensor_types"]) == {"F32", "BF16", {"int4": "Q4_0", "int8": "Q8_0"}[name]}
    plan = bench.Plan(threads=[2, 1], prompts=[16], gen=3, depths=[0, 8], warm=4)
    tok = bench.MoerunRunner(llm, plan).turn()
    assert set(tok) == {"pp16/t2", "tg3@d0/t2", "tg3@d8/t2", "pp16/t1", "tg3@d0/t1", "tg3@d8/t1"}
    assert all(v > 0 for v in tok.values())


# a qwen35moe model small enough to write and run here: 3 Gated DeltaNet layers, 1 gated attention
# layer, an MTP layer; hidden 256 so that a Q6_K head (rows of 256) fits
SMALL_Q36 = dict(model_type="qwen3_5_moe_text", vocab_size=512, hidden_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_key_head_dim=32,
                 linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                 moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=8,
                 num_experts_per_tok=2, mtp_num_hidden_layers=1,
                 layer_types=["linear_attention"] * 3 + ["full_attention"])


def test_vs_llamacpp_qwen35moe_bytes_requantize_and_depth(tmp_path):
    # the Qwen3.6 rows run one GGUF file in both engines: the file's bytes per decoded token
    # (by tensor type, MTP block left out) match moerun's component by component
    from moerun.loaders.gguf_write import write_random

    bench = _load("vs_llamacpp")
    path = tmp_path / "q8.gguf"
    write_random(path, SMALL_Q36, "q8_0", progress=False)
    llm, args = bench.load_gguf(path)
    ours = bench.describe(llm.net, args)["bytes_per_token_by_component"]
    theirs = bench.gguf_bytes_per_token(path, args.num_experts_per_tok, args.num_experts)
    for comp in ("routed experts", "shared expert", "deltanet", "attention", "head", "router"):
        assert ours[comp] == theirs["by_component"][comp], comp
    assert "mtp" not in theirs["by_component"] and theirs["tensor_types"]["Q8_0"] > 0
    # with the MTP block counted the totals would differ: it is skipped, not absent
    assert any(t.name.startswith("blk.4.") for t in __import__("gguf").GGUFReader(str(path)).tensors)

    # the default row: the Q8_0 weights requantized to the default policy's formats (4 layers + MTP: 5 experts)
    from moerun.kernels import formats

    def weights(net):  # float32 values of a few quantized tensors
        head, ex = net.lm_head, net.model.layers[0].mlp.experts
        dn = net.model.layers[0].linear_attn.out_proj
        return {"head": formats.dequantize(head.qweight, head.scales, head.fmt, head.in_features),
                "experts down": formats.dequantize(ex.down_q, ex.down_scales, ex.down_fmt, ex.intermediate_size),
                "deltanet out": formats.dequantize(dn.qweight, dn.scales, dn.fmt, dn.in_features)}

    before = weights(llm.net)
    counts = bench.requantize(llm.net, bench.DEFAULT_POLICY)
    fmts = {type(m).__name__ + ":" + m.formats for n, m in llm.net.named_modules() if hasattr(m, "fmt")
            and not n.startswith("mtp")}
    assert counts["experts"] == 5 and counts["lm_head"] == 1 and counts["attention"] > 0
    assert "QuantizedLinear:q6_k" in fmts and "QuantizedExperts:int4" in fmts and "QuantizedLinear:int8" in fmts
    assert llm.net.lm_head.fmt == "q6_k" and llm.net.model.layers[0].mlp.experts.fmt == "int4"
    after = weights(llm.net)
    for k in before:  # the same weights, rounded anew
        cos = torch.nn.functional.cosine_similarity(before[k].flatten(), after[k].flatten(), dim=0)
        assert 0.99 < cos < 1.0, k
    assert torch.isfinite(llm.forward(torch.arange(12)[None])).all()

    # decode at a depth: the DeltaNet states are restored, not just the lengths rewound
    plan = bench.Plan(threads=[1], prompts=[8], gen=3, depths=[0, 6], warm=4)
    runner = bench.MoerunRunner(llm, plan)
    cache = runner.deep[6]
    runner.fill(cache, 6)
    states = [{n: t.clone() for n, t in layer.tensors.items()} for layer in cache.layers
              if isinstance(layer, bench.RecurrentState)]
    assert len(states) == 3 and any(t.abs().sum() > 0 for st in states for t in st.values())
    runner.decode(cache, 6, 3)  # moves the states on
    moved = [layer for layer in cache.layers if isinstance(layer, bench.RecurrentState)]
    assert not all(torch.equal(layer.tensors[n], states[i][n]) for i, layer in enumerate(moved) for n in states[i])
    runner.rewind(cache, 6)
    assert int(cache.lengths[0]) == 6
    assert all(torch.equal(layer.tensors[n], states[i][n]) for i, layer in enumerate(moved) for n in states[i])
    runner.rewind(cache, 0)
    assert all(not layer.tensors[n].any() for layer in moved for n in layer.tensors)
    tok = runner.turn()
    assert set(tok) == {"pp8/t1", "tg3@d0/t1", "tg3@d6/t1"} and all(v > 0 for v in tok.values())


def test_vs_llamacpp_refuses_bad_selections_in_one_line():
    for argv, msg in ((["--model", "qwen9"], "error: --model 'qwen9': not one of"),
                      (["--rows", "int4,int3"], "error: --rows 'int3': not one of"),
                      (["--model", "qwen3-30b-a3b,qwen3.6-35b-a3b", "--layers", "8,4,2"], "error: --layers '8,4,2'"),
                      (["--threads", "0"], "error: --threads '0': each at least 1"),
                      (["--same-file", "int8=/no/such.gguf"], "error: --same-file 'int8=/no/such.gguf': /no/such.gguf")):
        r = subprocess.run([sys.executable, str(BENCH / "vs_llamacpp.py"), *argv], capture_output=True, text=True,
                           cwd=BENCH)
        assert r.returncode == 2, argv
        assert r.stderr.startswith(msg) and len(r.stderr.strip().splitlines()) == 1, (argv, r.stderr)


def test_same_file_benchmark_names_a_missing_file_in_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(BENCH / "same_file.py"), str(tmp_path / "none.gguf")],
                       capture_output=True, text=True, cwd=BENCH)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"error: {tmp_path / 'none.gguf'}: no such file"]


def test_decode_profile_refuses_a_missing_file_and_bad_threads_in_one_line(tmp_path):
    missing = subprocess.run([sys.executable, str(BENCH / "decode_profile.py"), "-m", str(tmp_path / "none.gguf")],
                             capture_output=True, text=True, cwd=BENCH)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [f"error: {tmp_path / 'none.gguf'}: no such file"]
    f = tmp_path / "x.gguf"
    f.write_bytes(b"")
    bad = subprocess.run([sys.executable, str(BENCH / "decode_profile.py"), "-m", str(f), "--threads", "two"],
                         capture_output=True, text=True, cwd=BENCH)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == ["error: --threads 'two': comma-separated integers"]


def test_gpu_check_runs_with_the_cpu_standing_in(tmp_path):
    """benchmarks/gpu_check.sh, as the device tool runs it, here with the link emulated: the
    store's text equals the resident text, and the bench's accounting comes back."""
    env = {**os.environ, "OUT": str(tmp_path), "PY": sys.executable}
    r = subprocess.run(["bash", str(BENCH / "gpu_check.sh")], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "link is EMULATED" in r.stdout and "PASS: same greedy text" in r.stdout
    assert (tmp_path / "resident.txt").read_text() == (tmp_path / "device.txt").read_text() != ""
    b = json.loads((tmp_path / "bench_device.json").read_text())
    assert b["gen_tokens"] == 64 and b["decode_path"]["native_stack_passes"] == 64 and b["link_waits"] > 0


def test_same_file_runs_both_engines_with_the_same_warm_up_and_reps(monkeypatch, tmp_path):
    """The commands same_file.py runs: moerun bench with --warmup full (a pass of the prompt's
    size, llama-bench's warm-up) and --reps R, llama-bench with -r R and its own warm-up."""
    bench = _load("same_file")
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        if "bench" in cmd and "--json" in cmd:  # moerun
            out = json.dumps({"prefill_tok_s": 10.0, "decode_tok_s": 2.0, "decode_path": {"why": None}})
        else:
            n_gen = 0 if cmd[cmd.index("-n") + 1] == "0" else 7
            out = json.dumps([{"n_gen": n_gen, "avg_ts": 3.0}])
        return subprocess.CompletedProcess(cmd, 0, out + "\n", "")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    assert bench.run_moerun(tmp_path / "m.gguf", 2, 16, 7, reps=3) == {"pp": 10.0, "tg": 2.0, "why": None}
    cmd = calls[-1]
    assert cmd[cmd.index("--reps") + 1] == "3" and cmd[cmd.index("--warmup") + 1] == "full"
    assert cmd[cmd.index("--prompt-tokens") + 1] == "16" and cmd[cmd.index("--gen-tokens") + 1] == "7"
    bench.run_moerun(tmp_path / "m.gguf", 2, 16, 7, warmup="short")
    assert calls[-1][calls[-1].index("--warmup") + 1] == "short"
    calls.clear()
    monkeypatch.setattr(sys, "path", [str(BENCH), *sys.path])
    llamacpp = pytest.importorskip("llamacpp")
    monkeypatch.setattr(llamacpp, "tool", lambda name: Path("/x") / name)
    assert bench.run_llama(tmp_path / "m.gguf", 2, 16, 7, reps=3) == {"pp": 3.0, "tg": 3.0}
    assert len(calls) == 2 and all(c[c.index("-r") + 1] == "3" for c in calls)
    assert all("--no-warmup" not in c for c in calls)  # llama-bench's own warm-up: a pass of -p's size


def test_same_file_refuses_zero_reps_in_one_line(tmp_path):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"GGUF")
    r = subprocess.run([sys.executable, str(BENCH / "same_file.py"), str(f), "--reps", "0"],
                       capture_output=True, text=True, cwd=BENCH)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == ["error: --reps and --rounds must be at least 1"]


def test_first_prompt_benchmark_refuses_bad_input_in_one_line(tmp_path):
    missing = subprocess.run([sys.executable, str(BENCH / "first_prompt.py"), "-m", str(tmp_path / "none.gguf")],
                             capture_output=True, text=True, cwd=BENCH)
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines() == [f"error: {tmp_path / 'none.gguf'}: no such file"]
    f = tmp_path / "x.gguf"
    f.write_bytes(b"GGUF")
    bad = subprocess.run([sys.executable, str(BENCH / "first_prompt.py"), "-m", str(f), "--prompt", "0"],
                         capture_output=True, text=True, cwd=BENCH)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines() == ["error: --prompt, --rounds and --threads must be at least 1"]
