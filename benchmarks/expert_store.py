"""Decode speed and stall share of the tiered expert store, per placement and policy.

    .venv/bin/python benchmarks/expert_store.py                      # random Qwen3-30B-A3B-shaped, 4 layers
    .venv/bin/python benchmarks/expert_store.py --model moerun/demo_model --dtype float32

Rows: all experts in RAM; --ram-budget 50% and 25% of the experts (real disk streaming:
the checkpoint's pages are dropped from the page cache before each measurement and after
every read); the EMULATED PCIe 4.0 link with a device budget of 25% -- each with LRU
alone and with LRU + a pinned hot set (taken from the routing profile of the first row's
own run, i.e. the best case for pinning). In those rows no predictor drives prefetching,
so every miss is a demand miss; the next two rows add the `layer_ahead1` predictor
(moerun.experts.predict) hinting the async prefetcher; the last two run device misses on the
CPU (`--execute cpu`) or where the cost model says (`--execute auto`), against the row
"EMULATED pcie4, VRAM 25%, LRU" that always waits (`--execute device`):

    .venv/bin/python benchmarks/expert_store.py --rows 5,9,10

`--quantized DIR` (a checkpoint written by `moerun quantize`) or `--quantized int4` (the
model written quantized into --work-dir once) runs the same rows on the packed experts too
(budgets then count packed bytes; one native kernel call per layer); `--no-float` skips
the float rows:

    .venv/bin/python benchmarks/expert_store.py --model moerun/demo_model --quantized int4 --rows 0,1,3

Emulated rows charge link time only; the experts "on the device" still run on the CPU at
CPU speed, so for them the table also gives decode tok/s with that measured CPU time
replaced by the MODELLED device compute time (placement.DeviceModel). Use --threads 1 on a
shared machine: two threads on two busy cores ran 15x slower here.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moerun.layers.cache import Cache  # noqa: E402
from moerun.experts import StoreOptions, load  # noqa: E402

ROWS = [
    # label, options, pin fraction (of each layer's experts; from the profile), predictor driving prefetch
    ("all experts in RAM", dict(), 0.0, None),
    ("RAM 50%, LRU", dict(ram_budget="50%"), 0.0, None),
    ("RAM 50%, LRU + pinned 25%", dict(ram_budget="50%"), 0.25, None),
    ("RAM 25%, LRU", dict(ram_budget="25%"), 0.0, None),
    ("RAM 25%, LRU + pinned 12.5%", dict(ram_budget="25%"), 0.125, None),
    ("EMULATED pcie4, VRAM 25%, LRU", dict(vram_budget="25%", emulate_link="pcie4"), 0.0, None),
    ("EMULATED pcie4, VRAM 25%, LRU + pinned 12.5%", dict(vram_budget="25%", emulate_link="pcie4"), 0.125, None),
    # the same with the layer_ahead1 predictor (moerun.experts.predict) hinting the prefetcher
    ("RAM 25%, LRU, layer_ahead1 prefetch", dict(ram_budget="25%"), 0.0, "layer_ahead1"),
    ("EMULATED pcie4, VRAM 25%, LRU, layer_ahead1 prefetch", dict(vram_budget="25%", emulate_link="pcie4"), 0.0,
     "layer_ahead1"),
    # device misses run on the CPU, or where the cost model places them (row 5 always waits)
    ("EMULATED pcie4, VRAM 25%, LRU, execute cpu", dict(vram_budget="25%", emulate_link="pcie4", execute="cpu"), 0.0, None),
    ("EMULATED pcie4, VRAM 25%, LRU, execute auto", dict(vram_budget="25%", emulate_link="pcie4", execute="auto"), 0.0,
     None),
]


def random_model(layers: int, root: Path) -> Path:
    from moerun.bench.random_model import preset_config, write_random_model

    path = root / f"qwen3-30b-a3b-random-L{layers}"
    if not (path / "config.json").is_file():
        write_random_model(path, preset_config("qwen3-30b-a3b", layers=layers))
    return path


def quantized_model(spec: str, src: Path, root: Path) -> Path:
    """`spec`: a directory written by `moerun quantize`, or a policy to write `src` in (once)."""
    from moerun.quant import POLICIES
    from moerun.loaders.quantized_write import quantize_checkpoint

    if spec not in POLICIES:
        return Path(spec)
    path = root / f"{src.name}-{spec}"
    if not (path / "config.json").is_file():
        quantize_checkpoint(src, path, spec)
    return path


def measure(path, dtype, threads, opts, prompt, gen, warm, profile=None, pin=0.0, random_input=False,
            predictor=None, uniform=None) -> dict:
    options = StoreOptions(**opts, profile=profile if pin else None, pin_hot_fraction=pin)
    t0 = time.perf_counter()
    llm = load(path, dtype=dtype, threads=threads, options=options)
    load_s = time.perf_counter() - t0
    store, net = llm.store, llm.net
    driver = None
    if uniform is not None:
        _uniform_routing(net, uniform)
    if predictor:
        from moerun.experts.predict import attach_predictor

        driver = attach_predictor(net, store, predictor)
    try:
        store.reader.drop_all(store.paths)  # the page cache must not hold the checkpoint
        cache = Cache(net.cache_spec(), 1, prompt.shape[1] + warm + gen + 1, llm.dtype)
        g = torch.Generator().manual_seed(1)
        vocab = net.args.vocab_size

        def next_input(logits):
            # random weights decode to one repeated token, and so to one repeated routing; a
            # random next token gives the varied routing a real model's text would
            if random_input:
                return torch.randint(0, vocab, (1, 1), generator=g)
            return logits[:, -1].argmax(-1, keepdim=True)

        with torch.inference_mode():
            t0 = time.perf_counter()
            tok = next_input(net(prompt, cache, last_only=True))
            prefill_s = time.perf_counter() - t0
            for _ in range(warm):
                tok = next_input(net(tok, cache, last_only=True))
            store.reset_stats()
            t0 = time.perf_counter()
            for _ in range(gen):
                tok = next_input(net(tok, cache, last_only=True))
            decode_s = time.perf_counter() - t0
        st = store.stats()
        # the experts that "ran on the device" ran on this CPU: swap their time for the modelled one
        modelled_s = decode_s - st["device_exec_s"] + st["device_exec_modelled_s"]
        return dict(
            load_s=load_s, prefill_s=prefill_s, decode_s=decode_s, decode_tok_s=gen / decode_s,
            decode_tok_s_device_modelled=gen / modelled_s if st["emulated"] else None,
            stall_share=st["stall_s"] / decode_s, rss_gib=psutil.Process().memory_info().rss / 2**30,
            profile=store.routing_profile(), **{k: v for k, v in st.items() if k != "tiers"}, tiers=st["tiers"],
        )
    finally:
        if driver is not None:
            driver.close()
        store.close()
        del llm, store, net
        gc.collect()


def _uniform_routing(net, seed: int) -> None:
    """Replace each MoE layer's choice by K distinct experts drawn uniformly (a synthetic,
    worst-case spread of routing); registered first, so predictor hooks see the drawn ids.
    Each row draws with its own seed, so a pinned set profiled in one row knows nothing of
    another row's draws."""
    from moerun.experts import StoreExperts

    g = torch.Generator().manual_seed(seed)
    for m in net.modules():
        if isinstance(m, StoreExperts):
            def hook(mod, args):
                x, ids, w = args
                drawn = torch.stack([torch.randperm(mod.num_experts, generator=g)[: ids.shape[1]] for _ in range(ids.shape[0])])
                return x, drawn, w
            m.register_forward_pre_hook(hook)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a HF directory; default: a random Qwen3-30B-A3B-shaped model")
    p.add_argument("--layers", type=int, default=4, help="layers of the random model")
    p.add_argument("--work-dir", default="/tmp/moerun-bench", help="where the random model is written")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--warmup-tokens", type=int, default=4)
    p.add_argument("--gen-tokens", type=int, default=16)
    p.add_argument("--rows", default=None, help="comma-separated row numbers (0-based) to run")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.add_argument("--routing", choices=["model", "uniform"], default="model",
                   help="the model's own routing, or K experts drawn uniformly per token and layer (synthetic)")
    p.add_argument("--decode-input", choices=["auto", "random", "argmax"], default="auto",
                   help="next decode input: random token ids (default for random-weight models) or the argmax")
    p.add_argument("--quantized", default=None,
                   help="also run the rows on a quantized checkpoint: its directory, or int4/int8 to write one")
    p.add_argument("--no-float", action="store_true", help="with --quantized: skip the float checkpoint's rows")
    a = p.parse_args()

    path = Path(a.model) if a.model else random_model(a.layers, Path(a.work_dir))
    models = [] if a.no_float and a.quantized else [("", path)]
    if a.quantized:
        q = quantized_model(a.quantized, path, Path(a.work_dir))
        policy = json.loads((q / "config.json").read_text())["quantization"]["components"]["experts"]
        models.append((f"{policy} experts: ", q))
    cfg = json.loads((path / "config.json").read_text())
    vocab = cfg.get("vocab_size", 1000)
    random_input = {"random": True, "argmax": False}.get(a.decode_input, bool(cfg.get("random_weights")))
    prompt = torch.randint(0, vocab, (1, a.prompt_tokens), generator=torch.Generator().manual_seed(0))
    rows = ROWS if a.rows is None else [ROWS[int(i)] for i in a.rows.split(",")]
    print(f"model {', '.join(str(m) for _, m in models)}; prompt {a.prompt_tokens} tokens, {a.warmup_tokens} warm-up + "
          f"{a.gen_tokens} measured decode tokens ({'random' if random_input else 'argmax'} decode inputs, {a.routing} routing); threads {a.threads or torch.get_num_threads()}",
          file=sys.stderr)
    results = []
    for tag, path in models:
        profile = None
        for label, opts, pin, predictor in rows:
            if pin and profile is None:  # a profile run of its own when the first row was skipped
                profile = measure(path, a.dtype, a.threads, {}, prompt, a.gen_tokens, a.warmup_tokens,
                                  random_input=random_input, uniform=1000 if a.routing == "uniform" else None)["profile"]
            r = measure(path, a.dtype, a.threads, opts, prompt, a.gen_tokens, a.warmup_tokens, profile, pin,
                        random_input, predictor, ROWS.index((label, opts, pin, predictor)) if a.routing == "uniform" else None)
            if profile is None:
                profile = r["profile"]
            r.pop("profile")
            r["row"] = tag + label
            results.append(r)
            if a.json:
                print(json.dumps(r), flush=True)
            else:
                print(f"  {r['row']}: {r['decode_tok_s']:.2f} tok/s, stall {100 * r['stall_share']:.0f}%, experts "
                      f"{r['experts_bytes'] / 2**20:.1f} MiB", file=sys.stderr, flush=True)
    if not a.json:
        print()
        print("| placement, policy | decode tok/s | stall share | stall s/token | expert hit rate | "
              "prefetch precision / recall | MB moved/token | device misses waited / on CPU | "
              "tok/s, device compute MODELLED | RSS GiB |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in results:
            pf = f"{r['prefetch_precision']:.2f} / {r['prefetch_recall']:.2f}" if r["prefetch_issued"] else "-"
            where = f"{r['link_waits']} / {r['cpu_executed']}" if r["emulated"] else "-"
            modelled = f"{r['decode_tok_s_device_modelled']:.2f}" if r["emulated"] else "-"
            print(f"| {r['row']} | {r['decode_tok_s']:.2f} | {100 * r['stall_share']:.0f}% | {r['stall_s_per_token']:.3f} | "
                  f"{r['expert_hit_rate']:.2f} | {pf} | {r['bytes_moved_per_token'] / 1e6:.2f} | {where} | {modelled} | "
                  f"{r['rss_gib']:.1f} |")
        if any(r["emulated"] for r in results):
            link = next(r["link"] for r in results if r["emulated"])
            print(f"\nEMULATED rows: {link}; link time only, experts still computed on the CPU (the MODELLED "
                  "column swaps the measured CPU time of the experts on the device for placement.DeviceModel's).")
            for r in results:
                if r["emulated"]:
                    d = r["tiers"]["device"]
                    print(f"  {r['row']}: the link model charged {d['link_modeled_s']:.3f} s, the link was held "
                          f"{d['link_busy_s']:.3f} s (sleep/preemption error), whole run incl. warm-up")
    return 0


if __name__ == "__main__":
    sys.exit(main())
