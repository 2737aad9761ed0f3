"""moerun vs llama.cpp built natively for this CPU, on the same random models, taking turns.

    .venv/bin/python benchmarks/vs_llamacpp.py --lock /tmp/moerun-heavy.lock [--lock-scope turn|round|row] \
        [--model qwen3-30b-a3b,qwen3.6-35b-a3b] [--layers 8,4] [--rows int4,int8,default] \
        [--rounds 2] [--threads 2,1] [--prompts 512,2048] [--depths 0,4096] [--gen 128] \
        [--quick] [--keep-gguf] [--q36-dir DIR] [--same-file ROW=FILE] [--json OUT]
    .venv/bin/python benchmarks/vs_llamacpp.py --table RUN.json [RUN2.json ...]

llama.cpp is the one its users build: llama-cpp-python 0.3.36's vendored llama.cpp, compiled
with -DGGML_NATIVE=ON by benchmarks/llamacpp.py (`python benchmarks/llamacpp.py build` first;
the benchmark stops with one line saying so when there is no finished build). It is timed by
its own `llama-bench` (JSON output), two invocations a round:

    llama-bench -m M -p 32,512,2048 -n 0   -t 2,1 -r 1 --no-warmup -o json   # prefill
    llama-bench -m M -p 0 -n 128 -d 0,4096 -t 2,1 -r 1 -o json               # decode

(-t 2,1 with --threads 1,2; the default is --threads 2.) pp32 only warms each thread count up
and is dropped; llama-bench's own warm-up would run each prefill twice. tg keeps llama-bench's
warm-up, one token; -d 4096 fills the context before the timed tokens, untimed. So neither
engine's warm-up is a pass of the timed prompt's size here (same_file.py and `moerun bench` take
llama-bench's default, which is), in both it is the same 32-token pass. (llama.cpp maps the
file with MAP_POPULATE at load, moerun does not: paging the file in at load did not make
moerun's first 512-token pass faster, docs/benchmarks.md 2026-12-03.) moerun is
timed in this process the same way: per thread count a 32-token warm-up prefill, prefills of
512 and 2048 fresh tokens into fresh caches, then 128 decode steps from an empty cache and
128 from a cache holding 4096 tokens (filled once a round, untimed, at the first thread count;
one warm-up step before each, as llama-bench's; before each, the KV cache is rewound by its
length and recurrent DeltaNet states are restored from the copy saved after the fill).
moerun runs as `moerun.load` sets a model up (kernels.split_threads, the fused attention block,
float32 activations; the qwen3moe source's KV cache bf16 as a bf16 checkpoint's, the
qwen35moe source's as moerun.load gives a GGUF file: float32); llama.cpp keeps its defaults
(f16 KV cache, its flash-attention choice, n_batch 2048, n_ubatch 512).

On a shared machine, --lock FILE takes the lock for each heavy step (building a net,
writing a GGUF), each engine's turn (with the read-bandwidth readings around it; with
--lock-scope round, each round: both engines' turns; with row, a row's set-up and rounds),
and lets go between them: other jobs run between turns, never during one.

Models (--model, comma-separated, run one after the other) and rows (--rows):

qwen3-30b-a3b (qwen3moe; `Qwen3MoeRandom`), --layers of its 48 (default 8): a seeded random
model built in memory; moerun runs its own quantized form of the weights, llama.cpp a GGUF
written from them:
  int4     equal bytes: moerun `int4-all` vs llama.cpp Q4_0 everywhere (what `--pure` makes,
           but for the embedding, bf16 in both): the GGUF is written from moerun's own
           blocks, which are bit for bit Q4_0 blocks
  int8     equal bytes: moerun `int8` vs Q8_0, from moerun's blocks likewise
  default  each engine's default: moerun's default policy (DEFAULT_POLICY) vs Q4_K_M made by
           the native `llama-quantize` from a bf16 GGUF of the very bf16 weights moerun
           quantizes
Routers and norms stay float in both; the embedding is read one row a token.

qwen3.6-35b-a3b (qwen35moe; `Qwen36Gguf`), --layers of its 40 (default 4: 3 Gated DeltaNet,
1 gated attention): random GGUF files (`moerun random-model qwen3.6-35b-a3b --quant q8_0`
and llama-quantize's requantizations of it, reused from --q36-dir when there):
  int4     equal bytes: the same Q4_0 file (`llama-quantize --pure` of the Q8_0 file) in
           both engines (moerun runs it as its int4)
  int8     equal bytes: the same Q8_0 file in both (moerun's int8)
  default  moerun's default policy applied to the Q8_0 file's weights (requantized in
           memory) vs llama.cpp's Q4_K_M of the same Q8_0 file (`llama-quantize
           --allow-requantize`)
The MTP layer the files hold is read by neither engine's decode step, and not counted.

Rounds alternate engines: moerun, llama.cpp, moerun, llama.cpp ... Each figure is the median
of the rounds with its range, each ratio (moerun / llama.cpp) the median of the rounds' own
ratios. Per row: weight bytes read per decoded token by each engine (llama.cpp's from the
GGUF's tensor sizes, the routed experts' by top-k/experts, one embedding row; moerun's from
`moerun.engine.info.describe`, what `moerun info` prints; components named alike); decode
tests add the KV cache read at their depth (each engine's KV dtype) and the recurrent states
(float32 in both). Bandwidth share = bytes/token x tok/s over the read bandwidth (`torch.sum`
over 1 GiB at the same thread count, best of 3) measured right before and right after each
engine's turn (mean of the two). Before the rounds a short check compares the two engines'
per-position logits on 32 tokens (llama.cpp's through the sdist's ctypes binding on the
native libllama): cosine near 1 for the equal-bytes rows says both read the same weights
(on the random Qwen3.6 net, which amplifies small differences, ~0.99 on the same file and
~0.5 between two roundings of the same weights: docs/benchmarks.md).

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
from moerun.layers.cache import Cache, RecurrentState, kv_bytes_per_token  # noqa: E402
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

    def owns(self, path: Path) -> bool:
        """Whether this run wrote `path` (deleted after its row unless --keep-gguf)."""
        return True


class Lock:
    """`flock` on a shared lock file (--lock), taken for each heavy step and each engine's
    turn and released between them, so that other jobs on a shared machine run between the
    turns but never during one. No path: a no-op."""

    def __init__(self, path: str | None):
        self.path = path

    def __call__(self, what: str):
        import contextlib
        import fcntl

        @contextlib.contextmanager
        def held():
            if not self.path:
                yield
                return
            with open(self.path, "a") as fh:
                t0 = time.perf_counter()
                fcntl.flock(fh, fcntl.LOCK_EX)
                waited = time.perf_counter() - t0
                if waited > 1:
                    log(f"waited {waited:.0f} s for {self.path} ({what})")
                try:
                    yield
                finally:
                    fcntl.flock(fh, fcntl.LOCK_UN)
        return held()


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
        self.made: list[Path] = []  # GGUF files this run wrote

    def owns(self, path: Path) -> bool:
        return path in self.made

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
        if path.is_file():
            log(f"[{row.name}] reusing {path}")
            return path
        t0 = time.perf_counter()
        if row.source == "blocks":
            entries = self._entries_blocks(llm.net)
            need_disk(path, sum(int(np.prod(e[2])) * np.dtype(e[3]).itemsize for e in entries))
            self.made.append(path)
            write_qwen3moe_gguf(entries, llm.args, path)
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
        entries = self._entries_float(net, args)
        need_disk(bf16, sum(int(np.prod(e[2])) * np.dtype(e[3]).itemsize for e in entries) * 1.3)  # + the Q4_K_M
        self.made.append(out)
        write_qwen3moe_gguf(entries, args, bf16)
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


class Qwen36Gguf(ModelSource):
    """The random Qwen3.6-35B-A3B shape (qwen35moe: 3 Gated DeltaNet layers to 1 gated
    attention layer, 256 experts top-8 of width 512, a shared expert, vocab 248320), --layers
    of its 40, as GGUF files made from one: `q36-{L}l-q8_0.gguf`, `moerun random-model
    qwen3.6-35b-a3b --layers L --quant q8_0` (random Q8_0 blocks in every quantized tensor:
    experts, shared experts, attention and DeltaNet projections, head, embedding; F32 norms,
    routers, gates, conv), and from it by the native `llama-quantize --allow-requantize`
    `q36-{L}l-q4_0-pure.gguf` (`--pure` Q4_0: every one of those tensors Q4_0, head and
    embedding too) and `q36-{L}l-q4_k_m.gguf` (Q4_K_M). Files already in --q36-dir are reused
    as they are (the Q8_0 and Q4_K_M files of docs/benchmarks.md were made this way, seed 0);
    missing ones are made there and deleted at the end of the run unless --keep-gguf. So all
    three rows hold the same weights, each rounded its own way.

    How moerun reads each row:
      int4, int8  the same file as llama.cpp (moerun runs Q4_0 and Q8_0 blocks as its own int4
                  and int8 bits, repacked at load): equal bytes by construction, component by
                  component, the MTP layer unread by both.
      default     moerun's default policy (DEFAULT_POLICY, int4-q6k) applied to the Q8_0
                  file's weights in memory (each quantized tensor dequantized and quantized
                  again in the policy's format, as `moerun quantize` would quantize float
                  weights), against llama.cpp's Q4_K_M requantized from the same Q8_0 file:
                  both engines' defaults made from the same weights.
    Its decode at a depth restores the DeltaNet states saved after the untimed fill
    (`MoerunRunner`), since a recurrent state cannot be rewound by the cache's lengths."""

    arch = "qwen35moe"
    FILES = {"int4": "q4_0-pure", "int8": "q8_0", "default": "q4_k_m"}
    # files llama-quantize makes from the Q8_0 one: kind -> (flags, type)
    REQUANT = {"q4_0-pure": (["--allow-requantize", "--pure"], "Q4_0"), "q4_k_m": (["--allow-requantize"], "Q4_K_M")}

    def __init__(self, layers: int, seed: int = 0, gguf_dir: str | Path | None = None):
        self.layers, self.seed = layers, seed
        self.name = f"qwen3.6-35b-a3b-{layers}L"
        self.dir = Path(gguf_dir or "/var/tmp/q36gguf")
        self.made: list[Path] = []  # files this run wrote (deleted at the end unless kept)

    rows = None  # set below: ROWS_Q36

    def file(self, kind: str) -> Path:
        return self.dir / f"q36-{self.layers}l-{kind}.gguf"

    def ensure(self, kind: str, threads: int) -> Path:
        """The row's file, made if missing (random blocks; Q4_K_M by llama-quantize from the Q8_0 file)."""
        path = self.file(kind)
        if path.is_file():
            return path
        self.dir.mkdir(parents=True, exist_ok=True)
        q8 = self.file("q8_0")
        # sizes by the 4-layer files: Q8_0 5.6 GB, Q4_0 --pure 3.0, Q4_K_M 3.2 (x layers / 4, roughly)
        need_disk(path, (q8.stat().st_size if q8.is_file() else 1.4e9 * self.layers) * (0.6 if kind in self.REQUANT else 1))
        t0 = time.perf_counter()
        if kind in self.REQUANT:
            flags, ftype = self.REQUANT[kind]
            q8 = self.ensure("q8_0", threads)
            r = subprocess.run([str(llamacpp.tool("llama-quantize")), *flags, str(q8), str(path), ftype, str(threads)],
                               capture_output=True, text=True)
            if r.returncode != 0:
                path.unlink(missing_ok=True)
                raise SystemExit(f"error: {llamacpp_failure(r.returncode, ['llama-quantize', str(q8)], r.stderr)}")
        else:
            from moerun.bench.random_model import write_random_gguf

            write_random_gguf(path, preset_config("qwen3.6-35b-a3b", layers=self.layers), kind, seed=self.seed,
                              progress=False)
        os.sync()  # the writeback of gigabytes of dirty pages must not run under a timing
        self.made.append(path)
        log(f"made {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s")
        return path

    def moerun(self, row: Row):
        path = self.ensure(self.FILES[row.name] if row.name == "int4" else "q8_0", 2)
        return load_gguf(path, DEFAULT_POLICY if row.name == "default" else None, row.name)

    def gguf(self, row: Row, llm, work: Path, keep: bool, threads: int) -> Path:
        return self.ensure(self.FILES[row.name], threads)

    def owns(self, path: Path) -> bool:
        return False  # a file serves more than one row: what this run made goes at its end (main)


def need_disk(path: Path, nbytes: float, margin: float = 1.5e9) -> None:
    """Stop with one line, before writing, when `path`'s disk lacks nbytes plus a margin."""
    free = shutil.disk_usage(path.parent).free
    if free < nbytes + margin:
        raise SystemExit(f"error: writing {path.name} needs ~{nbytes / 1e9:.1f} GB and {path.parent} has "
                         f"{free / 1e9:.1f} GB free (keeping {margin / 1e9:.1f} GB spare)")


def load_gguf(path: Path, policy: str | None = None, what: str = ""):
    """(LLM, args) of a GGUF file as `moerun.load(path)` sets it up; with `policy`, its
    quantized tensors first requantized to the policy's formats (`requantize`)."""
    from moerun.engine.llm import compute_dtype
    from moerun.loaders import build

    arch, args, net, dtype = build(path, "auto")  # what moerun.load(path) builds, before its LLM
    if policy is not None:
        counts = requantize(net, policy)
        log(f"[{what}] {path.name} requantized to {policy}: {counts}")
    dtype, kv = compute_dtype(net, "auto", dtype, None)
    llm = LLM(net, args, arch, None, path, dtype, {})
    llm.kv_dtype = kv
    return llm, args


class SameFile(ModelSource):
    """One row on a GGUF file given by --same-file ROW=FILE: both engines read FILE (moerun
    through `load_gguf`, as `moerun.load` would)."""

    arch = "gguf"

    def __init__(self, path: Path, name: str, seed: int = 0):
        self.path, self.name, self.seed = Path(path), name, seed

    def moerun(self, row: Row):
        return load_gguf(self.path, None, row.name)

    def gguf(self, row: Row, llm, work: Path, keep: bool, threads: int) -> Path:
        return self.path

    def owns(self, path: Path) -> bool:
        return False


def requantize(net, policy: str) -> dict:
    """Modules already quantized in another format than `policy` gives their component,
    dequantized to float32 and quantized again in that format (experts one at a time), as
    `quant.quantize_model` quantizes float modules (which it leaves the quantized ones as
    they are). {component: modules changed}."""
    from moerun.quant import component_of, replace_module, resolve_policy

    pol, counts = resolve_policy(policy), {}
    plan = []
    for name, mod in net.named_modules():
        comp = component_of(name, mod)
        if comp is None or getattr(pol, comp) is None:
            continue
        fmt = getattr(pol, comp)
        if isinstance(mod, QuantizedExperts):
            want = (formats.fit(fmt, mod.hidden_size), formats.fit(fmt, mod.intermediate_size))
            if (mod.fmt, mod.down_fmt) != want:
                plan.append((name, mod, comp, want))
        elif isinstance(mod, QuantizedLinear):
            want = formats.fit(fmt, mod.in_features)
            if mod.fmt != want:
                plan.append((name, mod, comp, want))
    with torch.no_grad():
        for name, mod, comp, want in plan:
            if isinstance(mod, QuantizedExperts):
                E, H, I = mod.num_experts, mod.hidden_size, mod.intermediate_size
                new = QuantizedExperts(E, H, I, want[0], want[1] if want[1] != want[0] else None)
                for which, f_old, f_new, k in (("gate", mod.fmt, new.fmt, H), ("up", mod.fmt, new.fmt, H),
                                               ("down", mod.down_fmt, new.down_fmt, I)):
                    q0, s0 = getattr(mod, f"{which}_q"), getattr(mod, f"{which}_scales")
                    q1, s1 = getattr(new, f"{which}_q"), getattr(new, f"{which}_scales")
                    for e in range(E):
                        q1[e], s1[e] = formats.quantize(formats.dequantize(q0[e], s0[e], f_old, k), f_new)
            else:
                new = QuantizedLinear(mod.in_features, mod.out_features, want, bias=mod.bias is not None)
                for i in range(0, mod.out_features, 4096):
                    w = formats.dequantize(mod.qweight[i : i + 4096], mod.scales[i : i + 4096], mod.fmt, mod.in_features)
                    new.qweight[i : i + 4096], new.scales[i : i + 4096] = formats.quantize(w, want)
                if mod.bias is not None:
                    new.bias = mod.bias.detach().float().clone()
            replace_module(net, name, new)
            counts[comp] = counts.get(comp, 0) + 1
    return counts


ROWS_Q36 = {
    "int4": Row("int4", "the Q4_0 file (int4)", "Q4_0 --pure (the same file)", "file"),
    "int8": Row("int8", "the Q8_0 file (int8)", "Q8_0 (the same file)", "file"),
    "default": Row("default", f"{DEFAULT_POLICY} of the Q8_0 file", "Q4_K_M of the Q8_0 file", "requant", "Q4_K_M"),
}
Qwen3MoeRandom.rows = ROWS
Qwen36Gguf.rows = ROWS_Q36
MODELS = {"qwen3-30b-a3b": Qwen3MoeRandom, "qwen3.6-35b-a3b": Qwen36Gguf}


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

def gguf_component(name: str, deltanet_blocks: set[int]) -> str:
    """The component of a GGUF tensor, named as `moerun info` names moerun's (engine.info)."""
    if "_exps." in name:
        return "routed experts"
    if name.startswith("token_embd"):
        return "embedding"
    if name.startswith("output."):
        return "head"
    if "_shexp." in name:  # the shared expert and its sigmoid gate (ffn_gate_inp_shexp)
        return "shared expert"
    if "ffn_gate_inp" in name:
        return "router"
    block = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if block in deltanet_blocks and (".ssm_" in name or ".attn_" in name) and ".attn_norm." not in name:
        return "deltanet"  # attn_qkv, attn_gate, ssm_* (its norm, conv, A and dt too)
    if ".attn_" in name and ".attn_norm." not in name:  # q/k norms too, as moerun counts them
        return "attention"
    return "norms"


def gguf_bytes_per_token(path: Path, n_used: int, n_experts: int) -> dict:
    """Weight bytes llama.cpp reads per decoded token, from the GGUF's tensor types and sizes:
    every tensor whole, except the routed experts (top-k of n_experts), the embedding (a row)
    and the MTP (nextn) blocks after the decoder's, which a plain decode step does not run.
    Components as `moerun info` names them."""
    import gguf

    r = gguf.GGUFReader(str(path))
    arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")

    def meta(key, default=0):
        f = r.fields.get(f"{arch}.{key}")
        return int(f.parts[-1][0]) if f is not None else default

    n_blocks = meta("block_count") - meta("nextn_predict_layers")
    deltanet = {int(t.name.split(".")[1]) for t in r.tensors if t.name.startswith("blk.") and ".ssm_" in t.name}
    by, types = {}, {}
    for t in r.tensors:
        nb = int(t.n_bytes)
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= n_blocks:
            comp, nb = "mtp", 0
        else:
            comp = gguf_component(t.name, deltanet)
        if comp == "routed experts":
            nb = nb * n_used / n_experts
        elif comp == "embedding":
            nb = nb / int(t.shape[-1])  # shape is ggml's [cols, rows]
        if comp != "mtp":
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
        self.saved: dict[int, list] = {}  # id(cache) -> its recurrent states after `fill`
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
        """Fill the cache with `depth` tokens (untimed) and save its recurrent states as they
        are then, for `rewind`."""
        cache.reset(0)
        plans = run_plans(self.net)
        with torch.inference_mode():
            for s in range(0, depth, chunk):
                self.net(self.ids(min(chunk, depth - s)), cache, last_only=True, **plans)
        self.saved[id(cache)] = [{n: t.clone() for n, t in layer.tensors.items()} if isinstance(layer, RecurrentState)
                                 else None for layer in cache.layers]

    def rewind(self, cache: Cache, depth: int) -> None:
        """The cache as it was after `depth` tokens: the KV cache by its length (what follows
        is written over), a recurrent (DeltaNet) state by the copy `fill` saved (zeros at 0)."""
        cache.lengths[0] = depth
        saved = self.saved.get(id(cache)) if depth else None
        for i, layer in enumerate(cache.layers):
            if isinstance(layer, RecurrentState):
                for n, t in layer.tensors.items():
                    if saved is None:
                        t.zero_()
                    else:
                        t.copy_(saved[i][n])

    def decode(self, cache: Cache, depth: int, n: int) -> float:
        toks = self.ids(n + 1)[0].tolist()
        plans = run_plans(self.net)
        with torch.inference_mode():
            self.rewind(cache, depth)
            self.net(torch.tensor([[toks[-1]]]), cache, last_only=True, **plans)  # warm-up step (llama-bench's)
            self.rewind(cache, depth)
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


def state_bytes(llm) -> int:
    """Bytes of one sequence's recurrent (DeltaNet) states: read and written every token."""
    cache = Cache(llm.net.cache_spec(), 1, 1, llm.dtype, llm.kv_dtype)
    return sum(layer.nbytes() for layer in cache.layers if isinstance(layer, RecurrentState))


def run_row(src: ModelSource, row: Row, plan: Plan, a, work: Path, lock: Lock | None = None) -> dict:
    lock = lock or Lock(None)
    if getattr(a, "lock_scope", "turn") == "row" and lock.path:
        with lock(f"{row.name}: the whole row"):
            return run_row(src, row, plan, a, work, Lock(None))
    t0 = time.perf_counter()
    gguf_path = None
    with lock(f"{row.name}: moerun's net, the GGUF, the warm-up, the logits check"):
        if row.source == "float":
            target = work / f"{src.name}-s{src.seed}-{row.name}.gguf"
            made = {}

            def hook(net, args):
                if target.is_file():
                    log(f"[{row.name}] reusing {target}")
                    made["path"] = target
                else:
                    made["path"] = src.gguf_float(row, net, args, work, max(plan.threads))
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
        kv_tok = {"moerun": kv_bytes_per_token(llm.net.cache_spec(), llm.kv_dtype or llm.dtype),  # None: the model's
                  "llamacpp": kv_bytes_per_token(llm.net.cache_spec(), torch.float16)}  # llama.cpp's f16 cache
        state = state_bytes(llm)  # float32 in both engines
        log(f"[{row.name}] llama.cpp {row.llama}: {lbytes['bytes_per_token'] / 1e6:.0f} MB per decoded token; "
            f"tensor types {lbytes['tensor_types']}")

        rss0 = rss_now()
        runner = MoerunRunner(llm, plan)
        logits = None
        if a.logits:
            try:
                logits = logits_check(llm, gguf_path, a.logits, max(plan.threads))
                log(f"[{row.name}] logits, {a.logits} positions: {logits}")
            except Exception as e:  # a check, not a figure: say why and go on
                logits = {"error": f"{type(e).__name__}: {e}"}
                log(f"[{row.name}] logits check failed: {logits['error']}")
    res = {"row": row.name, "moerun_policy": row.policy, "llamacpp_weights": row.llama, "gguf": str(gguf_path),
           "bytes_per_token": {"moerun": info["bytes_per_token"], "llamacpp": lbytes["bytes_per_token"]},
           "bytes_per_token_by_component": {"moerun": info["bytes_per_token_by_component"],
                                            "llamacpp": lbytes["by_component"]},
           "llamacpp_tensor_types": lbytes["tensor_types"], "gguf_bytes": lbytes["file_bytes"],
           "kv_bytes_per_token": kv_tok["moerun"], "kv_bytes_per_token_by_engine": kv_tok,
           "state_bytes": state, "rounds": []}
    facts = {}
    import contextlib

    per_round = getattr(a, "lock_scope", "turn") == "round"
    for r in range(a.rounds):
        rnd = {}
        round_lock = lock(f"{row.name}: round {r + 1}") if per_round else contextlib.nullcontext()
        round_lock.__enter__()
        for eng in ("moerun", "llamacpp"):
            with (contextlib.nullcontext() if per_round else lock(f"{row.name}: round {r + 1}, {eng}")):
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
                    b = res["bytes_per_token"][eng] + (d + plan.gen / 2) * kv_tok[eng] + state
                    share[key] = v * b / bw[t]
            rnd[eng] = {"tok_s": tok, "bandwidth_share": share, "bandwidth_before": bw0, "bandwidth_after": bw1,
                        "seconds": took}
            log(f"[{row.name}] round {r + 1} {eng} ({took:.0f} s): " + ", ".join(f"{k} {v:.1f}" for k, v in tok.items())
                + "; bandwidth GB/s " + ", ".join(f"t{t} {bw0[t] / 1e9:.1f}/{bw1[t] / 1e9:.1f}" for t in plan.threads))
        round_lock.__exit__(None, None, None)
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
    if logits is not None:
        res["logits"] = logits
    del runner, llm
    gc.collect()
    if not a.keep_gguf and src.owns(gguf_path):
        gguf_path.unlink(missing_ok=True)
    return res


def fmt_mr(d: dict, f: str = "{:.1f}", unit: str = "", k: float = 1) -> str:
    """median (min-max), the unit after the median."""
    if d["n"] == 1:
        return f.format(k * d["median"]) + unit
    return f.format(k * d["median"]) + unit + f" ({f.format(k * d['min'])}-{f.format(k * d['max'])})"


def table(out: dict) -> str:
    """The tables of a run (one per model); an older run's JSON (one model, "rows") too."""
    models = out.get("models") or [out]
    m = out["machine"]
    bws = [bw for mo in models for r in mo["rows"] for rd in r["rounds"] for e in ("moerun", "llamacpp")
           for bw in (*rd[e]["bandwidth_before"].values(), *rd[e]["bandwidth_after"].values())]
    lines = [
        f"{m['cpu']}, {m['cpus']} CPUs, L3 {m['l3']}; "
        f"read bandwidth (torch.sum over 1 GiB) {min(bws) / 1e9:.1f}-{max(bws) / 1e9:.1f} GB/s over the run; "
        f"moerun {m['moerun_commit']}, llama.cpp {out['llamacpp_build'].get('version')} "
        f"(vendored commit {out['llamacpp_build'].get('llama_cpp_commit', '?')[:10]}, GGML_NATIVE); {m['date']}; "
        f"medians of {out['plan']['rounds']} alternating rounds (range in brackets); ratio = moerun / llama.cpp, "
        f"median of the rounds' ratios; share = bytes/token x tok/s / read bandwidth",
    ]
    for mo in models:
        layers = mo.get("layers", out["plan"].get("layers"))
        lines += [
            "", f"{mo['model']} ({mo['arch']}), {layers} layers", "",
            "| row | moerun | llama.cpp | test | moerun tok/s | llama.cpp tok/s | ratio | moerun share | llama.cpp share |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in mo["rows"]:
            for key, e in r["tests"].items():
                share = (fmt_mr(e["moerun_share"], "{:.0f}", "%", 100), fmt_mr(e["llamacpp_share"], "{:.0f}", "%", 100)) \
                    if "moerun_share" in e else ("", "")
                lines.append(f"| {r['row']} | {r['moerun_policy']} | {r['llamacpp_weights']} | {key} | {fmt_mr(e['moerun'])} | "
                             f"{fmt_mr(e['llamacpp'])} | {fmt_mr(e['ratio'], '{:.2f}', 'x')} | {share[0]} | {share[1]} |")
        lines += ["", "| row | moerun MB/token | llama.cpp MB/token | GGUF GB | llama.cpp tensor types | "
                  "KV KB/token moerun / llama.cpp | recurrent state MB | moerun RSS GiB (whole process) | "
                  "llama-bench peak RSS GiB | logits cosine (median, min; top-1) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in mo["rows"]:
            lg = r.get("logits", {})
            lgs = (f"{lg['cosine_median']:.4f}, {lg['cosine_min']:.4f}; {100 * lg['top1_agreement']:.0f}%"
                   if "cosine_median" in lg else lg.get("error", "")[:60])
            kv = r.get("kv_bytes_per_token_by_engine", {"moerun": r["kv_bytes_per_token"], "llamacpp": r["kv_bytes_per_token"]})
            lines.append(f"| {r['row']} | {r['bytes_per_token']['moerun'] / 1e6:.0f} | {r['bytes_per_token']['llamacpp'] / 1e6:.0f} | "
                         f"{r['gguf_bytes'] / 1e9:.2f} | {', '.join(f'{k} {v}' for k, v in r['llamacpp_tensor_types'].items())} | "
                         f"{kv['moerun'] / 1024:.0f} / {kv['llamacpp'] / 1024:.0f} | {r.get('state_bytes', 0) / 1e6:.1f} | "
                         f"{r['moerun_rss_after_runs'] / GiB:.1f} | {r['llamacpp_peak_rss'] / GiB:.1f} | {lgs} |")
        lines += ["", "MB read per decoded token by component, moerun / llama.cpp:", ""]
        for r in mo["rows"]:
            bc = r["bytes_per_token_by_component"]
            comps = sorted(set(bc["moerun"]) | set(bc["llamacpp"]), key=lambda c: -bc["moerun"].get(c, 0))
            lines.append(f"- {r['row']}: " + ", ".join(
                f"{c} {bc['moerun'].get(c, 0) / 1e6:.1f} / {bc['llamacpp'].get(c, 0) / 1e6:.1f}" for c in comps))
    return "\n".join(lines)


def merge_runs(runs: list[dict]) -> dict:
    """Several runs' JSON as one for `table`: each model's rows in the order met (a model
    with the same name and layers joined), the first run's machine and plan, every command."""
    out = dict(runs[0], models=[], commands=[r.get("command", "") for r in runs])
    by = {}
    for r in runs:
        for mo in r.get("models") or [r]:
            key = (mo["model"], mo.get("layers", r.get("plan", {}).get("layers")))
            if key not in by:
                by[key] = dict(mo, rows=[])
                out["models"].append(by[key])
            by[key]["rows"] += mo["rows"]
    return out


LAYERS = {"qwen3-30b-a3b": 8, "qwen3.6-35b-a3b": 4}  # --layers' defaults


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b",
                   help=f"comma-separated, run one after the other: {', '.join(sorted(MODELS))}")
    p.add_argument("--layers", default=None,
                   help="decoder layers, one number or one per --model (default: 8 for qwen3-30b-a3b, 4 for qwen3.6-35b-a3b)")
    p.add_argument("--rows", default="int4,int8,default", help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (moerun, llama.cpp) per row")
    p.add_argument("--threads", default="2",
                   help="thread counts, comma-separated (1,2: the full matrix)")
    p.add_argument("--prompts", default="512,2048", help="prefill lengths (llama-bench -p)")
    p.add_argument("--gen", type=int, default=128, help="decode steps (llama-bench -n)")
    p.add_argument("--depths", default="0,4096", help="context before the decode steps (llama-bench -d)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: prefill 128, decode 16 at depths 0 and 256, 1 round, unless given")
    p.add_argument("--logits", type=int, default=32, help="positions of the logits check (0: none)")
    p.add_argument("--lock", metavar="FILE",
                   help="flock FILE for each heavy step and each engine's turn, released between them "
                        "(a shared machine: /tmp/moerun-heavy.lock)")
    p.add_argument("--lock-scope", default="turn", choices=["turn", "round", "row"],
                   help="with --lock: hold it for each engine's turn (default), for a round (both engines' turns), or "
                        "for a row (its set-up and all its rounds): fewer waits where others' jobs queue for the lock")
    p.add_argument("--q36-dir", default="/var/tmp/q36gguf",
                   help="qwen3.6-35b-a3b's GGUF files q36-{L}l-{q4_0,q8_0,q4_k_m}.gguf: reused when there, made there otherwise")
    p.add_argument("--same-file", action="append", default=[], metavar="ROW=FILE",
                   help="qwen3-30b-a3b: run ROW on this GGUF file in both engines instead of moerun's own weights and a "
                        "GGUF written from them (repeatable; e.g. int8=Q8_0.gguf where the disk has no room for another)")
    p.add_argument("--workdir", default="/var/tmp/moerun-vs-llamacpp")
    p.add_argument("--keep-gguf", action="store_true", help="keep the GGUF files in --workdir and reuse them")
    p.add_argument("--llamacpp-dir", help="llama.cpp build cache (default: $MOERUN_LLAMACPP_DIR or "
                                          f"{llamacpp.default_dir()})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="write every figure to OUT")
    p.add_argument("--table", metavar="JSON", nargs="+",
                   help="print the tables of earlier runs' --json files (several: their rows together) and stop")
    given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--")}
    a = p.parse_args(argv)
    if a.table:
        print(table(merge_runs([json.loads(Path(f).read_text()) for f in a.table])))
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
    try:
        models, plan = parse_selection(a)
        same = {}
        for spec in a.same_file:
            row, eq, f = spec.partition("=")
            if not eq or row not in ROWS:
                raise ValueError(f"--same-file {spec!r}: ROW=FILE, ROW one of {', '.join(ROWS)}")
            if not Path(f).is_file():
                raise ValueError(f"--same-file {spec!r}: {f}: no such file")
            same[row] = Path(f)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.llamacpp_dir:
        os.environ["MOERUN_LLAMACPP_DIR"] = a.llamacpp_dir
    try:
        build = llamacpp.require_built()
    except llamacpp.BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(work).free
    for m, layers, rows in models:
        made = work / f"{Qwen3MoeRandom(layers, a.seed).name}-s{a.seed}-default.gguf"  # reused when there
        if m == "qwen3-30b-a3b" and "default" in rows and not made.is_file() and free < 16e9:
            log(f"warning: {free / 1e9:.0f} GB free in {work}; the default row's bf16 GGUF alone takes ~{1.4 * layers:.0f} GB")
    lock = Lock(a.lock)
    out = {"command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
           "machine": machine(), "llamacpp_build": build,
           "plan": {"rounds": a.rounds, "threads": plan.threads, "prompts": plan.prompts,
                    "gen": plan.gen, "depths": plan.depths, "warm": plan.warm}, "models": []}
    log(f"{out['machine']['cpu']}, L3 {out['machine']['l3']}; {out['machine']['moerun_kernels']}; "
        f"llama.cpp from {build['lib_dir']}")
    t0 = time.perf_counter()
    for name, layers, rows in models:
        src = Qwen36Gguf(layers, a.seed, a.q36_dir) if name == "qwen3.6-35b-a3b" else MODELS[name](layers, a.seed)
        mo = {"model": src.name, "arch": src.arch, "layers": layers, "rows": []}
        out["models"].append(mo)
        try:
            for row in rows:
                if name == "qwen3-30b-a3b" and row in same:
                    kind = ROWS[row].llama.split()[0]
                    r_src, r = SameFile(same[row], src.name), Row(row, f"the {kind} file", f"{kind} (the same file: "
                                                                        f"{same[row].name})", "file")
                else:
                    r_src, r = src, src.rows[row]
                try:
                    mo["rows"].append(run_row(r_src, r, plan, a, work, lock))
                except SystemExit as e:  # one row's failure (a full disk, a tool's error): the others still run
                    if not str(e).startswith("error: "):
                        raise
                    log(f"[{row}] {e}")
                    mo.setdefault("failed", {})[row] = str(e)
                if a.json:  # after each row: a long run killed halfway keeps what it measured
                    Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
        finally:
            if not a.keep_gguf:
                for path in getattr(src, "made", []):
                    path.unlink(missing_ok=True)
    out["seconds"] = time.perf_counter() - t0
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    print(table(out))
    failed = [f"{mo['model']} {row}: {msg}" for mo in out["models"] for row, msg in mo.get("failed", {}).items()]
    for f in failed:
        print(f, file=sys.stderr)
    return 1 if failed else 0


def parse_selection(a) -> tuple[list, "Plan"]:
    """[(model, layers, rows)] and the Plan from the options; ValueError naming a bad one."""
    names = [m.strip() for m in a.model.split(",") if m.strip()]
    for m in names:
        if m not in MODELS:
            raise ValueError(f"--model {m!r}: not one of {', '.join(sorted(MODELS))}")
    if not names:
        raise ValueError("--model names no model")
    try:
        layers = [int(x) for x in a.layers.split(",")] if a.layers else [LAYERS[m] for m in names]
    except ValueError:
        raise ValueError(f"--layers {a.layers!r}: one whole number, or one per --model") from None
    if len(layers) == 1 and len(names) > 1:
        layers *= len(names)
    if len(layers) != len(names) or min(layers) < 1:
        raise ValueError(f"--layers {a.layers!r}: one whole number of at least 1, or one per --model")
    rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    for r in rows:
        if r not in ROWS:
            raise ValueError(f"--rows {r!r}: not one of {', '.join(ROWS)}")

    def ints(opt, v, least):
        try:
            xs = [int(x) for x in v.split(",")]
        except ValueError:
            raise ValueError(f"{opt} {v!r}: comma-separated whole numbers") from None
        if not xs or min(xs) < least:
            raise ValueError(f"{opt} {v!r}: each at least {least}")
        return xs

    threads = ints("--threads", a.threads, 1)
    prompts = ints("--prompts", a.prompts, 1)
    depths = ints("--depths", a.depths, 0)
    if a.gen < 1 or a.rounds < 1:
        raise ValueError("--gen and --rounds must be at least 1")
    plan = Plan(threads=sorted(set(threads), reverse=True), prompts=prompts, gen=a.gen, depths=sorted(set(depths)))
    return [(m, n, rows) for m, n in zip(names, layers)], plan


if __name__ == "__main__":
    sys.exit(main())
