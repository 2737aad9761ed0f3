"""moerun vs llama.cpp built natively for this CPU, on the same random model, taking turns.

    flock /tmp/moerun-heavy.lock .venv/bin/python benchmarks/vs_llamacpp.py \
        [--model qwen3-30b-a3b] [--layers 8] [--rows int4,int8,default] [--rounds 2] \
        [--threads 2] [--quick] [--keep-gguf] [--json OUT]

llama.cpp is the one its users build: llama-cpp-python 0.3.36's vendored llama.cpp, compiled
with -DGGML_NATIVE=ON by benchmarks/llamacpp.py (`python benchmarks/llamacpp.py build` first;
the benchmark stops with one line saying so when there is no finished build). It is timed by
its own `llama-bench` (JSON output), two invocations a round:

    llama-bench -m M -p 32,512,2048 -n 0   -t 2,1 -r 1 --no-warmup -o json   # prefill
    llama-bench -m M -p 0 -n 128 -d 0,4096 -t 2,1 -r 1 -o json               # decode

(-t 2,1 with --threads 1,2; the default is --threads 2, which keeps a whole run, GGUF files
and Q4_K_M quantization included, near 22 minutes on 2 cores; 1,2 an estimated ~30.)

(pp32 only warms each thread count up and is dropped; llama-bench's own warm-up would run
each prefill twice. tg keeps llama-bench's warm-up, one token; -d 4096 fills the context once
an invocation, untimed, at the first thread count.) moerun is timed in this process the same
way: per thread count a 32-token warm-up prefill, prefills of 512 and 2048 fresh tokens into
fresh caches, then 128 decode steps from an empty cache and 128 from a cache holding 4096
tokens (filled once a round, untimed, at the first thread count; one warm-up step before each,
as llama-bench's). moerun runs as `moerun.load` sets a model up (kernels.split_threads,
the fused attention block, float32 activations, bf16 embedding and KV cache); llama.cpp keeps
its defaults (f16 KV cache, its flash-attention choice, n_batch 2048, n_ubatch 512).

Rows (--rows):
  int4     equal bytes: moerun `int4-all` vs llama.cpp Q4_0 everywhere (what `--pure` makes,
           but for the embedding, bf16 in both): the GGUF is written from moerun's own
           blocks, which are bit for bit Q4_0 blocks
  int8     equal bytes: moerun `int8` vs Q8_0, from moerun's blocks likewise
  default  each engine's default: moerun's default policy (routed experts int4, attention and
           head int8) vs Q4_K_M made by the native `llama-quantize` from a bf16 GGUF of the
           very bf16 weights moerun quantizes
Routers and norms stay float in both; the embedding is read one row a token.

The model (--model) is a seeded random one with the layer shapes of Qwen3-30B-A3B (qwen3moe),
--layers of its 48. A model source (class ModelSource) makes moerun's net and the GGUF for a
row; a qwen35moe (Qwen3.6-35B-A3B) source plugs in as `ExportedSource`, once `moerun
export-gguf` exists, without a GGUF writer here.

Rounds alternate engines: moerun, llama.cpp, moerun, llama.cpp ... Each figure is the median
of the rounds with its range, each ratio (moerun / llama.cpp) the median of the rounds' own
ratios. Per row: weight bytes read per decoded token by each engine (llama.cpp's from the
GGUF's tensor sizes, the routed experts' by top-k/experts, one embedding row; moerun's from
`moerun.engine.info.describe`, what `moerun info` prints); decode tests add the KV cache read
at their depth. Bandwidth share = bytes/token x tok/s over the read bandwidth (`torch.sum`
over 1 GiB at the same thread count, best of 3) measured right before and right after each
engine's turn (mean of the two). After the rounds a short check compares the two engines'
per-position logits on 32 tokens (llama.cpp's through the sdist's ctypes binding on the
native libllama): cosine near 1 for the equal-bytes rows says both read the same weights.

Weights are random: routing is near uniform, outputs meaningless, speed figures real.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp  # noqa: E402  (benchmarks/llamacpp.py)

from moerun import kernels  # noqa: E402
from moerun.bench.random_model import preset_config  # noqa: E402
from moerun.layers.cache import Cache, kv_bytes_per_token  # noqa: E402
from moerun.engine.generate import run_plans  # noqa: E402
from moerun.engine.info import describe  # noqa: E402
from moerun.engine.llm import LLM  # noqa: E402
from moerun.layers.moe import Experts  # noqa: E402
from moerun.models import qwen3_moe  # noqa: E402
from moerun.quant import DEFAULT_POLICY, POLICIES, compute_in_float32, quantize_model  # noqa: E402
from moerun.kernels import formats  # noqa: E402
from moerun.layers.quantized import QuantizedExperts, QuantizedLinear  # noqa: E402

HERE = Path(__file__).resolve().parent
GiB = 1 << 30


@dataclass(frozen=True)
class Row:
    name: str
    policy: str        # moerun's POLICIES name
    llama: str         # what llama.cpp reads, in words
    source: str        # "blocks": GGUF from moerun's blocks; "float": bf16 GGUF + llama-quantize
    ftype: str = ""    # llama-quantize type for "float"


ROWS = {
    "int4": Row("int4", "int4-all", "Q4_0 (--pure)", "blocks"),
    "int8": Row("int8", "int8", "Q8_0", "blocks"),
    "default": Row("default", DEFAULT_POLICY, "Q4_K_M", "float", "Q4_K_M"),
}


# -- model sources ---------------------------------------------------------------------------

class ModelSource:
    """Makes, for a row, moerun's net (set up as moerun.load does) and the GGUF llama.cpp reads."""

    name = "?"
    arch = "?"

    def moerun(self, row: Row):  # -> (LLM, args)
        raise NotImplementedError

    def gguf(self, row: Row, llm, work: Path, keep: bool, threads: int) -> Path:
        raise NotImplementedError


class Qwen3MoeRandom(ModelSource):
    """A seeded random model with Qwen3-30B-A3B's layer shapes, built in memory, already
    quantized (routed experts drawn straight as packed codes for the equal-bytes rows, so the
    float experts, 2.4 GB a layer, never exist; for the default row drawn as bf16 one expert at
    a time, the same draws for the bf16 GGUF and for moerun's quantization)."""

    arch = "qwen3moe"

    def __init__(self, layers: int, seed: int = 0, **overrides):
        self.layers, self.seed = layers, seed
        self.name = f"qwen3-30b-a3b-{layers}L" + ("-small" if overrides else "")
        self.cfg = preset_config("qwen3-30b-a3b", layers=layers, **overrides)

    # the float weights
    def _float_net(self):
        args = qwen3_moe.ModelArgs.from_dict(self.cfg)
        torch.manual_seed(self.seed)
        net = qwen3_moe.Model(args)  # Experts params are torch.empty: untouched pages, no RSS
        g = torch.Generator().manual_seed(self.seed)
        experts = {id(p) for m in net.modules() if isinstance(m, Experts) for p in m.parameters()}
        with torch.no_grad():
            for name, p in net.named_parameters():
                if id(p) in experts:
                    continue
                if p.ndim == 1:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=g)
                p.data = p.data.to(torch.bfloat16)  # a bf16 checkpoint's weights
        return net, args

    def expert_draws(self, layer: int, which: str, args):
        """The bf16 weights of one layer's experts' `which` projection, one expert at a time."""
        E, H, I = args.num_experts, args.hidden_size, args.moe_intermediate_size
        shape = (H, I) if which == "down" else (I, H)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + layer * 4 + ("gate", "up", "down").index(which) + 1)
        for _ in range(E):
            yield (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)

    def _random_packed_experts(self, args, fmt: str, g) -> QuantizedExperts:
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

    def moerun(self, row: Row, gguf_hook=None):
        net, args = self.quantized_net(row, gguf_hook)
        llm = LLM(net, args, "qwen3_moe", None, Path(self.name), torch.float32, {})  # moerun.load's set-up
        llm.kv_dtype = torch.bfloat16  # a bf16 checkpoint's KV cache
        return llm, args

    def quantized_net(self, row: Row, gguf_hook=None):
        """The net as moerun.load(quant=row.policy) leaves a bf16 checkpoint: quantized by the
        policy, the other floats float32, the embedding bf16 rows widened to float32."""
        net, args = self._float_net()
        policy = POLICIES[row.policy]
        g = torch.Generator().manual_seed(self.seed + 1)
        if row.source == "float" and gguf_hook is not None:
            gguf_hook(net, args)  # writes the bf16 GGUF while the float weights are all there
        for i, layer in enumerate(net.model.layers):
            if row.source == "float":
                m = QuantizedExperts(args.num_experts, args.hidden_size, args.moe_intermediate_size, policy.experts)
                with torch.no_grad():
                    for which in ("gate", "up", "down"):
                        q, s = getattr(m, f"{which}_q"), getattr(m, f"{which}_scales")
                        for e, w in enumerate(self.expert_draws(i, which, args)):
                            q[e], s[e] = formats.quantize(w, policy.experts)
            else:
                m = self._random_packed_experts(args, policy.experts, g)
            layer.mlp.experts = m
        quantize_model(net, policy)
        compute_in_float32(net)
        return net.eval(), args

    def gguf(self, row: Row, llm, work: Path, keep: bool, threads: int) -> Path:
        path = work / f"{self.name}-s{self.seed}-{row.name}.gguf"
        if keep and path.is_file():
            return path
        t0 = time.perf_counter()
        if row.source == "blocks":
            write_qwen3moe_gguf(self._entries_blocks(llm.net), llm.args, path)
        else:
            raise AssertionError("the default row's GGUF is made by gguf_float during moerun()")
        os.sync()  # the writeback of gigabytes of dirty pages must not run under a timing
        log(f"[{row.name}] wrote {path.name} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s")
        return path

    def gguf_float(self, row: Row, net, args, work: Path, threads: int) -> Path:
        """bf16 GGUF of the float weights, then `llama-quantize` to row.ftype; the bf16 file is deleted."""
        out = work / f"{self.name}-s{self.seed}-{row.name}.gguf"
        bf16 = work / f"{self.name}-s{self.seed}-bf16.gguf"
        t0 = time.perf_counter()
        write_qwen3moe_gguf(self._entries_float(net, args), args, bf16)
        os.sync()
        log(f"[{row.name}] wrote {bf16.name} ({bf16.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s")
        t0 = time.perf_counter()
        r = subprocess.run([str(llamacpp.tool("llama-quantize")), str(bf16), str(out), row.ftype, str(threads)],
                           capture_output=True, text=True)
        bf16.unlink()
        if r.returncode != 0:
            raise SystemExit(f"llama-quantize failed: {r.stderr.strip().splitlines()[-1:]}")
        os.sync()
        log(f"[{row.name}] llama-quantize {row.ftype}: {out.name} ({out.stat().st_size / 1e9:.2f} GB) in "
            f"{time.perf_counter() - t0:.0f} s")
        return out

    # GGUF tensor entries: (name, producer of a numpy array, its shape, numpy dtype, ggml type)
    def _entries_blocks(self, net) -> list:
        import gguf

        Q = gguf.GGMLQuantizationType
        qtype = {"int4": Q.Q4_0, "int8": Q.Q8_0}
        per = {"int4": formats.GROUP // 2, "int8": formats.GROUP}
        entries = []

        def quant(name, mod: QuantizedLinear):
            nb = formats.blocks(mod.in_features)
            entries.append((name, lambda: ggml_blocks(mod.qweight, mod.scales, mod.fmt),
                            (mod.out_features, nb * (2 + per[mod.fmt])), np.uint8, qtype[mod.fmt]))

        def experts(name, ex: QuantizedExperts, which: str):
            q, s = getattr(ex, f"{which}_q"), getattr(ex, f"{which}_scales")
            entries.append((name, lambda: ggml_blocks(q, s, ex.fmt), (*s.shape[:-1], s.shape[-1] * (2 + per[ex.fmt])),
                            np.uint8, qtype[ex.fmt]))

        def f32(name, t):
            entries.append((name, lambda: t.detach().float().contiguous().numpy(), tuple(t.shape), np.float32, None))

        m = net.model
        # the embedding as moerun holds it, bf16 (a row a token: no matter to speed; --pure
        # would make it Q4_0/Q8_0, and the logits check would then see that rounding)
        emb = m.embed_tokens.weight.detach()
        entries.append(("token_embd.weight", lambda: emb.to(torch.bfloat16).contiguous().view(torch.uint8).numpy(),
                        (emb.shape[0], 2 * emb.shape[1]), np.uint8, Q.BF16))
        for i, layer in enumerate(m.layers):
            a, mlp = layer.self_attn, layer.mlp
            f32(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight)
            quant(f"blk.{i}.attn_q.weight", a.q_proj)
            quant(f"blk.{i}.attn_k.weight", a.k_proj)
            quant(f"blk.{i}.attn_v.weight", a.v_proj)
            quant(f"blk.{i}.attn_output.weight", a.o_proj)
            f32(f"blk.{i}.attn_q_norm.weight", a.q_norm.weight)
            f32(f"blk.{i}.attn_k_norm.weight", a.k_norm.weight)
            f32(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight)
            f32(f"blk.{i}.ffn_gate_inp.weight", mlp.gate.weight)
            experts(f"blk.{i}.ffn_gate_exps.weight", mlp.experts, "gate")
            experts(f"blk.{i}.ffn_up_exps.weight", mlp.experts, "up")
            experts(f"blk.{i}.ffn_down_exps.weight", mlp.experts, "down")
        f32("output_norm.weight", m.norm.weight)
        quant("output.weight", net.lm_head)
        return entries

    def _entries_float(self, net, args) -> list:
        import gguf

        BF16 = gguf.GGMLQuantizationType.BF16
        entries = []

        def bf16(name, t):  # bytes of the bf16 values: [..., 2 * K] uint8
            entries.append((name, lambda: t.detach().to(torch.bfloat16).contiguous().view(torch.uint8).numpy(),
                            (*t.shape[:-1], 2 * t.shape[-1]), np.uint8, BF16))

        def f32(name, t):
            entries.append((name, lambda: t.detach().float().contiguous().numpy(), tuple(t.shape), np.float32, None))

        def experts(name, layer, which):
            E, H, I = args.num_experts, args.hidden_size, args.moe_intermediate_size
            shape = (E, H, I) if which == "down" else (E, I, H)

            def make():
                arr = np.empty((*shape[:-1], 2 * shape[-1]), dtype=np.uint8)
                for e, w in enumerate(self.expert_draws(layer, which, args)):
                    arr[e] = w.view(torch.uint8).numpy()
                return arr
            entries.append((name, make, (*shape[:-1], 2 * shape[-1]), np.uint8, BF16))

        m = net.model
        bf16("token_embd.weight", m.embed_tokens.weight)
        for i, layer in enumerate(m.layers):
            a, mlp = layer.self_attn, layer.mlp
            f32(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight)
            for n, mod in (("attn_q", a.q_proj), ("attn_k", a.k_proj), ("attn_v", a.v_proj), ("attn_output", a.o_proj)):
                bf16(f"blk.{i}.{n}.weight", mod.weight)
            f32(f"blk.{i}.attn_q_norm.weight", a.q_norm.weight)
            f32(f"blk.{i}.attn_k_norm.weight", a.k_norm.weight)
            f32(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight)
            f32(f"blk.{i}.ffn_gate_inp.weight", mlp.gate.weight)
            for which in ("gate", "up", "down"):
                experts(f"blk.{i}.ffn_{which}_exps.weight", i, which)
        f32("output_norm.weight", m.norm.weight)
        bf16("output.weight", net.lm_head.weight)
        return entries


class ExportedSource(ModelSource):
    """Where a qwen35moe (Qwen3.6-35B-A3B-shaped) comparison plugs in: a random checkpoint
    (moerun.bench.random_model.write_random_model with the `qwen3.6-35b-a3b` preset), loaded by
    moerun.load(quant=row.policy), and its GGUF from `moerun export-gguf` (written by another
    change; this benchmark writes no qwen35moe GGUF itself). The default row would then be
    `export-gguf` bf16 + llama-quantize, as for qwen3moe. Decode at a depth rewinds the cache
    by its lengths, which a model with recurrent (DeltaNet) state cannot: its states would be
    saved and restored (moerun.layers.cache.RecurrentState) before that row is timed."""

    arch = "qwen35moe"

    def __init__(self, layers: int, seed: int = 0):
        self.layers, self.seed = layers, seed
        self.name = f"qwen3.6-35b-a3b-{layers}L"

    def moerun(self, row: Row):
        raise SystemExit("the qwen3.6-35b-a3b model source needs `moerun export-gguf` (not on this branch yet)")


MODELS = {"qwen3-30b-a3b": Qwen3MoeRandom, "qwen3.6-35b-a3b": ExportedSource}


def build_model(layers: int, row: str, seed: int = 0, **overrides):
    """(net, args): the random Qwen3-30B-A3B-shaped net quantized by POLICIES[row], routed
    experts drawn packed (benchmarks/step_profile.py and stack_ab.py build theirs with it)."""
    return Qwen3MoeRandom(layers, seed, **overrides).quantized_net(Row(row, row, "", "blocks"))


def ggml_blocks(qweight: torch.Tensor, scales: torch.Tensor, fmt: str) -> np.ndarray:
    """moerun blocks -> llama.cpp Q4_0 / Q8_0 blocks: [..., N, nb * (2 + bytes)] uint8."""
    q = formats.natural_blocks(qweight, fmt).view(torch.uint8)
    d = scales.contiguous().view(torch.uint8).reshape(*scales.shape, 2)
    return torch.cat([d, q], dim=-1).reshape(*scales.shape[:-1], -1).numpy()


def write_qwen3moe_gguf(entries: list, args, path: Path) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_context_length(8192)
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
    kinds = {e[4].name for e in entries if e[4] is not None}
    F = gguf.LlamaFileType
    w.add_file_type(F.MOSTLY_Q4_0 if "Q4_0" in kinds else F.MOSTLY_Q8_0 if "Q8_0" in kinds else F.MOSTLY_BF16)
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
    w.add_add_bos_token(False)
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
        del arr
    w.close()


# -- bytes read per decoded token ------------------------------------------------------------

def gguf_bytes_per_token(path: Path, n_used: int, n_experts: int) -> dict:
    """Weight bytes llama.cpp reads per decoded token, from the GGUF's tensor types and sizes:
    every tensor whole, except the routed experts (top-k of n_experts) and the embedding (a row)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    by, types = {}, {}
    for t in r.tensors:
        nb = int(t.n_bytes)
        if "_exps." in t.name:
            comp, nb = "routed experts", nb * n_used / n_experts
        elif t.name.startswith("token_embd"):
            comp, nb = "embedding", nb / int(t.shape[-1])  # shape is ggml's [cols, rows]
        elif t.name.startswith("output."):
            comp = "head"
        elif ".attn_" in t.name and ".attn_norm." not in t.name:  # q/k norms too, as moerun counts them
            comp = "attention"
        elif "ffn_gate_inp" in t.name:
            comp = "router"
        else:
            comp = "norms"
        by[comp] = by.get(comp, 0) + nb
        tn = t.tensor_type.name
        types[tn] = types.get(tn, 0) + 1
    del r
    return {"bytes_per_token": int(sum(by.values())), "by_component": {k: int(v) for k, v in by.items()},
            "tensor_types": types, "file_bytes": path.stat().st_size}


# -- machine ---------------------------------------------------------------------------------

def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def read_bandwidth(threads: int, tries: int = 3) -> float:
    """Bytes/s of torch.sum over 1 GiB (float32) on `threads` threads; best of `tries`."""
    was = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = torch.ones(GiB // 4)
    x.sum()
    best = float("inf")
    for _ in range(tries):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    del x
    torch.set_num_threads(was)
    return GiB / best


def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    f = dict(re.findall(r"^([^:\n]+):\s*(.*)$", lscpu, re.M))
    try:
        commit = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(HERE), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True).stdout.strip())
    except OSError:
        commit, dirty = "", False
    mem = 0
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * 1024
    return {
        "cpu": f.get("Model name", llamacpp.cpu_model()), "cpus": os.cpu_count(),
        "l3": f.get("L3 cache", ""), "l2": f.get("L2 cache", ""), "hypervisor": f.get("Hypervisor vendor", ""),
        "mem_total": mem, "kernel": platform.release(), "python": platform.python_version(),
        "torch": torch.__version__, "moerun_commit": commit + ("+dirty" if dirty else ""),
        "moerun_kernels": kernels.describe(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def rss_now() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    return 0


# -- the two engines -------------------------------------------------------------------------

@dataclass
class Plan:
    threads: list[int]       # descending: the first one fills the depth
    prompts: list[int]
    gen: int
    depths: list[int]
    warm: int = 32


def test_key(kind: str, n: int, depth: int, threads: int) -> str:
    return f"{kind}{n}@d{depth}/t{threads}" if kind == "tg" else f"{kind}{n}/t{threads}"


def run_llamacpp(gguf: Path, plan: Plan) -> tuple[dict, dict]:
    """One llama.cpp turn: the two llama-bench invocations. {test: tok/s}, facts."""
    bench = str(llamacpp.tool("llama-bench"))
    ts = ",".join(map(str, plan.threads))
    cmds = [
        [bench, "-m", str(gguf), "-p", ",".join(map(str, [plan.warm, *plan.prompts])), "-n", "0", "-t", ts,
         "-r", "1", "--no-warmup", "-o", "json"],
        [bench, "-m", str(gguf), "-p", "0", "-n", str(plan.gen), "-d", ",".join(map(str, plan.depths)), "-t", ts,
         "-r", "1", "-o", "json"],
    ]
    out, facts = {}, {"commands": [shlex.join(c) for c in cmds], "peak_rss": 0}
    timer = shutil.which("time") or "/usr/bin/time"
    for cmd in cmds:
        with tempfile.TemporaryDirectory() as tmp:
            # peak RSS through /usr/bin/time: a child forked from this process would report
            # this process's own RSS (at the fork) as its peak
            rss_file = Path(tmp) / "rss"
            wrapped = [timer, "-f", "%M", "-o", str(rss_file), *cmd] if os.access(timer, os.X_OK) else cmd
            r = subprocess.run(wrapped, capture_output=True, text=True)
            timed = rss_file.read_text() if rss_file.is_file() else ""
        try:
            facts["peak_rss"] = max(facts["peak_rss"], int(timed.split()[-1]) * 1024)
        except (ValueError, IndexError):
            pass
        if r.returncode != 0:
            m = re.search(r"terminated by signal (\d+)", timed)  # time's word on a signal death
            raise SystemExit(f"error: {llamacpp_failure(-int(m.group(1)) if m else r.returncode, cmd, r.stderr)}")
        stdout = r.stdout
        for t in json.loads(stdout):
            if t["n_prompt"] == plan.warm and t["n_gen"] == 0:
                continue
            kind, n = ("pp", t["n_prompt"]) if t["n_gen"] == 0 else ("tg", t["n_gen"])
            out[test_key(kind, n, t.get("n_depth", 0), t["n_threads"])] = float(t["avg_ts"])
            for k in ("build_commit", "cpu_info", "model_type", "model_size", "type_k", "type_v", "flash_attn",
                      "n_batch", "n_ubatch", "use_mmap", "poll"):
                if k in t:
                    facts[k] = t[k]
    return out, facts


def llamacpp_failure(rc: int, cmd: list[str], stderr: str) -> str:
    """One line on a failed llama.cpp tool run: its last words, or the signal it died of."""
    import signal

    tool = Path(cmd[0]).name
    if rc >= 0:
        last = (stderr.strip().splitlines() or [f"exit status {rc}"])[-1]
        return f"{tool} failed (exit status {rc}): {last}"
    name = signal.Signals(-rc).name
    hint = ""
    if name == "SIGILL":
        hint = ("; GGML_NATIVE builds for every extension the CPU reports, and some paths die like this on "
                "some CPUs (AMX on some Xeons, ggml-org/llama.cpp#26954): rebuild without it, e.g. with "
                "-DGGML_NATIVE=OFF and the GGML_AVX512* / GGML_AVX2 flags the CPU has")
    return f"{tool} died with {name} running {shlex.join(cmd[1:3])}{hint}"


class MoerunRunner:
    """moerun timed in-process the way llama-bench times llama.cpp (see the module doc)."""

    def __init__(self, llm, plan: Plan, seed: int = 0):
        self.llm, self.net, self.plan = llm, llm.net, plan
        self.vocab = llm.args.vocab_size
        self.g = torch.Generator().manual_seed(seed)
        self.spec = self.net.cache_spec()
        self.dtype, self.kv = llm.dtype, llm.kv_dtype
        self.cache0 = Cache(self.spec, 1, plan.gen + 2, self.dtype, self.kv)
        self.deep = {d: Cache(self.spec, 1, d + plan.gen + 2, self.dtype, self.kv) for d in plan.depths if d}
        self.set_threads(plan.threads[0])
        self.prefill(plan.warm)  # first calls allocate and pick kernels
        self.decode(self.cache0, 0, 4)

    def set_threads(self, t: int) -> None:
        torch.set_num_threads(t)  # what moerun.load(threads=t) then LLM() do
        kernels.split_threads(self.net, t)

    def ids(self, n: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (1, n), generator=self.g)

    def prefill(self, n: int) -> float:
        cache = Cache(self.spec, 1, n + 1, self.dtype, self.kv)
        ids, plans = self.ids(n), run_plans(self.net)
        with torch.inference_mode():
            t0 = time.perf_counter()
            self.net(ids, cache, last_only=True, **plans)
            return time.perf_counter() - t0

    def fill(self, cache: Cache, depth: int, chunk: int = 512) -> None:
        cache.reset(0)
        plans = run_plans(self.net)
        with torch.inference_mode():
            for s in range(0, depth, chunk):
                self.net(self.ids(min(chunk, depth - s)), cache, last_only=True, **plans)

    def decode(self, cache: Cache, depth: int, n: int) -> float:
        toks = self.ids(n + 1)[0].tolist()
        plans = run_plans(self.net)
        with torch.inference_mode():
            cache.lengths[0] = depth
            self.net(torch.tensor([[toks[-1]]]), cache, last_only=True, **plans)  # warm-up step (llama-bench's)
            cache.lengths[0] = depth
            t0 = time.perf_counter()
            for i in range(n):
                self.net(torch.tensor([[toks[i]]]), cache, last_only=True, **plans)
            return time.perf_counter() - t0

    def turn(self) -> dict:
        p, out = self.plan, {}
        for i, t in enumerate(p.threads):
            self.set_threads(t)
            self.prefill(p.warm)
            for n in p.prompts:
                out[test_key("pp", n, 0, t)] = n / self.prefill(n)
            for d in p.depths:
                cache = self.cache0 if d == 0 else self.deep[d]
                if d and i == 0:
                    self.fill(cache, d)
                out[test_key("tg", p.gen, d, t)] = p.gen / self.decode(cache, d, p.gen)
        return out


def logits_check(llm, gguf: Path, n: int, threads: int, seed: int = 7) -> dict:
    """Per-position logits of both engines on the same n token ids."""
    ids = torch.randint(0, llm.args.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    cache = Cache(llm.net.cache_spec(), 1, n + 1, llm.dtype, llm.kv_dtype)
    with torch.inference_mode():
        ours = llm.net(torch.tensor([ids]), cache, **run_plans(llm.net))[0].float()
    theirs = torch.from_numpy(llamacpp.logits(gguf, ids, threads=threads))
    cos = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
    top1 = (ours.argmax(-1) == theirs.argmax(-1)).float().mean()
    return {"positions": n, "cosine_median": float(cos.median()), "cosine_min": float(cos.min()),
            "top1_agreement": float(top1)}


# -- the benchmark ---------------------------------------------------------------------------

def med_range(xs: list[float]) -> dict:
    return {"median": float(np.median(xs)), "min": float(min(xs)), "max": float(max(xs)), "n": len(xs)}


def run_row(src: ModelSource, row: Row, plan: Plan, a, work: Path) -> dict:
    t0 = time.perf_counter()
    gguf_path = None
    if row.source == "float":
        target = work / f"{src.name}-s{src.seed}-{row.name}.gguf"
        made = {}

        def hook(net, args):
            made["path"] = target if (a.keep_gguf and target.is_file()) else src.gguf_float(row, net, args, work, max(plan.threads))
        llm, args = src.moerun(row, gguf_hook=hook)
        gguf_path = made["path"]
    else:
        llm, args = src.moerun(row)
    gc.collect()
    info = describe(llm.net, args)
    log(f"[{row.name}] moerun {row.policy} built in {time.perf_counter() - t0:.0f} s; "
        f"{info['bytes_per_token'] / 1e6:.0f} MB read per decoded token; RSS {rss_now() / GiB:.2f} GiB")
    if gguf_path is None:
        gguf_path = src.gguf(row, llm, work, a.keep_gguf, max(plan.threads))
    k, E = args.num_experts_per_tok, args.num_experts
    lbytes = gguf_bytes_per_token(gguf_path, k, E)
    kv_tok = kv_bytes_per_token(llm.net.cache_spec(), llm.kv_dtype)  # llama.cpp's f16 cache: the same size
    log(f"[{row.name}] llama.cpp {row.llama}: {lbytes['bytes_per_token'] / 1e6:.0f} MB per decoded token; "
        f"tensor types {lbytes['tensor_types']}")

    rss0 = rss_now()
    runner = MoerunRunner(llm, plan)
    res = {"row": row.name, "moerun_policy": row.policy, "llamacpp_weights": row.llama, "gguf": str(gguf_path),
           "bytes_per_token": {"moerun": info["bytes_per_token"], "llamacpp": lbytes["bytes_per_token"]},
           "bytes_per_token_by_component": {"moerun": info["bytes_per_token_by_component"],
                                            "llamacpp": lbytes["by_component"]},
           "llamacpp_tensor_types": lbytes["tensor_types"], "gguf_bytes": lbytes["file_bytes"],
           "kv_bytes_per_token": kv_tok, "rounds": []}
    facts = {}
    for r in range(a.rounds):
        rnd = {}
        for eng in ("moerun", "llamacpp"):
            bw0 = {t: read_bandwidth(t) for t in plan.threads}
            ts = time.perf_counter()
            if eng == "moerun":
                tok = runner.turn()
            else:
                tok, facts = run_llamacpp(gguf_path, plan)
            took = time.perf_counter() - ts
            bw1 = {t: read_bandwidth(t) for t in plan.threads}
            bw = {t: (bw0[t] + bw1[t]) / 2 for t in plan.threads}
            share = {}
            for key, v in tok.items():
                if key.startswith("tg"):
                    d, t = map(int, re.match(r"tg\d+@d(\d+)/t(\d+)", key).groups())
                    b = res["bytes_per_token"][eng] + (d + plan.gen / 2) * kv_tok
                    share[key] = v * b / bw[t]
            rnd[eng] = {"tok_s": tok, "bandwidth_share": share, "bandwidth_before": bw0, "bandwidth_after": bw1,
                        "seconds": took}
            log(f"[{row.name}] round {r + 1} {eng} ({took:.0f} s): " + ", ".join(f"{k} {v:.1f}" for k, v in tok.items())
                + "; bandwidth GB/s " + ", ".join(f"t{t} {bw0[t] / 1e9:.1f}/{bw1[t] / 1e9:.1f}" for t in plan.threads))
        res["rounds"].append(rnd)
    res["moerun_peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    res["moerun_rss_before_runs"] = rss0
    res["moerun_rss_after_runs"] = rss_now()
    res["llamacpp_peak_rss"] = facts.get("peak_rss", 0)
    res["llamacpp"] = {k: v for k, v in facts.items() if k != "peak_rss"}
    tests = list(res["rounds"][0]["moerun"]["tok_s"])
    res["tests"] = {}
    for key in tests:
        m = [rd["moerun"]["tok_s"][key] for rd in res["rounds"]]
        lc = [rd["llamacpp"]["tok_s"].get(key, float("nan")) for rd in res["rounds"]]
        entry = {"moerun": med_range(m), "llamacpp": med_range(lc), "ratio": med_range([x / y for x, y in zip(m, lc)])}
        if key.startswith("tg"):
            for eng in ("moerun", "llamacpp"):
                entry[f"{eng}_share"] = med_range([rd[eng]["bandwidth_share"][key] for rd in res["rounds"]])
        res["tests"][key] = entry
    if a.logits:
        try:
            res["logits"] = logits_check(llm, gguf_path, a.logits, max(plan.threads))
            log(f"[{row.name}] logits, {a.logits} positions: {res['logits']}")
        except Exception as e:  # a check, not a figure: say why and go on
            res["logits"] = {"error": f"{type(e).__name__}: {e}"}
            log(f"[{row.name}] logits check failed: {res['logits']['error']}")
    del runner, llm
    gc.collect()
    if not a.keep_gguf:
        gguf_path.unlink(missing_ok=True)
    return res


def fmt_mr(d: dict, f: str = "{:.1f}", unit: str = "", k: float = 1) -> str:
    """median (min-max), the unit after the median."""
    if d["n"] == 1:
        return f.format(k * d["median"]) + unit
    return f.format(k * d["median"]) + unit + f" ({f.format(k * d['min'])}-{f.format(k * d['max'])})"


def table(out: dict) -> str:
    m = out["machine"]
    bws = [bw for r in out["rows"] for rd in r["rounds"] for e in ("moerun", "llamacpp")
           for bw in (*rd[e]["bandwidth_before"].values(), *rd[e]["bandwidth_after"].values())]
    lines = [
        f"{out['model']} ({out['arch']}), {out['plan']['layers']} layers; {m['cpu']}, {m['cpus']} CPUs, L3 {m['l3']}; "
        f"read bandwidth (torch.sum over 1 GiB) {min(bws) / 1e9:.1f}-{max(bws) / 1e9:.1f} GB/s over the run; "
        f"moerun {m['moerun_commit']}, llama.cpp {out['llamacpp_build'].get('version')} "
        f"(vendored commit {out['llamacpp_build'].get('llama_cpp_commit', '?')[:10]}, GGML_NATIVE); {m['date']}; "
        f"medians of {out['plan']['rounds']} alternating rounds (range in brackets); ratio = moerun / llama.cpp, "
        f"median of the rounds' ratios; share = bytes/token x tok/s / read bandwidth",
        "",
        "| row | moerun | llama.cpp | test | moerun tok/s | llama.cpp tok/s | ratio | moerun share | llama.cpp share |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["rows"]:
        for key, e in r["tests"].items():
            share = (fmt_mr(e["moerun_share"], "{:.0f}", "%", 100), fmt_mr(e["llamacpp_share"], "{:.0f}", "%", 100)) \
                if "moerun_share" in e else ("", "")
            lines.append(f"| {r['row']} | {r['moerun_policy']} | {r['llamacpp_weights']} | {key} | {fmt_mr(e['moerun'])} | "
                         f"{fmt_mr(e['llamacpp'])} | {fmt_mr(e['ratio'], '{:.2f}', 'x')} | {share[0]} | {share[1]} |")
    lines += ["", "| row | moerun MB/token | llama.cpp MB/token | GGUF GB | llama.cpp tensor types | KV KB/token | "
              "moerun RSS GiB (whole process) | llama-bench peak RSS GiB | logits cosine (median, min; top-1) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        lg = r.get("logits", {})
        lgs = (f"{lg['cosine_median']:.4f}, {lg['cosine_min']:.4f}; {100 * lg['top1_agreement']:.0f}%"
               if "cosine_median" in lg else lg.get("error", "")[:60])
        lines.append(f"| {r['row']} | {r['bytes_per_token']['moerun'] / 1e6:.0f} | {r['bytes_per_token']['llamacpp'] / 1e6:.0f} | "
                     f"{r['gguf_bytes'] / 1e9:.2f} | {', '.join(f'{k} {v}' for k, v in r['llamacpp_tensor_types'].items())} | "
                     f"{r['kv_bytes_per_token'] / 1024:.0f} | {r['moerun_rss_after_runs'] / GiB:.1f} | "
                     f"{r['llamacpp_peak_rss'] / GiB:.1f} | {lgs} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rows", default="int4,int8,default", help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (moerun, llama.cpp) per row")
    p.add_argument("--threads", default="2",
                   help="thread counts, comma-separated (1,2: the full matrix, an estimated ~30 minutes here, where the default "
                        "takes ~22 with the GGUF files to make)")
    p.add_argument("--prompts", default="512,2048", help="prefill lengths (llama-bench -p)")
    p.add_argument("--gen", type=int, default=128, help="decode steps (llama-bench -n)")
    p.add_argument("--depths", default="0,4096", help="context before the decode steps (llama-bench -d)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: prefill 128, decode 16 at depths 0 and 256, 1 round, unless given")
    p.add_argument("--logits", type=int, default=32, help="positions of the logits check (0: none)")
    p.add_argument("--workdir", default="/var/tmp/moerun-vs-llamacpp")
    p.add_argument("--keep-gguf", action="store_true", help="keep the GGUF files in --workdir and reuse them")
    p.add_argument("--llamacpp-dir", help="llama.cpp build cache (default: $MOERUN_LLAMACPP_DIR or "
                                          f"{llamacpp.default_dir()})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="write every figure to OUT")
    p.add_argument("--table", metavar="JSON", help="print the tables of an earlier run's --json file and stop")
    given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--")}
    a = p.parse_args(argv)
    if a.table:
        print(table(json.loads(Path(a.table).read_text())))
        return 0
    if a.quick:
        if "--prompts" not in given:
            a.prompts = "128"
        if "--gen" not in given:
            a.gen = 16
        if "--depths" not in given:
            a.depths = "0,256"
        if "--rounds" not in given:
            a.rounds = 1
    if a.llamacpp_dir:
        os.environ["MOERUN_LLAMACPP_DIR"] = a.llamacpp_dir
    try:
        build = llamacpp.require_built()
    except llamacpp.BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rows = [ROWS[r] for r in a.rows.split(",")]
    plan = Plan(threads=sorted({int(t) for t in a.threads.split(",")}, reverse=True),
                prompts=[int(x) for x in a.prompts.split(",")], gen=a.gen,
                depths=sorted({int(x) for x in a.depths.split(",")}))
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(work).free
    if free < 16e9:
        log(f"warning: {free / 1e9:.0f} GB free in {work}; the default row's bf16 GGUF alone takes ~{1.4 * a.layers:.0f} GB")
    src = MODELS[a.model](a.layers, a.seed)
    out = {"command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
           "model": src.name, "arch": src.arch, "machine": machine(), "llamacpp_build": build,
           "plan": {"layers": a.layers, "rounds": a.rounds, "threads": plan.threads, "prompts": plan.prompts,
                    "gen": plan.gen, "depths": plan.depths, "warm": plan.warm}, "rows": []}
    log(f"{out['machine']['cpu']}, L3 {out['machine']['l3']}; {out['machine']['moerun_kernels']}; "
        f"llama.cpp from {build['lib_dir']}")
    t0 = time.perf_counter()
    for row in rows:
        out["rows"].append(run_row(src, row, plan, a, work))
        if a.json:  # after each row: a long run killed halfway keeps what it measured
            Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    out["seconds"] = time.perf_counter() - t0
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    print(table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
