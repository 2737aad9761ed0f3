"""By hand (not a test: it needs the native llama.cpp of benchmarks/llamacpp.py): a GGUF
file's SentencePiece ('llama') tokenizer in moerun against llama.cpp's own (llm_tokenizer_spm,
through libllama's llama_tokenize / llama_detokenize, the vocabulary loaded alone).

The vocabularies are the test's (tests/test_gguf_spm_tokenizer.py: sentencepiece BPE and
unigram models trained there on a multilingual, code-heavy text), or any GGUF file given with
--gguf. The texts: the test's text, its lines, edge cases, special and user-defined tokens'
texts among words, and random strings made of the vocabulary's own pieces and rare
characters (where merge order and byte fallback are stressed). Prints how many texts give the
same ids, and the same decoded text, and the first differences.

    python benchmarks/spm_tokenizer_vs_llamacpp.py [--gguf FILE] [--random 2000]
"""

from __future__ import annotations

import argparse
import ctypes
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import llamacpp  # noqa: E402

from moerun.loaders.gguf import GGUFFile, tokenizer_from_gguf  # noqa: E402


class LlamaVocab:
    """A GGUF file's vocabulary in libllama (vocab_only: no weights)."""

    def __init__(self, path: Path):
        self.ll = ll = llamacpp.import_llama_cpp_lowlevel()
        quiet = ll.llama_log_callback(lambda level, text, user: None)
        ll.llama_log_set(quiet, ctypes.c_void_p(0))
        self._quiet = quiet
        ll.llama_backend_init()
        p = ll.llama_model_default_params()
        p.vocab_only = True
        self.model = ll.llama_model_load_from_file(str(path).encode(), p)
        if not self.model:
            raise SystemExit(f"libllama could not load {path}")
        self.vocab = ll.llama_model_get_vocab(self.model)

    def tokenize(self, text: str, add_special=True, parse_special=True) -> list[int]:
        raw = text.encode()
        n = len(raw) + 8
        buf = (self.ll.llama_token * n)()
        k = self.ll.llama_tokenize(self.vocab, raw, len(raw), buf, n, add_special, parse_special)
        if k < 0:
            buf = (self.ll.llama_token * -k)()
            k = self.ll.llama_tokenize(self.vocab, raw, len(raw), buf, -k, add_special, parse_special)
        return list(buf[:k])

    def detokenize(self, ids: list[int]) -> str:
        arr = (self.ll.llama_token * max(len(ids), 1))(*ids)
        n = 64 + 16 * len(ids)
        buf = ctypes.create_string_buffer(n)
        k = self.ll.llama_detokenize(self.vocab, arr, len(ids), buf, n, False, False)
        return buf.raw[:k].decode("utf-8", errors="replace")


def texts(tokens: list[str], n_random: int, seed: int = 0) -> list[str]:
    from test_gguf_spm_tokenizer import CORPUS, TEXT

    out = [TEXT, CORPUS] + TEXT.splitlines(keepends=True) + CORPUS.splitlines(keepends=True)
    out += ["", " ", "   ", "\n", "\t", "a", " a", "🦊", "  \n  x  ", "<0x41>", "s>", "\u2581x", "x\u2581\u2581y"]
    out += ["<s>Hello</s>", "<s>[INST] hi [/INST]", "a<tool>b</tool> c", "<tool>x", "x </tool>", "</s></s>x"]
    rng = random.Random(seed)
    pieces = [t.replace("\u2581", " ") for t in tokens if not t.startswith("<")] or ["a"]
    rare = "龘𝔘🦊é\t\n  ∮ä\u00a0\u200b"
    for _ in range(n_random):
        k = rng.randint(1, 12)
        out.append("".join(rng.choice(pieces) if rng.random() < 0.85 else rng.choice(rare) for _ in range(k)))
    return out


def compare(path: Path, n_random: int, sp=None) -> None:
    """`sp`: the sentencepiece model the file was written from, also compared (on the texts
    without special or user-defined tokens' texts, which sentencepiece reads as plain text)."""
    f = GGUFFile(path)
    try:
        tok = tokenizer_from_gguf(f)
        tokens = f.get("tokenizer.ggml.tokens", "list[str]")
    finally:
        f.close()
    lv = LlamaVocab(path)
    all_texts = texts(tokens, n_random)
    same_ids = same_text = 0
    shown = 0
    for t in all_texts:
        a, b = tok.encode(t), lv.tokenize(t)
        if a == b:
            same_ids += 1
        elif shown < 5:
            shown += 1
            print(f"  ids differ on {t!r}:\n    moerun   {[tokens[i] for i in a]}\n    llama.cpp {[tokens[i] for i in b]}")
        ids = b[1:] if b[:1] == [lv.ll.llama_vocab_bos(lv.vocab)] else b
        da, db = tok.decode(ids), lv.detokenize(ids)
        if da == db:
            same_text += 1
        elif shown < 5:
            shown += 1
            print(f"  decoding differs on {t!r}: moerun {da!r}, llama.cpp {db!r}")
    print(f"{path.name}: {len(tokens)} tokens; same ids as llama.cpp on {same_ids}/{len(all_texts)} texts, "
          f"same decoded text on {same_text}/{len(all_texts)}")
    if sp is not None:
        plain = [t for t in all_texts if not any(m in t for m in ("<s>", "</s>", "<unk>", "<tool>", "</tool>"))]
        same = sum(tok.encode(t, add_special_tokens=False) == sp.encode(t) for t in plain)
        print(f"  same ids as sentencepiece's own encoding on {same}/{len(plain)} texts")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, help="a GGUF file (default: the test's trained vocabularies)")
    ap.add_argument("--random", type=int, default=2000, help="random texts made of the vocabulary's pieces")
    args = ap.parse_args(argv)
    if args.gguf:
        compare(args.gguf, args.random)
        return 0
    from test_gguf_spm_tokenizer import train, write_gguf

    with tempfile.TemporaryDirectory() as d:
        for name, sp in (("bpe", train()), ("unigram", train("unigram", vocab_size=540))):
            compare(write_gguf(sp, Path(d) / f"{name}.gguf", arch_keys=True), args.random, sp)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
