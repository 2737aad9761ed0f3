"""`LLM`: a loaded model with its tokenizer; the object `moerun.load()` returns."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Iterator

import torch

from .. import kernels
from ..errors import MoerunError
from ..layers.linear import native_float_linears
from .generate import GenerationStats, Sequence, run
from .sampling import SamplingParams
from ..config import read_generation_config, regular_file
from ..layers.cache import kv_cache_dtype
from ..loaders import build
from ..loaders.gguf import GGUFFile, UnsupportedTokenizer, generation_config, is_gguf, tokenizer_from_gguf
from ..loaders.hub import resolve
from ..loaders.quantized import quantize_at_load
from ..quant import compute_in_float32
from ..tokenizer import IncrementalDecoder, Tokenizer
from .speculative import SpeculativeStats, check_speculative, new_draft_length, run_speculative

log = logging.getLogger("moerun")

MTP_PREDICTORS = ("mtp", "mtp_learned", "combined")  # predictors that read the MTP head each token
DEMO_MODEL = Path(__file__).resolve().parent.parent / "demo_model"


def default_model_path() -> Path:
    if not (DEMO_MODEL / "config.json").is_file():
        raise MoerunError(f"the bundled demo model is missing from {DEMO_MODEL}; pass -m PATH")
    return DEMO_MODEL


def set_threads(threads: int | None) -> int:
    n = threads or len(os.sched_getaffinity(0))
    if n < 1:
        raise MoerunError("--threads must be at least 1")
    torch.set_num_threads(n)
    return n


def load_tokenizer(path: Path):
    """The model directory's tokenizer, None without a tokenizer.json."""

    return Tokenizer(path) if regular_file(path / "tokenizer.json") else None


def gguf_extras(path: Path):
    """(tokenizer, generation settings, why there is no tokenizer) of a GGUF file (loaders/gguf.py)."""

    f = GGUFFile(path)
    try:
        try:
            return tokenizer_from_gguf(f), generation_config(f), None
        except UnsupportedTokenizer as e:
            return None, generation_config(f), str(e)
    finally:
        f.close()


def check_vocab(tokenizer, vocab_size: int) -> None:
    """Refuse a tokenizer with token ids past the model's vocabulary: they would index past
    the embedding at the first prompt that holds one."""
    if tokenizer is None:
        return
    n = max(tokenizer.tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    if n > vocab_size:
        raise MoerunError(f"the tokenizer has token ids up to {n - 1}, but the model's vocabulary (config.json's "
                          f"vocab_size) holds {vocab_size}: tokenizer.json does not belong to this model")


def compute_dtype(net, asked, dtype: torch.dtype,
                  kv_dtype: torch.dtype | None) -> tuple[torch.dtype, torch.dtype | None]:
    """(compute dtype, KV cache dtype) of a loaded net: with dtype "auto" a quantized net
    computes in float32, the native kernels' dtype (`quant.compute_in_float32`), and its KV
    cache stays in the checkpoint's dtype unless --kv-cache says otherwise."""

    if asked == "auto" and dtype != torch.float32 and compute_in_float32(net):
        return torch.float32, kv_dtype or dtype
    return dtype, kv_dtype


class LLM:
    no_tokenizer: str | None = None  # why a file's tokenizer could not be built
    kv_dtype: torch.dtype | None = None  # KV cache storage (`Cache`): None = the model's dtype, torch.int8, ...

    def __init__(self, net, args, arch, tokenizer, path: Path, dtype: torch.dtype, generation_config: dict):
        self.net = net
        self.args = args
        self.arch = arch
        self.tokenizer = tokenizer
        self.path = path
        self.dtype = dtype
        self.generation_config = generation_config
        self.last_stats = GenerationStats()
        kernels.split_threads(net)  # torch's small decode ops on one thread while native kernels run
        native_float_linears(net)  # ... and each plain float linear's few-row calls one native call

    @classmethod
    def load(cls, path=None, dtype="auto", threads: int | None = None, quant: str | None = None,
             kv_cache: str = "auto", check_weights: bool = False, populate: bool = False) -> "LLM":
        """quant: None/"none" keeps the checkpoint's weights; a `moerun.quant.POLICIES` name
        ("int4-q6k", the default policy: routed experts and attention int4, shared experts int8,
        head Q6_K; "int4": attention/shared experts/head int8; "int8", "int4-all", "int4-kq",
        "kq") or a QuantPolicy quantizes at load, unless the
        checkpoint was already written quantized by `moerun quantize`. dtype "auto": the
        checkpoint's, except that a quantized net computes in float32 (`compute_in_float32`).
        kv_cache: "auto" (the checkpoint's dtype), "int8" (per-token, per-head scales) or a
        float dtype name. check_weights: first scan every float tensor for NaN and Inf (reads
        the whole checkpoint; `loaders.hf.check_finite`). populate: fault in the file pages the
        net reads through its memory maps now rather than in the first prompt (`loaders.populate`;
        skipped when they do not fit in available memory). Off by default: measured, it cost
        load time and did not make the first prompt faster (docs/benchmarks.md, 2026-12-03)."""

        kv_dtype = kv_cache_dtype(kv_cache)


        path = default_model_path() if path is None else resolve(path)  # org/name: the Hugging Face cache
        set_threads(threads)
        asked = dtype
        # the small files first, and the vocabularies compared before any weight is read
        if is_gguf(path):  # one file holds the tokenizer, the end-of-text ids and the weights
            tokenizer, gen, no_tokenizer = gguf_extras(path)
        else:
            no_tokenizer = None
            tokenizer = load_tokenizer(path)
            gen = read_generation_config(path)
        arch, args, net, dtype = build(path, dtype, prepare=lambda net: check_vocab(tokenizer, net.args.vocab_size),
                                       check_weights=check_weights)
        if quant not in (None, "none"):

            quantize_at_load(net, path, quant)
        if populate:
            from ..loaders.populate import populate as populate_pages

            done = populate_pages(net)
            log.debug("populate: %s", done)
        dtype, kv_dtype = compute_dtype(net, asked, dtype, kv_dtype)
        llm = cls(net, args, arch, tokenizer, path, dtype, gen)
        llm.kv_dtype = kv_dtype
        llm.no_tokenizer = no_tokenizer
        return llm

    @property
    def model_type(self) -> str:
        return self.args.model_type

    @property
    def context_length(self) -> int:
        return self.args.max_position_embeddings

    # -- tokens --------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """LongTensor [B, T] -> FloatTensor [B, T, vocab]; one pass, no cache."""
        with torch.inference_mode():
            return self.net(input_ids).float()

    def eos_ids(self) -> set[int]:
        ids: set[int] = set()
        gen_eos = self.generation_config.get("eos_token_id")
        if isinstance(gen_eos, int):
            ids.add(gen_eos)
        elif isinstance(gen_eos, list):
            ids.update(int(i) for i in gen_eos)
        if self.tokenizer is not None:
            tid = self.tokenizer.token_id(self.tokenizer.eos_token)
            if tid is not None:
                ids.add(tid)
        return ids

    def _tokenizer(self):
        if self.tokenizer is None:
            raise MoerunError(self.no_tokenizer or f"{self.path} has no tokenizer.json; text generation needs one")
        return self.tokenizer

    def encode_prompt(self, prompt: str | list[dict[str, Any]]) -> list[int]:
        tok = self._tokenizer()
        if isinstance(prompt, str):
            return tok.encode(prompt)
        if isinstance(prompt, list):
            return tok.encode_chat(prompt)  # contents as plain text: no special tokens from users
        raise MoerunError("a prompt is a string or a list of chat messages")

    def sampling_params(self, **overrides) -> SamplingParams:
        """Sampling settings: the model's generation_config.json, then explicit overrides."""
        g = self.generation_config
        base: dict[str, Any] = {}
        if g.get("do_sample"):
            for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty"):
                if g.get(k) is not None:
                    base[k] = g[k]
        base.update({k: v for k, v in overrides.items() if v is not None})
        return SamplingParams(**base)

    def _check_length(self, ids: list[int], params: SamplingParams) -> SamplingParams:
        if not ids:
            raise MoerunError("the prompt is empty")
        ctx = self.context_length
        if len(ids) >= ctx:
            raise MoerunError(f"the prompt has {len(ids)} tokens; the context window holds {ctx}")
        if len(ids) + params.max_tokens > ctx:
            if not self.__dict__.get("_said_cut"):  # once per model: a batch or a chat would repeat it
                self._said_cut = True
                log.warning("max_tokens %d cut to %d: the prompt's %d tokens and the context window of %d leave no more",
                            params.max_tokens, ctx - len(ids), len(ids), ctx)
            params = SamplingParams(**{**params.__dict__, "max_tokens": ctx - len(ids)})
        return params

    def _mtp_prefetch(self):
        """The MTP-driven prefetcher's per-token call, when one drives the expert store."""
        driver = getattr(self, "predictor", None)
        if driver is None or not getattr(self.net, "has_mtp", False):
            return None
        if getattr(driver, "uses_draft", False):  # lookahead_mtp: the head's draft for the next token's layer 0
            return driver.mtp_draft
        if getattr(driver, "name", None) not in MTP_PREDICTORS:
            return None
        return driver.mtp_step

    def _run(self, seqs: list[Sequence], speculative: str | None, draft_tokens: int | str,
             draft_vocab: int | None = None) -> Iterator[tuple[int, str]]:
        """The plain loop, or MTP speculative decoding (engine/speculative.py) when asked."""
        if speculative is None:
            self.last_stats = GenerationStats()
            return run(self.net, seqs, self.eos_ids(), self.dtype, self.last_stats, after_sample=self._mtp_prefetch(),
                       kv_dtype=self.kv_dtype)

        check_speculative(self.net, speculative)
        self.last_stats = SpeculativeStats()
        if draft_tokens == "auto" and getattr(self, "_draft_length", None) is None:
            self._draft_length = new_draft_length(self.net)  # learns acceptance and step costs across calls
        chooser = self._draft_length if draft_tokens == "auto" else None
        return run_speculative(self.net, seqs, self.eos_ids(), self.dtype, self.last_stats, draft_tokens, chooser=chooser,
                               kv_dtype=self.kv_dtype, draft_vocab=draft_vocab)

    def generate_ids(self, prompts: list[list[int]], speculative: str | None = None, draft_tokens: int | str = 1,
                     draft_vocab: int | None = None, **sampling) -> list[list[int]]:
        """Token-level batch generation (no text, no stop strings): continuation ids per prompt."""
        seqs = []
        for ids in prompts:
            params = self._check_length(list(ids), self.sampling_params(**sampling))
            seqs.append(Sequence(list(ids), params))
        for _ in self._run(seqs, speculative, draft_tokens, draft_vocab):
            pass
        return [s.out_ids for s in seqs]

    def probe_decode_path(self, rows: int = 1) -> dict:
        """How this model's decode steps run (`layers.stack.decode_path`), found by running
        them: `rows` one-token prompts, then three greedy steps (the run's decode program is
        built before them: each takes the native stack where it applies). For `moerun info`;
        costs a few tokens' compute."""
        stats = GenerationStats()
        seqs = [Sequence([0], self.sampling_params(max_tokens=4, temperature=0.0)) for _ in range(rows)]
        for _ in run(self.net, seqs, set(), self.dtype, stats, kv_dtype=self.kv_dtype):
            pass
        return stats.decode_path

    # -- text ----------------------------------------------------------------
    def _sequences(self, prompts, sampling) -> list[Sequence]:

        seqs = []
        for p in prompts:
            ids = self.encode_prompt(p)
            params = self._check_length(ids, self.sampling_params(**sampling))
            seqs.append(Sequence(ids, params, decoder=IncrementalDecoder(self._tokenizer(), ids)))
        return seqs

    def generate(self, prompt: str | list[dict[str, Any]], speculative: str | None = None, draft_tokens: int | str = 1,
                 draft_vocab: int | None = None, **sampling) -> Iterator[str]:
        """Yield text pieces continuing `prompt` (a string, or chat messages).

        Keyword arguments: max_tokens, temperature, top_k, top_p, min_p,
        repetition_penalty, seed, stop; speculative="mtp" drafts with the checkpoint's MTP
        head, draft_tokens 1..4 or "auto" per step, draft_vocab N: drafts among the first N
        token ids only (engine/speculative.py).
        """
        seqs = self._sequences([prompt], sampling)
        for _, piece in self._run(seqs, speculative, draft_tokens, draft_vocab):
            yield piece

    def generate_batch(self, prompts: list, speculative: str | None = None, draft_tokens: int | str = 1,
                       draft_vocab: int | None = None, **sampling) -> list[str]:
        """Continue several prompts together (decoded as one batch); returns their texts."""
        seqs = self._sequences(prompts, sampling)
        for _ in self._run(seqs, speculative, draft_tokens, draft_vocab):
            pass
        return [s.text for s in seqs]
