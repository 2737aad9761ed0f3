"""Parity with llama.cpp on the same GGUF file (issue 36, item 5).

    python benchmarks/gguf_parity.py [--windows 16] [--threads 1] [--precision] [--json out.json]

The demo model (moerun/demo_model) is exported with `moerun export-gguf` as BF16, Q8_0 and
Q4_K_M, and the BF16 export is also quantized to Q4_K_M by llama.cpp's own `llama-quantize`
(the file users hold). For each file, both engines are scored identically on the same
token ids: the demo model's held-out windows (`tools.train.evaluate.heldout_windows`, the
ones `quant_perplexity.py` uses; 256 tokens each, every position scored, no BOS: the demo
tokenizer adds none), llama.cpp's logits taken through its ctypes interface
(`llamacpp.Session`), moerun's from `llm.net`. Per file:

- perplexity in each engine and the relative gap (target within 0.5%);
- top-1 agreement: the share of scored positions where both argmaxes agree (target >= 99%);
- greedy text: 10 held-out prompts (one at a time), each engine tokenizing the text with the file's own
  tokenizer, 32 tokens by argmax through each engine's KV cache (moerun's plain decode loop;
  and moerun's MTP speculative decoding, which reads the file's nextn layer); identical
  continuations counted (target >= 9 of 10).

Both engines run as their users get them: llama.cpp with its defaults (f16 KV cache, flash
attention auto, which on CPU means on), moerun with `dtype auto` (bf16 activations for a
BF16 file, float32 beside quantized weights). `--precision` adds the rows that separate
legitimate precision differences from the rest: llama.cpp with an f32 KV cache and flash
attention off (llama.cpp casts an f32 cache to f16 for flash attention, so both are needed),
and moerun in float32 on the BF16 file.

`--explain` reproduces the 1.3% gap of an earlier measurement: `llama-perplexity` on a text
file (held-out text, or --ppl-text FILE) with -c 128, against moerun's logits scored on
llama-perplexity's positions (n_ctx/2 .. n_ctx-2 of each chunk, 63 per chunk), on one
position more per chunk (64: the earlier script's window) and on all positions.

Needs the corpus (scripts/fetch_corpus.sh) and the native llama.cpp build
(`python benchmarks/llamacpp.py build`). Exports go to --workdir and are reused.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tools/ is not installed
sys.path.insert(0, str(Path(__file__).resolve().parent))

import llamacpp  # noqa: E402

import moerun  # noqa: E402

FORMATS = ("bf16", "q8_0", "q4_k_m", "llama-q4_k_m")


class Fail(Exception):
    pass


def export_files(model: Path, workdir: Path, formats) -> dict[str, Path]:
    """The demo model's GGUF files, made once: moerun's exports, and llama-quantize's Q4_K_M
    made from moerun's BF16 export."""
    from moerun.loaders.gguf_write import export

    workdir.mkdir(parents=True, exist_ok=True)
    out = {}
    for fmt in formats:
        if fmt == "llama-q4_k_m":
            continue
        p = workdir / f"demo-{fmt}.gguf"
        if not p.is_file():
            export(model, p, fmt)
        out[fmt] = p
    if "llama-q4_k_m" in formats:
        src = workdir / "demo-bf16.gguf"
        if not src.is_file():
            export(model, src, "bf16")
        p = workdir / "demo-llama-q4_k_m.gguf"
        if not p.is_file():
            tmp = p.with_suffix(".tmp")
            r = subprocess.run([str(llamacpp.tool("llama-quantize")), str(src), str(tmp), "Q4_K_M", "1"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # its log is not all UTF-8
            if r.returncode != 0:
                raise Fail(f"llama-quantize failed (exit {r.returncode})")
            tmp.rename(p)
        out["llama-q4_k_m"] = p
    return {f: out[f] for f in formats}


def heldout(model: Path, corpus: Path, seq_len: int, windows: int):
    from tools.train.corpus import read_documents
    from tools.train.evaluate import heldout_windows

    if not (corpus / "heldout.jsonl").is_file():
        raise Fail(f"no held-out corpus at {corpus}/heldout.jsonl; run scripts/fetch_corpus.sh")
    w, _ = heldout_windows(model, corpus, seq_len, windows)
    return w, read_documents(corpus / "heldout.jsonl")


def prompts_from(docs: list[str], n: int, chars: int = 160) -> list[str]:
    """n prompts: the opening of n held-out documents evenly spaced, cut at a line end."""
    picks = [docs[i] for i in np.linspace(0, len(docs) - 1, n).round().astype(int)]
    out = []
    for d in picks:
        d = d.lstrip()
        cut = d.rfind("\n", 0, chars)
        out.append(d[: cut + 1 if cut > chars // 3 else chars])
    return out


def score(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(summed NLL, argmax) of logits [T, V] against targets [T]."""
    return F.cross_entropy(logits, targets, reduction="sum").item(), logits.argmax(-1)


def moerun_logits(llm, windows: torch.Tensor) -> list[torch.Tensor]:
    out = []
    with torch.inference_mode():
        for w in windows:
            out.append(llm.net(w[None, :-1]).float()[0])
    return out


def llama_logits(path: Path, windows: torch.Tensor, threads: int, kv_type=None, flash_attn=None) -> list[torch.Tensor]:
    n = windows.shape[1]
    with llamacpp.Session(path, n_ctx=n, threads=threads, kv_type=kv_type, flash_attn=flash_attn) as s:
        return [torch.from_numpy(s.logits(w[:-1].tolist())) for w in windows]


def compare(lm: list[torch.Tensor], ll: list[torch.Tensor], windows: torch.Tensor) -> dict:
    nm = nl = 0.0
    agree = n = 0
    for a, b, w in zip(lm, ll, windows):
        t = w[1:]
        x, am = score(a, t)
        y, bm = score(b, t)
        nm, nl = nm + x, nl + y
        agree += int((am == bm).sum())
        n += len(t)
    pm, pl = math.exp(nm / n), math.exp(nl / n)
    return {"ppl_moerun": pm, "ppl_llamacpp": pl, "gap_pct": 100 * (pm / pl - 1), "top1_pct": 100 * agree / n,
            "positions": n}


def until_eog(ids: list[int], eog: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eog:
            return ids[: i + 1]
    return ids


def greedy(path: Path, llm, prompts: list[str], n: int, threads: int, kv_type=None, flash_attn=None) -> dict:
    greedy_kw = dict(max_tokens=n, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
    eog = set(llm.eos_ids())
    with llamacpp.Session(path, n_ctx=512, threads=threads, kv_type=kv_type, flash_attn=flash_attn) as s:
        eog_l = eog | {t for t in range(s.n_vocab) if s.ll.llama_vocab_is_eog(s.vocab, t)}
        toks_l = [s.tokenize(p) for p in prompts]
        out_l = [until_eog(s.greedy(t, n), eog_l) for t in toks_l]
    toks_m = [llm.encode_prompt(p) for p in prompts]
    # one prompt at a time, as `moerun generate` runs one (llama.cpp's side runs them alone too)
    out_m = [until_eog(llm.generate_ids([t], **greedy_kw)[0], eog) for t in toks_m]
    out_s = [until_eog(llm.generate_ids([t], speculative="mtp", draft_tokens=2, **greedy_kw)[0], eog)
             for t in toks_m] if getattr(llm.net, "has_mtp", False) else None
    first_diff = []
    for a, b in zip(out_m, out_l):
        first_diff.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b))))
    return {"prompt_tokens_equal": sum(a == b for a, b in zip(toks_m, toks_l)),
            "identical": sum(a == b for a, b in zip(out_m, out_l)),
            "identical_mtp": None if out_s is None else sum(a == b for a, b in zip(out_s, out_l)),
            "mtp_equals_plain": None if out_s is None else sum(a == b for a, b in zip(out_s, out_m)),
            "first_diff": first_diff, "n": len(prompts)}


def tokenizer_check(path: Path, llm, docs: list[str]) -> dict:
    with llamacpp.Session(path, n_ctx=64, threads=1) as s:
        same = sum(s.tokenize(d) == llm.encode_prompt(d) for d in docs)
    return {"documents": len(docs), "identical": same}


def explain(path: Path, llm, docs: list[str], text_file: Path | None, threads: int, chunks: int = 4, n_ctx: int = 128) -> dict:
    """llama-perplexity's figure against moerun's on the same text and chunking, scored on
    three sets of positions."""
    tmp = None
    if text_file is None:
        tmp = tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False)
        tmp.write("\n\n".join(docs))
        tmp.close()
        text_file = Path(tmp.name)
    try:
        tool = llamacpp.perplexity_tool(path, text_file, n_ctx=n_ctx, chunks=chunks, threads=threads)
        text = text_file.read_text()
        with llamacpp.Session(path, n_ctx=n_ctx, threads=threads) as s:
            lt = s.tokenize(text)
            mt = llm.encode_prompt(text)
            res = {"llama_perplexity": tool["ppl"], "tokens_equal": lt == mt, "n_tokens": len(lt)}
            rows = {}
            for name, first in (("llama-perplexity's positions (n_ctx/2 .. n_ctx-2)", n_ctx // 2),
                                ("one position more (n_ctx/2-1 .. n_ctx-2)", n_ctx // 2 - 1),
                                ("all positions (0 .. n_ctx-2)", 0)):
                tot = {"m": 0.0, "l": 0.0, "n": 0}
                for c in range(chunks):
                    w = lt[c * n_ctx:(c + 1) * n_ctx]
                    with torch.inference_mode():
                        a = llm.net(torch.tensor([w])).float()[0]
                    b = torch.from_numpy(s.logits(w))
                    t = torch.tensor(w[first + 1:])
                    tot["m"] += F.cross_entropy(a[first:-1], t, reduction="sum").item()
                    tot["l"] += F.cross_entropy(b[first:-1], t, reduction="sum").item()
                    tot["n"] += len(t)
                rows[name] = {"moerun": math.exp(tot["m"] / tot["n"]), "llamacpp_ctypes": math.exp(tot["l"] / tot["n"]),
                              "positions": tot["n"]}
            res["rows"] = rows
            return res
    finally:
        if tmp is not None:
            os.unlink(tmp.name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(Path(moerun.__file__).parent / "demo_model"))
    ap.add_argument("--corpus", default=str(ROOT / "data" / "corpus"))
    ap.add_argument("--workdir", default="/var/tmp/moerun-gguf-parity", help="where the GGUF files are made and kept")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    ap.add_argument("--windows", type=int, default=16, help="held-out windows scored")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--gen", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--precision", action="store_true",
                    help="add llama.cpp with an f32 KV cache and flash attention off, and moerun float32 on BF16")
    ap.add_argument("--explain", action="store_true", help="llama-perplexity's own figure against moerun's (BF16 file)")
    ap.add_argument("--ppl-text", help="text file for --explain (default: the held-out documents)")
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args(argv)
    formats = [f for f in a.formats.split(",") if f]
    bad = [f for f in formats if f not in FORMATS]
    try:
        if bad:
            raise Fail(f"unknown format {bad[0]!r}; choose from {', '.join(FORMATS)}")
        stamp = llamacpp.require_built()
        torch.set_num_threads(a.threads)
        windows, docs = heldout(Path(a.model), Path(a.corpus), a.seq_len, a.windows)
        prompts = prompts_from(docs, a.prompts)
        files = export_files(Path(a.model), Path(a.workdir), formats)
    except (Fail, llamacpp.BuildError, OSError) as e:
        print(f"gguf_parity: {e}", file=sys.stderr)
        return 1
    print(f"llama.cpp {stamp.get('version')} (commit {stamp.get('llama_cpp_commit', '?')[:10]}), "
          f"CPU {llamacpp.cpu_model()}, {a.threads} thread(s)")
    print(f"held-out: {len(windows)} windows x {a.seq_len} tokens ({len(windows) * (a.seq_len - 1)} scored positions); "
          f"greedy: {len(prompts)} prompts x {a.gen} tokens")
    results = {"windows": len(windows), "seq_len": a.seq_len, "rows": []}
    for fmt, path in files.items():
        t0 = time.time()
        configs = [("auto", None, None)]
        if a.precision:
            configs.append(("auto", "f32", False))
            if fmt == "bf16":
                configs += [("float32", None, None), ("float32", "f32", False)]
        cache_l = {}
        for dtype, kv, fa in configs:
            llm = moerun.load(path, threads=a.threads, dtype=dtype)
            lm = moerun_logits(llm, windows)
            if (kv, fa) not in cache_l:
                cache_l[(kv, fa)] = llama_logits(path, windows, a.threads, kv, fa)
            row = {"format": fmt, "moerun_dtype": dtype if dtype != "auto" else f"auto ({str(llm.dtype).split('.')[-1]})",
                   "llamacpp_kv": "f16, fa auto" if kv is None else f"{kv}, fa {'on' if fa else 'off'}",
                   **compare(lm, cache_l[(kv, fa)], windows),
                   **{f"greedy_{k}": v for k, v in greedy(path, llm, prompts, a.gen, a.threads, kv, fa).items()}}
            if fmt == "bf16" and (dtype, kv) == ("auto", None):
                row["tokenizer"] = tokenizer_check(path, llm, docs)
            results["rows"].append(row)
            print(f"  {fmt} moerun {row['moerun_dtype']} / llama.cpp KV {row['llamacpp_kv']}: {time.time() - t0:.0f} s",
                  file=sys.stderr)
    print()
    print("| file | moerun dtype | llama.cpp KV | ppl moerun | ppl llama.cpp | gap | top-1 agree | greedy identical | greedy, moerun MTP speculative |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        mtp = "-" if r["greedy_identical_mtp"] is None else f"{r['greedy_identical_mtp']}/{r['greedy_n']}"
        print(f"| {r['format']} | {r['moerun_dtype']} | {r['llamacpp_kv']} | {r['ppl_moerun']:.3f} | {r['ppl_llamacpp']:.3f} | "
              f"{r['gap_pct']:+.3f}% | {r['top1_pct']:.2f}% | {r['greedy_identical']}/{r['greedy_n']} | {mtp} |")
    for r in results["rows"]:
        if "tokenizer" in r:
            t = r["tokenizer"]
            print(f"\ntokenizer (BF16 file): {t['identical']}/{t['documents']} held-out documents tokenize identically "
                  f"in both engines; greedy prompts: {r['greedy_prompt_tokens_equal']}/{r['greedy_n']} identical")
    for r in results["rows"]:
        if r["greedy_mtp_equals_plain"] is not None and r["greedy_mtp_equals_plain"] < r["greedy_n"]:
            print(f"{r['format']} ({r['moerun_dtype']}): moerun's MTP speculative greedy equals its plain greedy on "
                  f"{r['greedy_mtp_equals_plain']}/{r['greedy_n']} prompts")
    for r in results["rows"]:
        if r["greedy_identical"] < r["greedy_n"]:
            print(f"{r['format']} ({r['moerun_dtype']}, {r['llamacpp_kv']}): greedy first differing token per prompt: "
                  f"{r['greedy_first_diff']}")
    if a.explain and "bf16" in files:
        llm = moerun.load(files["bf16"], threads=a.threads)
        e = explain(files["bf16"], llm, docs, Path(a.ppl_text) if a.ppl_text else None, a.threads)
        results["explain"] = e
        print(f"\nllama-perplexity -c 128 --chunks 4 on {a.ppl_text or 'the held-out text'} (BF16 file): "
              f"PPL = {e['llama_perplexity']:.4f}; {e['n_tokens']} tokens, the two tokenizers "
              f"{'agree' if e['tokens_equal'] else 'DIFFER'}")
        print("| scored positions | moerun | llama.cpp (ctypes) | gap |\n|---|---|---|---|")
        for name, r in e["rows"].items():
            print(f"| {name}, {r['positions']} | {r['moerun']:.2f} | {r['llamacpp_ctypes']:.2f} | "
                  f"{100 * (r['moerun'] / r['llamacpp_ctypes'] - 1):+.2f}% |")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
