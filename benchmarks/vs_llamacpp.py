"""moerun vs llama.cpp on the same quantized weights, same threads, one after the other.

    .venv/bin/python benchmarks/vs_llamacpp.py [--layers 8] [--prompt-tokens 512] \
        [--gen-tokens 128] [--threads 2] [--rows int4,int8] [--rounds 3]

A random model with Qwen3-30B-A3B layer shapes (hidden 2048, 128 experts, top-8, expert width
768, 32/4 heads of 128, vocab 151936) is built in memory, already quantized by moerun's
policy (row int4: routed experts int4, attention and LM head int8; row int8: all int8).
The GGUF file for llama.cpp is written from those very blocks: moerun's int4 and int8 blocks
are bit-for-bit llama.cpp's Q4_0 and Q8_0 blocks (fp16 scale + the same packed values, once
moerun's interleaved groups are put back in block order), so both engines read identical
weights; router, norms stay fp32 in both, the embedding is Q8_0 for llama.cpp and fp32 for
moerun (one row per token: no effect on speed). Both keep 16-bit keys and values (llama.cpp
f16, moerun bf16).

Prints prefill tok/s (one prompt of --prompt-tokens), decode tok/s (--gen-tokens steps with
a KV cache), the ratio, and the decode roofline: bytes read per decoded token / memory read
bandwidth (`torch.sum` over 1 GiB, measured right before and right after each engine's run:
each run's share of its roofline uses the mean of the two, and the table shows the median
of the rounds' shares with their range; the roofline row the median bandwidth). A sanity line
compares the two engines' last-token logits after the prompt (same weights -> nearly the
same logits). Both engines stay loaded and take turns for
--rounds rounds; the table shows medians, and each ratio is the median of the rounds' own
ratios (measured side by side, so drifting machine bandwidth cancels) with its range.

Needs `gguf` and `llama-cpp-python` (pip install gguf llama-cpp-python; the latter compiles
llama.cpp for this CPU). llama.cpp first runs a few tokens in a child process: where it dies
there (its AMX path does on some Xeons), the benchmark stops with one line saying how to
build it without that path. Weights are random: routing is near uniform, outputs meaningless.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

from moerun import kernels
from moerun.bench.random_model import preset_config
from moerun.engine.cache import Cache
from moerun.engine.generate import run_plans
from moerun.layers.moe import Experts
from moerun.models import qwen3_moe
from moerun.quant import POLICIES, quantize_model
from moerun.quant import formats
from moerun.quant.modules import QuantizedExperts, QuantizedLinear


def build_model(layers: int, row: str, seed: int = 0, **overrides):
    """Random Qwen3-30B-A3B-shaped model, quantized by policy `row`, without ever holding
    the float experts (they would need 19 GB for 8 layers)."""
    cfg = preset_config("qwen3-30b-a3b", layers=layers, **overrides)
    args = qwen3_moe.ModelArgs.from_dict(cfg)
    torch.manual_seed(seed)
    net = qwen3_moe.Model(args)  # Experts params are torch.empty: untouched pages, no RSS
    policy = POLICIES[row]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, mod in list(net.named_modules()):
            if isinstance(mod, Experts):
                parent, _, child = name.rpartition(".")
                setattr(net.get_submodule(parent), child, random_experts(args, policy.experts, g))
        for name, p in net.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    quantize_model(net, policy)
    return net.eval(), args


def random_experts(args, fmt: str, g) -> QuantizedExperts:
    """Random codes and N(0, 0.02)-like scales straight in the packed format."""
    E, H, I = args.num_experts, args.hidden_size, args.moe_intermediate_size
    m = QuantizedExperts(E, H, I, fmt)
    for name in ("gate", "up", "down"):
        q, s = getattr(m, f"{name}_q"), getattr(m, f"{name}_scales")
        if fmt == "int4":
            q.copy_(torch.randint(0, 256, q.shape, dtype=torch.uint8, generator=g))
            s.copy_((0.02 * 2.5 / 8) * (1 + 0.1 * torch.randn(s.shape, generator=g)))
        else:
            q.copy_(torch.randint(-127, 128, q.shape, dtype=torch.int8, generator=g))
            s.copy_((0.02 * 2.5 / 127) * (1 + 0.1 * torch.randn(s.shape, generator=g)))
    return m


# -- GGUF ----------------------------------------------------------------------------------

def ggml_blocks(qweight: torch.Tensor, scales: torch.Tensor, fmt: str) -> np.ndarray:
    """moerun blocks -> llama.cpp Q4_0 / Q8_0 blocks: [..., N, nb * (2 + bytes)] uint8."""
    q = formats.natural_blocks(qweight, fmt).view(torch.uint8)
    d = scales.contiguous().view(torch.uint8).reshape(*scales.shape, 2)
    return torch.cat([d, q], dim=-1).reshape(*scales.shape[:-1], -1).numpy()


def write_gguf(net, args, path: Path) -> None:
    import gguf

    Q = gguf.GGMLQuantizationType
    qtype = {"int4": Q.Q4_0, "int8": Q.Q8_0}
    entries = []  # (name, producer of a numpy array, its shape, dtype, raw type)

    def add_quant(name, mod: QuantizedLinear):
        nb = formats.blocks(mod.in_features)
        per = formats.GROUP // 2 if mod.fmt == "int4" else formats.GROUP
        shape = (mod.out_features, nb * (2 + per))
        entries.append((name, lambda: ggml_blocks(mod.qweight, mod.scales, mod.fmt), shape, np.uint8, qtype[mod.fmt]))

    def add_experts(name, ex: QuantizedExperts, which: str):
        q, s = getattr(ex, f"{which}_q"), getattr(ex, f"{which}_scales")
        per = formats.GROUP // 2 if ex.fmt == "int4" else formats.GROUP
        shape = (*s.shape[:-1], s.shape[-1] * (2 + per))
        entries.append((name, lambda: ggml_blocks(q, s, ex.fmt), shape, np.uint8, qtype[ex.fmt]))

    def add_f32(name, t):
        entries.append((name, lambda: t.detach().float().contiguous().numpy(), tuple(t.shape), np.float32, None))

    m = net.model
    emb_q, emb_s = formats.quantize_int8(m.embed_tokens.weight.detach())
    entries.append(("token_embd.weight", lambda: ggml_blocks(emb_q, emb_s, "int8"),
                    (emb_q.shape[0], emb_s.shape[1] * 34), np.uint8, Q.Q8_0))
    for i, layer in enumerate(m.layers):
        a, mlp = layer.self_attn, layer.mlp
        add_f32(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight)
        add_quant(f"blk.{i}.attn_q.weight", a.q_proj)
        add_quant(f"blk.{i}.attn_k.weight", a.k_proj)
        add_quant(f"blk.{i}.attn_v.weight", a.v_proj)
        add_quant(f"blk.{i}.attn_output.weight", a.o_proj)
        add_f32(f"blk.{i}.attn_q_norm.weight", a.q_norm.weight)
        add_f32(f"blk.{i}.attn_k_norm.weight", a.k_norm.weight)
        add_f32(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight)
        add_f32(f"blk.{i}.ffn_gate_inp.weight", mlp.gate.weight)
        add_experts(f"blk.{i}.ffn_gate_exps.weight", mlp.experts, "gate")
        add_experts(f"blk.{i}.ffn_up_exps.weight", mlp.experts, "up")
        add_experts(f"blk.{i}.ffn_down_exps.weight", mlp.experts, "down")
    add_f32("output_norm.weight", m.norm.weight)
    add_quant("output.weight", net.lm_head)

    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_context_length(4096)
    w.add_embedding_length(args.hidden_size)
    w.add_block_count(args.num_hidden_layers)
    w.add_feed_forward_length(args.intermediate_size)
    w.add_expert_feed_forward_length(args.moe_intermediate_size)
    w.add_head_count(args.num_attention_heads)
    w.add_head_count_kv(args.num_key_value_heads)
    w.add_key_length(args.head_dim)
    w.add_value_length(args.head_dim)
    w.add_rope_freq_base(float(args.rope.get("rope_theta", 1e6)) if args.rope else 1e6)
    w.add_layer_norm_rms_eps(args.rms_norm_eps)
    w.add_expert_count(args.num_experts)
    w.add_expert_used_count(args.num_experts_per_tok)
    # a SentencePiece-style vocabulary of placeholder pieces: only token ids are fed
    V = args.vocab_size
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    tokens += [f"<t{i}>" for i in range(len(tokens), V)]
    types += [1] * (V - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * V)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    for name, _, shape, dt, raw in entries:
        nbytes = int(np.prod(shape)) * np.dtype(dt).itemsize
        w.add_tensor_info(name, shape, np.dtype(dt), nbytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, make, shape, dt, raw in entries:
        arr = make()
        assert arr.shape == tuple(shape), (name, arr.shape, shape)
        w.write_tensor_data(arr)
    w.close()


# -- measurements --------------------------------------------------------------------------

def read_bandwidth(threads: int, mib: int = 1024) -> float:
    """Bytes/s of a parallel read (sum) over a buffer much larger than the caches; best of 5."""
    torch.set_num_threads(threads)
    x = torch.ones(mib << 18)  # float32: mib MiB
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.nbytes / best


def decode_bytes(net, args) -> int:
    """Weight bytes one decoded token reads: active experts, attention, routers, norms, LM head."""
    total = 0
    K, E = args.num_experts_per_tok, args.num_experts
    for name, mod in net.named_modules():
        if isinstance(mod, QuantizedExperts):
            total += sum(b.nbytes for b in mod.buffers()) * K // E
        elif isinstance(mod, (QuantizedLinear, torch.nn.Linear)):
            total += sum(b.nbytes for b in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)])
    return total


class CpuClock:
    """Wall time, process CPU time and context switches over a block."""

    def __enter__(self):
        self.t = time.perf_counter()
        r = resource.getrusage(resource.RUSAGE_SELF)
        self.cpu, self.ivcsw = r.ru_utime + r.ru_stime, r.ru_nivcsw
        return self

    def __exit__(self, *exc):
        r = resource.getrusage(resource.RUSAGE_SELF)
        self.wall = time.perf_counter() - self.t
        self.cpu_s = r.ru_utime + r.ru_stime - self.cpu
        self.invol = r.ru_nivcsw - self.ivcsw


def pool_interplay(threads: int, steps: int = 300) -> dict:
    """Do torch's pool and ours fight? Time a torch op alone, a native op alone, and the two
    alternating as in a decode step (attention in torch, then experts in our kernels). If
    either pool's threads kept spinning while the other works, the alternating loop would
    cost more than the sum of its parts."""
    torch.set_num_threads(threads)
    a, b = torch.randn(1, 2048), torch.randn(4096, 2048)
    q, s = formats.quantize(torch.randn(4096, 2048) * 0.02, "int8")

    def torch_op():
        torch.nn.functional.linear(a, b)

    def native_op():
        kernels.qlinear(a, q, s, "int8", 2048)

    def both():
        torch_op()
        native_op()

    out = {}
    for name, f in (("torch", torch_op), ("native", native_op), ("alternating", both)):
        f()
        best = float("inf")
        for _ in range(3):
            with CpuClock() as c:
                for _ in range(steps):
                    f()
            best = min(best, c.wall)
        out[f"{name}_us"] = best / steps * 1e6
    out["alternating_overhead"] = out["alternating_us"] / (out["torch_us"] + out["native_us"]) - 1
    return out


def run_moerun(net, args, prompt: list[int], gen: int, threads: int, split: bool = True) -> dict:
    torch.set_num_threads(threads)
    kernels.set_threads(None)
    if split:  # what moerun.load does: torch's small decode ops on one thread (kernels.split_threads)
        kernels.split_threads(net, threads)
        kernels.fuse_decode_attention(net)  # ... and each attention block's decode step one native call
    # 16-bit keys and values, like llama.cpp's default f16 cache (and moerun's default for a
    # bf16 checkpoint: the checkpoint's dtype); the weights compute in float32
    cache = Cache(net.cache_spec(), 1, len(prompt) + gen + 1, torch.bfloat16)
    ids = torch.tensor([prompt])
    plans = run_plans(net)  # as moerun's decode loop runs its passes (their checks made once a run)
    with torch.inference_mode():
        with CpuClock() as pre:
            logits = net(ids, cache, last_only=True, **plans)
        tok = torch.tensor([[prompt[0]]])
        with CpuClock() as dec:
            for i in range(gen):
                net(tok, cache, last_only=True, **plans)
                tok = torch.tensor([[prompt[(i + 1) % len(prompt)]]])
    return dict(prefill_tok_s=len(prompt) / pre.wall, decode_tok_s=gen / dec.wall,
                decode_cpu_per_wall=dec.cpu_s / dec.wall, decode_invol_csw_per_tok=dec.invol / gen,
                logits=logits[0, -1].float())


def load_llamacpp(path: Path, prompt: list[int], gen: int, threads: int):
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=len(prompt) + gen + 16, n_batch=len(prompt), n_ubatch=min(512, len(prompt)),
                n_threads=threads, n_threads_batch=threads, verbose=False)
    llm.eval(prompt[:8])  # warm-up: first-touch of the mmap'ed weights of the layers
    return llm


PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=64, n_batch=32, n_threads=int(sys.argv[2]), verbose=False)
llm.eval(list(range(300, 332)))
llm.eval([300])
"""


def probe_llamacpp(path: Path, threads: int) -> str | None:
    """Runs llama.cpp on a few tokens in a child process first: where one of its code paths
    dies on this CPU (a signal), this says so in one line instead of taking the benchmark down."""
    import signal
    import subprocess

    r = subprocess.run([sys.executable, "-c", PROBE, str(path), str(threads)], capture_output=True, text=True)
    if r.returncode >= 0:
        last = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        return None if r.returncode == 0 else f"llama.cpp failed on a probe run: {last}"
    name = signal.Signals(-r.returncode).name
    hint = ""
    if name == "SIGILL":
        hint = ("; its AMX path dies like this on some Xeons (ggml-org/llama.cpp#26954): reinstall it without AMX, "
                "e.g. CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON "
                "-DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON\" "
                "pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python")
    return f"llama.cpp died with {name} on a probe run of {path.name}{hint}"


def run_llamacpp(llm, prompt: list[int], gen: int) -> dict:
    llm.reset()
    with CpuClock() as pre:
        llm.eval(prompt)
    # only the last token of a batch has logits (Llama.scores is left empty without logits_all)
    logits = torch.tensor(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy())
    with CpuClock() as dec:
        for i in range(gen):
            llm.eval([prompt[i % len(prompt)]])
    return dict(prefill_tok_s=len(prompt) / pre.wall, decode_tok_s=gen / dec.wall,
                decode_cpu_per_wall=dec.cpu_s / dec.wall, decode_invol_csw_per_tok=dec.invol / gen, logits=logits)


def median_run(runs: list[dict]) -> dict:
    """Per figure, the median over rounds (logits from the first)."""
    out = {k: float(np.median([r[k] for r in runs])) for k in runs[0] if k != "logits"}
    return {**out, "logits": runs[0]["logits"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--rows", default="int4,int8", help="policies to compare: int4 (vs Q4_0), int8 (vs Q8_0)")
    p.add_argument("--workdir", default="/tmp/moerun-vs-llamacpp")
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument("--keep-gguf", action="store_true",
                   help="keep the GGUF files in --workdir and reuse them next time (the model is seeded)")
    p.add_argument("--gguf-only", action="store_true", help="write the GGUF files and stop")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of (moerun, llama.cpp), alternating; figures are medians, ratios the median of "
                        "each round's ratio (a shared machine's bandwidth drifts by a third between minutes)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-split-threads", action="store_true",
                   help="let torch use --threads in decode too (moerun's behaviour before split_threads)")
    a = p.parse_args(argv)

    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(1)
    results = []
    bw = read_bandwidth(a.threads)
    print(f"kernels: {kernels.describe()}; threads {a.threads}; read bandwidth {bw / 1e9:.1f} GB/s", file=sys.stderr)
    pools = pool_interplay(a.threads)
    print(f"pools: {pools}", file=sys.stderr)
    for row in a.rows.split(","):
        t0 = time.perf_counter()
        net, args = build_model(a.layers, row)
        prompt = torch.randint(300, args.vocab_size, (a.prompt_tokens,), generator=g).tolist()
        nbytes = decode_bytes(net, args)
        print(f"[{row}] built in {time.perf_counter() - t0:.0f} s; {nbytes / 1e6:.0f} MB read per decoded token", file=sys.stderr)
        res = dict(row=row, llama_type={"int4": "Q4_0 experts + Q8_0", "int8": "Q8_0"}[row],
                   layers=a.layers, threads=a.threads, prompt_tokens=a.prompt_tokens, gen_tokens=a.gen_tokens,
                   bytes_per_token=nbytes)
        # the GGUF file first, then synced: the kernel's writeback of gigabytes of dirty pages
        # must not run under either engine's timing
        llm = gguf_path = None
        if not a.skip_llamacpp:
            gguf_path = work / f"random-{a.layers}L-{row}.gguf"
            if not (a.keep_gguf and gguf_path.is_file()):
                t0 = time.perf_counter()
                write_gguf(net, args, gguf_path)
                print(f"[{row}] wrote {gguf_path} ({gguf_path.stat().st_size / 1e9:.2f} GB) in "
                      f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
                os.sync()
            if a.gguf_only:
                continue
            failure = probe_llamacpp(gguf_path, a.threads)
            if failure:
                print(f"error: {failure}", file=sys.stderr)
                return 1
            llm = load_llamacpp(gguf_path, prompt, a.gen_tokens, a.threads)
        ours_runs, lc_runs, bws = [], [], []
        fractions = {"moerun": [], "llamacpp": []}  # per round: decode tok/s over that run's own roofline
        for r in range(a.rounds):
            # the bandwidth drifts by a fifth within a minute here: measured right before and
            # right after each engine's run, and each run's roofline from the mean of the two
            bws.append(read_bandwidth(a.threads))
            ours_runs.append(run_moerun(net, args, prompt, a.gen_tokens, a.threads, split=not a.no_split_threads))
            bws.append(read_bandwidth(a.threads))
            fractions["moerun"].append(ours_runs[-1]["decode_tok_s"] * nbytes / ((bws[-2] + bws[-1]) / 2))
            print(f"[{row}] round {r + 1} read bandwidth {bws[-2] / 1e9:.1f} / {bws[-1] / 1e9:.1f} GB/s before / after; "
                  f"moerun: " + ", ".join(f"{k} {v:.2f}" for k, v in ours_runs[-1].items() if k != "logits")
                  + f", {100 * fractions['moerun'][-1]:.0f}% of roofline", file=sys.stderr)
            if llm is not None:
                lc_runs.append(run_llamacpp(llm, prompt, a.gen_tokens))
                bws.append(read_bandwidth(a.threads))
                fractions["llamacpp"].append(lc_runs[-1]["decode_tok_s"] * nbytes / ((bws[-2] + bws[-1]) / 2))
                print(f"[{row}] round {r + 1} llama.cpp: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in lc_runs[-1].items() if k != "logits")
                    + f", {100 * fractions['llamacpp'][-1]:.0f}% of roofline (bandwidth after: {bws[-1] / 1e9:.1f} GB/s)",
                    file=sys.stderr)
        ours = median_run(ours_runs)
        res["read_bw"] = float(np.median(bws))
        res["roofline_tok_s"] = res["read_bw"] / nbytes
        for eng, f in fractions.items():
            if f:
                res[f"{eng}_of_roofline"] = float(np.median(f))
                res[f"{eng}_of_roofline_range"] = (min(f), max(f))
        res["moerun"] = {k: v for k, v in ours.items() if k != "logits"}
        if llm is not None:
            del llm
            gc.collect()
            if not a.keep_gguf:
                gguf_path.unlink()
            lc = median_run(lc_runs)
            res["llamacpp"] = {k: v for k, v in lc.items() if k != "logits"}
            x, y = ours["logits"], lc["logits"]
            res["logits_cosine"] = float(torch.nn.functional.cosine_similarity(x, y, dim=0))
            for fig in ("prefill", "decode"):
                ratios = [o[f"{fig}_tok_s"] / t[f"{fig}_tok_s"] for o, t in zip(ours_runs, lc_runs)]
                res[f"{fig}_ratio"] = float(np.median(ratios))
                res[f"{fig}_ratio_range"] = (min(ratios), max(ratios))
        res["decode_of_roofline"] = res["moerun_of_roofline"]
        results.append(res)
        del net
        gc.collect()

    if a.json:
        print(json.dumps({"pools": pools, "rows": results}, indent=1))
        return 0
    per_row = ", ".join(f"{r['read_bw'] / 1e9:.1f}" for r in results)
    print(f"\n{a.layers} layers, Qwen3-30B-A3B shapes, {a.threads} threads, prompt {a.prompt_tokens}, "
          f"decode {a.gen_tokens}, read bandwidth {bw / 1e9:.1f} GB/s at the start, {per_row} around the runs "
          f"(per row, median; the roofline row's), kernels {kernels.isa()}; medians of "
          f"{a.rounds} alternating rounds (ratios: median of the rounds' ratios, range in brackets; % of roofline: "
          f"per run, against the mean of the bandwidths measured right before and after it)")
    print("| weights | engine | prefill tok/s | decode tok/s | decode % of roofline |")
    print("|---|---|---|---|---|")
    for r in results:
        for eng in ("llamacpp", "moerun"):
            if eng in r:
                e = r[eng]
                f0, f1 = r[f"{eng}_of_roofline_range"]
                print(f"| {r['row'] if eng == 'moerun' else r['llama_type']} | {eng} | {e['prefill_tok_s']:.1f} | "
                      f"{e['decode_tok_s']:.2f} | {100 * r[f'{eng}_of_roofline']:.0f}% ({100 * f0:.0f}-{100 * f1:.0f}) |")
        if "decode_ratio" in r:
            (p0, p1), (d0, d1) = r["prefill_ratio_range"], r["decode_ratio_range"]
            print(f"| {r['row']} | moerun / llama.cpp | {r['prefill_ratio']:.2f}x ({p0:.2f}-{p1:.2f}) | "
                  f"{r['decode_ratio']:.2f}x ({d0:.2f}-{d1:.2f}) | logits cosine {r['logits_cosine']:.4f} |")
        print(f"| {r['row']} | roofline | | {r['roofline_tok_s']:.2f} | {r['bytes_per_token'] / 1e6:.0f} MB/token |")
    print(f"\nthread pools, one decode-sized torch linear then one native int8 linear, {a.threads} threads: "
          f"torch {pools['torch_us']:.0f} us, native {pools['native_us']:.0f} us, alternating "
          f"{pools['alternating_us']:.0f} us ({100 * pools['alternating_overhead']:+.0f}% vs the sum)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
