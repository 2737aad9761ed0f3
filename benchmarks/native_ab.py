"""Two builds of the native extension in one process, taking turns: kernel changes A/B.

    python benchmarks/native_ab.py --other /tmp/old/moerun/_native*.so [--threads 2] [--rounds 7]
    python benchmarks/native_ab.py --other ... --model [PATH] [--tokens 1,3] [--dtype bfloat16]

Loads this checkout's extension and another build of it (e.g. a worktree of an older commit
built with cmake, see checkout.py) side by side, and times the same calls on both,
alternating call by call, so that a drifting machine falls on both alike: one decode step's
attention (`attn_decode`, bf16 keys and values, heads of 128, 8 layers' caches so that they
come from memory) at a few cache lengths and head groupings, and int8 matrix-vector products
of Qwen3-30B-A3B's attention and LM-head shapes, and the routed experts of a decode step (8
of 128, int4, from memory: each call draws its own experts from 3 layers' worth, 1 GB, so
that neither build finds in the caches what the other just read). Prints the median time of
each and says whether both builds gave the same bits (on the same inputs, one more call each).

With --model (a checkpoint directory; without PATH the bundled demo model) it times that
model's own native calls instead: for each pass length T in --tokens (1: a decode step, more:
a verification pass), the calls one pass of T tokens makes after a 40-token prefill, each op
summed over its calls in the pass (deltanet_block, moe_block, ...), then whole passes, both
builds alternating; and whether both builds give the pass the same logits, bit for bit.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from moerun import kernels
from moerun.kernels import formats


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(f"{name}._native", path)
    mod = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings():  # both builds bind the same C++ classes (NativeStack): nanobind
        warnings.filterwarnings("ignore", message="nanobind: type .* was already registered")  # says so
        spec.loader.exec_module(mod)
    return mod


def bf16_np(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.bfloat16).view(torch.uint16).numpy()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", type=Path, required=True, help="the other build's _native*.so")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--model", nargs="?", const="", default=None,
                    help="time this checkpoint's own calls (no PATH: the bundled demo model)")
    ap.add_argument("--tokens", default="1,3", help="--model: pass lengths, comma-separated")
    ap.add_argument("--dtype", default="auto", help="--model: as moerun.load takes it")
    a = ap.parse_args(argv)
    builds = {"this": kernels._native(), "other": load(a.other, "other")}
    if builds["this"] is None:
        raise SystemExit("this checkout's native extension is not built")
    for m in builds.values():
        m.set_threads(a.threads)
    if a.model is not None:
        return model_calls(a, builds)
    g = torch.Generator().manual_seed(0)
    jobs = []
    for S in (64, 512, 2048):
        for hq, hkv in ((32, 4), (16, 2)):
            k = [bf16_np(torch.randn(hkv, 2048, 128, generator=g)) for _ in range(8)]
            v = [bf16_np(torch.randn(hkv, 2048, 128, generator=g)) for _ in range(8)]
            q = torch.randn(hq, 128, generator=g).numpy()

            def attn(m, out, i, k=k, v=v, q=q, S=S):
                for kl, vl in zip(k, v):
                    m.attn_decode(q, kl[:, :S], vl[:, :S], out, 128**-0.5, None, None)

            jobs.append((f"attention, {S} positions, {hq}/{hkv} heads, per layer", attn, (hq, 128), 8))
    for rows, cols in ((5120, 2048), (2048, 4096), (151936 // 2, 2048)):
        w = [kernels.packed(*formats.quantize(torch.randn(rows, cols, generator=g) * 0.02, "int8"), "int8")
             for _ in range(max(1, 8 * 2048 * 5120 // (rows * cols)))]
        x = torch.randn(1, cols, generator=g).numpy()

        def linear(m, out, i, w=w, x=x):
            for p in w:
                m.qlinear_multi(x, [p.w], [p.s], [p.code], out)

        jobs.append((f"int8 {rows}x{cols} product, each", linear, (1, rows), len(w)))
    E, H, I, K = 128, 2048, 768, 8
    gq, gs = formats.quantize(torch.randn(I, H, generator=g) * 0.02, "int4")
    dq, ds = formats.quantize(torch.randn(H, I, generator=g) * 0.02, "int4")
    layers = []
    for _ in range(3):  # experts differ by a rotation of their rows (what the bits check sees)
        gate = torch.stack([gq.roll(e, 0) for e in range(E)])
        down = torch.stack([dq.roll(e, 0) for e in range(E)])
        layers.append(tuple(t.numpy() for t in (gate, gs.expand(E, *gs.shape).contiguous(), gate.clone(),
                                                gs.expand(E, *gs.shape).contiguous(), down,
                                                ds.expand(E, *ds.shape).contiguous())))
    xe = torch.randn(1, H, generator=g).numpy()
    we = torch.full((1, K), 1.0 / K).numpy()
    draw = np.random.default_rng(0)

    def experts(m, out, i):
        rng = np.random.default_rng(0) if i < 0 else draw  # i < 0: the bits check's fixed inputs
        for _ in range(1 if i < 0 else 20):
            ids = rng.permutation(E)[:K][None].astype(np.int64)
            w = layers[int(rng.integers(len(layers)))]
            try:  # builds since one path for the store take each weight as a list (a stack, or one array per expert)
                m.moe_experts(xe, ids, we, *[[t] for t in w], out, formats.FORMATS["int4"], I)
            except TypeError:
                m.moe_experts(xe, ids, we, *w, out, formats.FORMATS["int4"], I)

    jobs.append(("routed experts of a decode step (8 of 128, int4), from memory, each", experts, (1, H), 20))
    print(f"this build vs {a.other}, {a.threads} threads, median of {a.rounds} alternating rounds (us)")
    for name, run, shape, n in jobs:
        times: dict[str, list[float]] = {b: [] for b in builds}
        outs = {}
        for r in range(a.rounds):
            for b, m in builds.items():
                out = np.empty(shape, np.float32)
                t = time.perf_counter()
                run(m, out, r)
                times[b].append((time.perf_counter() - t) / n * 1e6)
        for b, m in builds.items():
            outs[b] = np.empty(shape, np.float32)
            run(m, outs[b], -1)
        this, other = statistics.median(times["this"]), statistics.median(times["other"])
        same = np.array_equal(outs["this"], outs["other"])
        print(f"{name}: this {this:.1f}, other {other:.1f} ({this / other:.2f}x){'' if same else ', DIFFERENT bits'}")


class Recorder:
    """Stands in for the extension module: calls go to `nat`, and with `calls` set each call's
    (name, args) is appended to it."""

    def __init__(self, nat):
        self.nat, self.calls = nat, None

    def __getattr__(self, name):
        f = getattr(self.nat, name)

        def call(*args):
            if self.calls is not None:
                self.calls.append((name, args))
            return f(*args)

        return call


def model_calls(a, builds) -> None:
    """--model: a checkpoint's own native calls and passes, on both builds (module doc)."""
    import moerun
    from moerun.layers.cache import Cache
    from moerun.errors import MoerunError

    try:
        llm = moerun.load(a.model or None, dtype=a.dtype, threads=a.threads)
    except MoerunError as e:
        raise SystemExit(f"error: {e}") from None
    net = llm.net
    V = net.lm_head.out_features
    lengths = [int(t) for t in a.tokens.split(",")]
    prompt = [t % V for t in range(5, 45)]
    text = torch.randint(0, V, (max(lengths),), generator=torch.Generator().manual_seed(1)).tolist()

    def fresh_cache():
        cache = Cache(net.cache_spec(), 1, len(prompt) + max(lengths), llm.dtype, llm.kv_dtype)
        net(torch.tensor([prompt]), cache, torch.tensor([0]), last_only=True)
        return cache

    def use(build):
        """Calls go to `build` from now on; once the other build's workers, which spin for a
        few milliseconds after their last job, have gone to sleep (they would hold a core)."""
        kernels._state["native"] = build
        time.sleep(2 * kernels.DECODE_SPIN_US * 1e-6)

    for m in builds.values():  # a few-token pass's setting (kernels.split_threads), on both builds
        m.set_spin_us(kernels.DECODE_SPIN_US)

    print(f"{a.model or 'the demo model'} ({llm.dtype}), this build vs {a.other}, {a.threads} threads, "
          f"median of {a.rounds} alternating rounds (us)")
    with torch.inference_mode():
        for T in lengths:
            ids = torch.tensor([text[:T]])
            logits, passes = {}, {}
            for b, m in builds.items():
                use(m)
                cache = fresh_cache()
                logits[b] = net(ids, cache, torch.tensor([0]), last_only=T == 1)
                rec = Recorder(m)
                use(rec)
                rec.calls = []
                cache.lengths[0] = len(prompt)
                net(ids, cache, torch.tensor([0]), last_only=T == 1)
                passes[b] = (cache, rec.calls)
            use(builds["this"])
            names = sorted({name for name, _ in passes["this"][1] if not name.startswith(("set_", "get_"))})
            for name in names:
                times = {b: [] for b in builds}
                for _ in range(a.rounds):
                    for b, m in builds.items():
                        calls = [args for n, args in passes[b][1] if n == name]
                        f = getattr(m, name)
                        use(m)
                        f(*calls[0])  # wakes the pool
                        t = time.perf_counter()
                        for args in calls:
                            f(*args)
                        times[b].append((time.perf_counter() - t) * 1e6)
                this, other = statistics.median(times["this"]), statistics.median(times["other"])
                print(f"T={T} {name} ({len(calls)} calls a pass): this {this:.1f}, other {other:.1f} ({this / other:.2f}x)")
            times = {b: [] for b in builds}
            for _ in range(a.rounds):
                for b, m in builds.items():
                    use(m)
                    cache = passes[b][0]
                    best = float("inf")
                    for _ in range(3):
                        cache.lengths[0] = len(prompt)
                        t = time.perf_counter()
                        net(ids, cache, torch.tensor([0]), last_only=T == 1)
                        best = min(best, time.perf_counter() - t)
                    times[b].append(best * 1e6)
            use(builds["this"])
            this, other = statistics.median(times["this"]), statistics.median(times["other"])
            same = torch.equal(logits["this"], logits["other"])
            print(f"T={T} whole pass: this {this:.1f}, other {other:.1f} ({this / other:.2f}x)"
                  f"{', same logits' if same else ', DIFFERENT logits'}")


if __name__ == "__main__":
    main()
