"""`moerun` command line: generate, chat, info, bench, quantize, export-gguf, random-model, pull.

Every failure is one line on stderr and a non-zero exit; `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import logging
import json
import os
import sys


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not a usage block
        words = self.prog.split()
        see = "moerun --help" if len(words) == 1 else f"moerun {words[-1]} --help"
        self.exit(2, f"moerun: error: {message} (see {see})\n")


def _common(p: argparse.ArgumentParser, model=True) -> None:
    if model:
        p.add_argument("-m", "--model", default=None,
                       help="Hugging Face model directory, GGUF file, or org/name[:FILE.gguf|:QUANT] from the "
                            "Hugging Face cache (see moerun pull; default: the bundled demo model)")
        p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="weight and activation dtype")
        p.add_argument("--quant", default="none", choices=["none", "int4", "int8", "int4-all", "int4-q6k", "int4-kq", "kq"],
                       help="quantize at load: int4-q6k (moerun quantize's default) = routed experts and attention "
                            "int4, shared experts int8, head Q6_K; int4 = routed experts int4, attention/shared/head "
                            "int8; int4-kq, kq with llama.cpp's K-quants (moerun.quant.POLICIES)")
        p.add_argument("--kv-cache", default="auto", help="KV cache storage: auto (the model's dtype), int8 (per-token, "
                       "per-head scales), float32, bfloat16 or float16")
        p.add_argument("--check-weights", action="store_true",
                       help="read every weight before use and refuse NaN or infinite values (a full pass over the files)")
        p.add_argument("--populate", action="store_true",
                       help="page in, at load, the file pages the weights are read from (as llama.cpp's "
                            "MAP_POPULATE; when they fit in available memory; not with the expert store)")
        s = p.add_argument_group("expert store (routed experts in tiers: device / RAM / disk)")
        s.add_argument("--ram-budget", default=None, help="bytes of routed experts kept in RAM, e.g. 4GiB, 30%% or auto (free RAM less the other weights and a margin); the rest stream from disk")
        s.add_argument("--vram-budget", default=None, help="bytes of routed experts on the device tier (CUDA, or emulated with --emulate-link)")
        s.add_argument("--cache-policy", default=None, choices=["lru", "lfu", "prediction", "prediction-lfu"],
                       help="what the RAM and device tiers keep (default lru)")
        s.add_argument("--pin-hot", type=int, default=None, help="never evict the N most used experts per layer")
        s.add_argument("--pin-hot-fraction", type=float, default=None, help="the same, as a share of each layer's experts")
        s.add_argument("--emulate-link", default=None, help="emulated device link: pcie4, pcie5 or 'GB/s,us' (figures are EMULATED)")
        s.add_argument("--execute", default=None, choices=["auto", "device", "cpu"],
                       help="a device miss waits for the link (device, default), runs on the CPU (cpu), or a cost model picks (auto)")
        s.add_argument("--predictor", default=None, help="drive the prefetcher with a predictor (temporal, layer_ahead1, lookahead, lookahead_mtp, ...)")
        s.add_argument("--predictor-trace", default=None, help="routing trace that fits the predictor (frequency, mtp_learned, ...)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all available cores)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def _sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"tokens to generate at most (default {DEFAULT_MAX_TOKENS}; cut to fit the context, said once when given)")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the model's generation_config, else greedy)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=None, help="sample among the likeliest tokens holding this much probability")
    p.add_argument("--min-p", type=float, default=None, help="drop tokens below this share of the likeliest one's probability")
    p.add_argument("--repetition-penalty", type=float, default=None, help="divide the logits of tokens already seen by this (1: none)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampler, for reproducible sampled text")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


DEFAULT_MAX_TOKENS = 128


def _sampling_kwargs(a) -> dict:
    return dict(
        max_tokens=DEFAULT_MAX_TOKENS if a.max_tokens is None else a.max_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
        min_p=a.min_p, repetition_penalty=a.repetition_penalty, seed=a.seed, stop=tuple(a.stop or ()),
    )


STORE_FLAGS = ("ram_budget", "vram_budget", "cache_policy", "pin_hot", "pin_hot_fraction", "emulate_link", "execute")


def _load(a):
    llm = _load_model(a)
    if "max_tokens" in vars(a) and a.max_tokens is None:
        llm._said_cut = True  # the default --max-tokens is fitted to the context without a word
    return llm


def _check_flags(a) -> None:
    """The values of the command's flags, checked before any weight loads (a large model
    takes minutes to load; a typo must not wait for it)."""
    from pathlib import Path

    from .errors import MoerunError

    if "max_tokens" in vars(a):  # generate and chat: the sampling flags
        from .engine.sampling import SamplingParams

        SamplingParams(**{k: v for k, v in _sampling_kwargs(a).items() if v is not None})
    if "speculative" in vars(a):
        _spec_kwargs(a)
    if getattr(a, "predictor", None):
        from .experts.predict import check_name

        check_name(a.predictor)
    if getattr(a, "predictor_trace", None):
        if not a.predictor:
            raise MoerunError("--predictor-trace fits a predictor: give --predictor too")
        if not Path(a.predictor_trace).is_file():
            raise MoerunError(f"--predictor-trace {a.predictor_trace} is not a file")
    if "gen_tokens" in vars(a) and (a.prompt_tokens < 1 or a.gen_tokens < 1):  # bench
        raise MoerunError("--prompt-tokens and --gen-tokens must be at least 1")
    if "reps" in vars(a) and a.reps < 1:  # bench
        raise MoerunError(f"--reps must be at least 1, not {a.reps}")
    _check_store_flags(a)
    _check_model(a)


def _check_store_flags(a) -> None:
    """The expert store's flags that cannot go together (the store refuses them too, once the
    experts' bytes are known, for callers of the Python API)."""
    from .errors import MoerunError
    from .experts.store import StoreOptions, parse_budget

    given = {k: getattr(a, k) for k in STORE_FLAGS if getattr(a, k, None) is not None}
    StoreOptions(**given)  # the spelling
    if getattr(a, "populate", False) and given:
        raise MoerunError("--populate pages in the weights' file maps; the expert store reads its experts "
                          "itself: give one or the other")
    vram = getattr(a, "vram_budget", None) is not None and parse_budget(a.vram_budget, 1 << 60, "--vram-budget") > 0
    if getattr(a, "emulate_link", None) and not vram:
        raise MoerunError("--emulate-link needs a device tier: give --vram-budget too")
    if getattr(a, "execute", None) not in (None, "device") and not vram:
        raise MoerunError(f"--execute {a.execute} places device misses, so it needs a device tier "
                          "(--vram-budget, with --emulate-link pcie4 without a GPU)")
    if vram and not a.emulate_link:
        import torch

        if not torch.cuda.is_available():
            raise MoerunError("--vram-budget needs a CUDA GPU; without one, add --emulate-link pcie4 to emulate it")


TEXT_COMMANDS = ("generate", "chat", "serve")


def _check_model(a) -> None:
    """What the model's small files tell, checked before any weight loads (a 30B model takes
    minutes to load): a command that writes text needs a tokenizer (chat, a chat template
    too), and --speculative mtp a model with an MTP head. This builds the tokenizer once more
    (a fraction of a second) and the model on the meta device (no weight read)."""
    from pathlib import Path

    from .engine.llm import default_model_path
    from .engine.speculative import check_speculative

    text = a.command in TEXT_COMMANDS
    if not text and not getattr(a, "speculative", None):
        return
    path = default_model_path() if a.model is None else Path(a.model)
    if text:
        _check_tokenizer(path, chat=a.command == "chat")
    if getattr(a, "speculative", None):
        net = _meta_model(path)
        if net is not None:
            check_speculative(net, a.speculative)


def _check_tokenizer(path, chat: bool) -> None:
    from .config import read_config
    from .engine.llm import gguf_extras, load_tokenizer
    from .errors import MoerunError
    from .loaders.gguf import is_gguf

    if is_gguf(path):
        if not path.is_file():
            return  # the loader says what the path is
        tok, _, why = gguf_extras(path)
        why = why or f"{path} holds no tokenizer; text generation needs one"
    else:
        if not path.is_dir():
            return
        read_config(path)  # a directory that is no model at all is told so first
        tok, why = load_tokenizer(path), f"{path} has no tokenizer.json; text generation needs one"
    if tok is None:
        raise MoerunError(why)
    if chat and not tok.chat_template:
        raise MoerunError(f"{path} has no chat template; use `moerun generate`")


def _meta_model(path):
    """The model as the loader builds it before reading any weight, on the meta device: from
    config.json and the safetensors headers (an MTP head the checkpoint was stripped of is
    dropped), or from a GGUF file's metadata. None where it cannot be built: the loader then
    says why."""
    from .loaders.gguf import is_gguf

    if is_gguf(path):
        from .loaders.gguf import GGUFFile, arch_of, config_of
        from .models import build_on_meta, module_for

        if not path.is_file():
            return None
        f = GGUFFile(path)
        try:
            cfg = config_of(f, arch_of(f))
        finally:
            f.close()
        try:
            module = module_for(cfg["model_type"])
            return build_on_meta(module, module.ModelArgs.from_dict(cfg))
        except (ValueError, TypeError, KeyError, IndexError, ArithmeticError):
            return None
    from .loaders.hf import open_model, plan_state

    if not path.is_dir():
        return None
    _, _, net, ckpt, _, renames = open_model(path)
    try:
        plan_state(net, ckpt, renames)
    finally:
        ckpt.close()
    return net


def _load_model(a):
    import moerun

    from .layers.cache import kv_cache_dtype

    kv_dtype = kv_cache_dtype(a.kv_cache)  # a bad value fails before the weights load
    _check_flags(a)
    store_opts = {k: getattr(a, k) for k in STORE_FLAGS if getattr(a, k, None) is not None}
    if not store_opts and not getattr(a, "predictor", None):
        return moerun.load(a.model, dtype=a.dtype, threads=a.threads, quant=a.quant, kv_cache=a.kv_cache,
                           check_weights=a.check_weights, populate=getattr(a, "populate", False))
    from .experts.attach import load as load_with_store
    from .experts.store import StoreOptions

    options = StoreOptions(**store_opts)  # the budgets' spelling is checked here, before loading
    llm = load_with_store(a.model, dtype=a.dtype, threads=a.threads, options=options, quant=a.quant,
                          check_weights=a.check_weights)
    if kv_dtype is not None:  # auto: what the loader chose (a quantized net's checkpoint dtype)
        llm.kv_dtype = kv_dtype
    if a.predictor:
        from .experts.predict import attach_predictor

        llm.predictor = attach_predictor(llm.net, llm.store, a.predictor, trace=a.predictor_trace)
        llm.predictor.name = a.predictor
    return llm


def _speculative(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", default=None, choices=["mtp"], help="self-speculative decoding with the model's MTP head")
    p.add_argument("--draft-tokens", default=None, help="drafts per step with --speculative: 1..4 or auto (default 1)")
    p.add_argument("--draft-vocab", default=None,
                   help="with --speculative: draft among the first N token ids only (a cheaper MTP call on a "
                        "large vocabulary)")


def _spec_kwargs(a) -> dict:
    from .engine.speculative import check_draft_tokens
    from .errors import MoerunError

    if not a.speculative:
        for flag, v in (("--draft-tokens", a.draft_tokens), ("--draft-vocab", a.draft_vocab)):
            if v is not None:
                raise MoerunError(f"{flag} sets speculative decoding: give --speculative mtp too")
        return {}
    n = a.draft_tokens or "1"
    n = check_draft_tokens(n if n == "auto" else _int_flag("--draft-tokens", n))
    vocab = None if a.draft_vocab is None else _int_flag("--draft-vocab", a.draft_vocab, auto=False)
    return {"speculative": a.speculative, "draft_tokens": n, "draft_vocab": vocab}


def _int_flag(flag: str, value: str, auto: bool = True) -> int:
    from .errors import MoerunError

    try:
        return int(value)
    except ValueError:
        raise MoerunError(f"{flag} must be an integer{' or auto' if auto else ''}, not {value!r}") from None


def _store_stats(llm) -> dict:
    store = getattr(llm, "store", None)
    return store.stats() if store is not None else {}


def cmd_generate(a) -> int:
    from .errors import MoerunError

    prompt = sys.stdin.read() if a.prompt == "-" else a.prompt
    if not prompt:
        raise MoerunError("the prompt is empty" + (" (nothing on standard input)" if a.prompt == "-" else ""))
    llm = _load(a)
    out = sys.stdout
    for piece in llm.generate(prompt, **_sampling_kwargs(a), **_spec_kwargs(a)):
        out.write(piece)
        out.flush()
    s = llm.last_stats
    out.write("\n")
    out.flush()
    print(f"[prompt {s.prompt_tokens} tok, {s.prefill_tok_s:.1f} tok/s | {_generated(s)} | "
          f"{a.threads or _threads()} threads]", file=sys.stderr)
    if a.speculative:
        d = s.as_dict()
        print(f"[speculative: acceptance {d['acceptance_rate']:.2f}, {d['accepted_tokens_per_step']:.2f} tokens/step]", file=sys.stderr)
    if a.verbose:
        print(f"[decode path: {_decode_path_line(llm)}]", file=sys.stderr)
    if a.stats:
        stats = _store_stats(llm)
        if stats:
            from .experts.store import format_stats

            print(format_stats(stats), file=sys.stderr)
        else:
            print("[stats: no expert store in use (all experts resident); pass --ram-budget or --vram-budget]", file=sys.stderr)
    return 0


def _path_summary(d: dict) -> str:
    """`moerun info`'s line: whether a decode step is one native call over the layer stack,
    and if not why (`LLM.probe_decode_path`)."""
    if d["native_stack_passes"]:
        return "one native call over the layer stack a step (every layer's halves native)"
    return f"the layers' modules, each half a native call where it can be: {d['why'] or 'no native stack'}"


def _generated(s) -> str:
    """The summary's account of the generated tokens: which were timed, at what rate. The
    first token comes out of the prompt's pass and the first decode pass is the run's warm-up
    (`GenerationStats.warmup_tokens`); neither counts in the rate."""
    if not s.generated_tokens:
        return "generated 0 tok"
    parts = ["the first from the prompt's pass"]
    if s.warmup_tokens:
        parts.append(f"{s.warmup_tokens} in the warm-up pass")
    parts.append(f"{s.timed_tokens} timed at {s.decode_tok_s:.1f} tok/s" if s.timed_tokens > 0
                 else "too few to time the decode")
    return f"generated {s.generated_tokens} tok: " + ", ".join(parts)


def _decode_path_line(llm) -> str:
    """How the last generation run's decode passes ran (`layers.stack.decode_path`)."""
    from .layers.stack import decode_path

    d = getattr(llm.last_stats, "decode_path", None) or decode_path(None)
    line = f"{d['native_stack_passes']} passes as one native call over the layer stack"
    if d["module_passes"] is not None:
        line += f", {d['module_passes']} through the layers' modules"
    return line + (f" ({d['why']})" if d["why"] else "")


CHAT_HELP = "/reset clears the history, /help shows this, /exit or Ctrl-D leaves."


def cmd_chat(a) -> int:
    llm = _load(a)
    if llm.tokenizer is None or not llm.tokenizer.chat_template:
        from .errors import MoerunError

        raise MoerunError(f"{llm.path} has no chat template; use `moerun generate`")
    messages: list[dict] = []
    if a.system:
        messages.append({"role": "system", "content": a.system})
    print(f"moerun chat: {CHAT_HELP}", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if a.system else []
            print("[history cleared" + (", the system prompt kept]" if a.system else "]"), file=sys.stderr)
            continue
        if line.strip() in ("/help", "/?"):
            print(CHAT_HELP, file=sys.stderr)
            continue
        if line.strip().startswith("/"):
            print(f"unknown command {line.strip().split()[0]}: {CHAT_HELP}", file=sys.stderr)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        for piece in llm.generate(messages, **_sampling_kwargs(a), **_spec_kwargs(a)):
            reply.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


def cmd_info(a) -> int:
    from .layers.cache import kv_cache_summary
    from .engine.info import describe, human_count, layer_pattern
    from .errors import human_bytes
    from .quant import formats_in_use
    from .loaders.gguf import file_summary, is_gguf
    from .loaders.quantized import stored_policy

    a.populate = False  # info runs no weights: their pages are not needed
    llm = _load(a)
    args, d = llm.args, describe(llm.net, llm.args)
    n_exp = next((getattr(args, f) for f in ("num_experts", "n_routed_experts", "num_local_experts") if getattr(args, f, None)), 0)
    info = {
        "model": str(llm.path),
        "architecture": args.model_type,
        "layers": args.num_hidden_layers,
        "layer_pattern": layer_pattern(args),
        "experts": n_exp,
        "experts_per_token": getattr(args, "num_experts_per_tok", None),
        "mtp_layers": 1 if getattr(llm.net, "has_mtp", False) else 0,
        "dtype": str(llm.dtype).removeprefix("torch."),
        "context_length": llm.context_length,
        "kernel_isa": _kernel_isa(),
        "bf16_products": _bf16_products(llm.dtype),
        "quantization": formats_in_use(llm.net) or None,
        "quantized_checkpoint": stored_policy(llm.path) is not None or str(llm.path).endswith(".gguf"),
        **kv_cache_summary(llm.net.cache_spec(), llm.dtype, llm.kv_dtype),
        **d,
        "decode_path": llm.probe_decode_path(),
    }
    if is_gguf(llm.path):
        info["gguf"] = file_summary(llm.path)
    if a.json:
        print(json.dumps(info, indent=2))
        return 0
    rows = [
        ("model", info["model"]),
        ("architecture", info["architecture"]),
        *([("GGUF", _gguf_row(info["gguf"]))] if "gguf" in info else []),
        ("layers", f"{info['layers']}" + (f"  pattern {info['layer_pattern']} (L linear attention, F full)" if info["layer_pattern"] else "")),
        ("experts", f"{n_exp} routed, {info['experts_per_token']} per token"),
        ("MTP layers", info["mtp_layers"]),
        ("parameters", f"{human_count(d['parameters'])} total, {human_count(d['active_parameters'])} active per token (excl. embedding)"),
        ("dtype", info["dtype"]),
        ("context", info["context_length"]),
        ("kernels", info["kernel_isa"]),
        *([("bf16 products", info["bf16_products"])] if info["bf16_products"] else []),
        ("quantization", _quant_row(info)),
        ("KV cache", f"{info['kv_cache']}, {human_bytes(info['kv_bytes_per_token'])} per token of context"),
        ("decode path", _path_summary(info["decode_path"])),
        ("bytes/token", human_bytes(d["bytes_per_token"]) + " read per decoded token"),
    ]
    for comp, b in sorted(d["bytes_per_token_by_component"].items(), key=lambda kv: -kv[1]):
        rows.append((f"  {comp}", human_bytes(b)))
    width = max(len(r[0]) for r in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def _gguf_row(g: dict) -> str:
    from .errors import human_bytes

    total = sum(g["tensor_bytes"].values())
    shares = ", ".join(f"{t} {b / total:.0%}" for t, b in g["tensor_bytes"].items() if b >= total / 1000)
    return f"{g['architecture']}, {human_bytes(total)} of tensors: {shares}"


def _quant_row(info: dict) -> str:
    q = info["quantization"]
    if not q:
        return "none (float weights)"
    where = "stored in the checkpoint" if info["quantized_checkpoint"] else "at load"
    return ", ".join(f"{c} {f}" for c, f in q.items()) + f" ({where})"


def cmd_quantize(a) -> int:
    from dataclasses import replace

    from .errors import human_bytes
    from .engine.llm import set_threads
    from .quant import POLICIES
    from .loaders.quantized_write import quantize_checkpoint

    set_threads(a.threads)
    overrides = {c: getattr(a, c) for c in QUANT_COMPONENTS if getattr(a, c) is not None}
    policy = replace(POLICIES[a.policy], **{c: None if f == "none" else f for c, f in overrides.items()})
    s = quantize_checkpoint(a.model, a.output, policy, dtype=a.dtype, force=a.force)
    modules = ", ".join(f"{n} {c}" for c, n in s["modules"].items())
    print(f"wrote {s['output']}: {human_bytes(s['bytes'])} of weights (from {human_bytes(s['source_bytes'])}); "
          f"policy {s['policy']}; quantized {modules}; other tensors {s['dtype']}", file=sys.stderr)
    return 0


QUANT_COMPONENTS = ("experts", "shared_experts", "attention", "lm_head")  # QuantPolicy's fields, spelled out so
# that building the parser does not import torch (tests/test_quantize_checkpoint.py checks they agree)


def cmd_export_gguf(a) -> int:
    from .errors import MoerunError, human_bytes
    from .engine.llm import set_threads
    from .loaders.gguf_write import export

    split = 0
    if a.split_max_size is not None:
        from .experts.store import parse_budget

        if a.split_max_size.strip().endswith("%"):
            raise MoerunError(f"--split-max-size {a.split_max_size!r} must be bytes, like 2G or 500MB")
        split = parse_budget(a.split_max_size, 0, "--split-max-size")
        if split <= 0:
            raise MoerunError("--split-max-size must be more than 0 bytes")
    set_threads(a.threads)
    s = export(a.model, a.output, a.type, force=a.force, split_bytes=split)
    types = ", ".join(f"{n} {t}" for t, n in sorted(s["types"].items()))
    files = f" in {s['files']} files" if s["files"] > 1 else ""
    print(f"wrote {s['output']}{files}: {human_bytes(s['bytes'])}, architecture {s['architecture']}, "
          f"{s['tensors']} tensors ({types})", file=sys.stderr)
    return 0


def _kernel_isa() -> str:
    try:
        from . import kernels  # the native extension's one import point, when built

        return kernels.isa()
    except Exception:
        return "torch (native kernels not built)"


def _bf16_products(dtype) -> str | None:
    """For a bf16 model: which code multiplies its matrices of more than a decode step's rows
    (`kernels.float_native_rows`); None otherwise."""
    import torch

    if dtype != torch.bfloat16:
        return None
    from . import kernels

    if not kernels.native():
        return "torch"
    if kernels.torch_bf16_is_slow():
        return "native kernels at every size (this CPU has no AVX-512 BF16 or AMX for torch's)"
    return "native kernels up to 16 rows, torch's above (AVX-512 BF16 or AMX)"


def cmd_bench(a) -> int:
    from .bench.run import bench

    llm = _load(a)
    result = bench(llm, prompt_tokens=a.prompt_tokens, gen_tokens=a.gen_tokens, seed=0, reps=a.reps, warmup=a.warmup,
                   **_spec_kwargs(a))
    result["threads"] = a.threads or _threads()
    result["quant"] = a.quant
    stats = _store_stats(llm)
    result.update({k: stats[k] for k in ("expert_hit_rate", "prefetch_precision", "prefetch_recall",
                                          "bytes_moved_per_token", "stall_s_per_token", "stall_s", "execute",
                                          "link_waits", "cpu_executed", "cpu_exec_s") if k in stats})
    if a.json:
        print(json.dumps(result))
    else:
        def rng(key, fmt):
            xs = result.get(key + "_reps") or []
            return f" ({min(xs):{fmt}}-{max(xs):{fmt}})" if len(xs) > 1 else ""

        w = result.get("warmup") or {}
        print(
            f"{result['model']}: prefill {result['prompt_tokens']} tok at {result['prefill_tok_s']:.1f}"
            f"{rng('prefill_tok_s', '.1f')} tok/s, "
            f"decode {result['gen_tokens']} tok at {result['decode_tok_s']:.2f}{rng('decode_tok_s', '.2f')} tok/s "
            f"({result['threads']} threads, {result['dtype']}"
            + (f", mean of {result['reps']} runs" if result.get("reps", 1) > 1 else "")
            + (f", after a {w['prefill_tokens']}-token warm-up pass" if w else "") + ")"
        )
    return 0


def _threads() -> int:
    """The threads the run's native ops used (torch's own count may be lowered around them)."""
    import torch

    from . import kernels

    return kernels._state["threads"] or torch.get_num_threads()


def cmd_pull(a) -> int:
    from .loaders.hub import pull

    print(pull(a.name, include=a.include, revision=a.revision))
    return 0


def cmd_random_model(a) -> int:
    from .bench.random_model import preset_config, write_random_model

    cfg = preset_config(a.preset, layers=a.layers)
    if a.quant is not None:  # one GGUF file, its blocks made and written tensor by tensor
        from .bench.random_model import write_random_gguf

        info = write_random_gguf(a.output, cfg, a.quant, force=a.force)
        print(f"wrote a RANDOM-weight {a.preset} model ({cfg['num_hidden_layers']} layers, {a.quant}, "
              f"{info['bytes'] / 1e9:.2f} GB) to {info['output']}", file=sys.stderr)
        return 0
    path = write_random_model(a.output, cfg)
    print(f"wrote a RANDOM-weight {a.preset} model ({cfg['num_hidden_layers']} layers) to {path}", file=sys.stderr)
    return 0


def cmd_serve(a) -> int:
    from .experts.store import parse_budget
    from .server import check_settings, serve

    max_body = parse_budget(a.max_body, 0, "--max-body")
    settings = dict(api_key=a.api_key, max_concurrency=a.max_concurrency, max_queue=a.max_queue, max_len=a.max_len,
                    max_body=max_body, max_prompt_tokens=a.max_prompt_tokens, shutdown_timeout=a.shutdown_timeout)
    check_settings(port=a.port, **settings)  # before gigabytes of weights load
    llm = _load(a)
    serve(llm, a.host, a.port, allowed_hosts=tuple(a.allowed_hosts), cors_origins=tuple(a.cors_origin),
          **settings, **_spec_kwargs(a))
    return 0


def cmd_profile(a) -> int:
    from .experts.profile import profile

    summary = profile(a.model, a.prompts, a.output, mode=a.mode, max_tokens=a.max_tokens,
                      max_sequences=a.max_sequences, logits=a.logits, threads=a.threads, plots=a.plots,
                      check_weights=a.check_weights)
    print(json.dumps(summary, indent=2, default=str))
    return 0


def cmd_predict_eval(a) -> int:
    from .experts.predict import predict_eval

    predict_eval(a.trace, as_json=a.json, predictors=a.predictors)
    return 0


def cmd_simulate(a) -> int:
    from .bench.simulate import simulate
    from .errors import MoerunError

    if a.trace and a.trace_flag:
        raise MoerunError("give the trace once: moerun simulate TRACE.npz")
    trace = a.trace or a.trace_flag
    if trace is None:
        raise MoerunError("simulate needs a trace: moerun simulate TRACE.npz (written by `moerun profile`)")
    simulate(trace, a.hardware, a.model_geometry, vram_gb=a.vram_gb, as_json=a.json)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = _Parser(prog="moerun", description="Fast inference for sparse Mixture-of-Experts language models.",
                epilog='try: moerun generate "def fibonacci(n):" (without -m, every command uses the bundled demo model)')
    p.add_argument("--version", action="version", version=f"moerun {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND",
                           help="one of these; moerun COMMAND --help lists its options")

    g = sub.add_parser("generate", help="continue a prompt, streaming text")
    g.add_argument("prompt", help="the text to continue; - reads it from standard input")
    _common(g)
    _sampling(g)
    _speculative(g)
    g.add_argument("--stats", action="store_true", help="print the expert store's accounting")
    g.add_argument("--verbose", action="store_true", help="say how the decode passes ran (the native stack or modules, and why)")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat with the model's chat template")
    c.add_argument("--system", default=None, help="system prompt")
    _common(c)
    _sampling(c)
    _speculative(c)
    c.set_defaults(func=cmd_chat)

    i = sub.add_parser("info", help="architecture, parameters, bytes per decoded token")
    _common(i)
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.set_defaults(func=cmd_info)

    b = sub.add_parser("bench", help="prefill and decode speed")
    _common(b)
    b.add_argument("--prompt-tokens", type=int, default=128, help="random prompt tokens to prefill")
    b.add_argument("--gen-tokens", type=int, default=32, help="tokens to decode and time")
    b.add_argument("--reps", type=int, default=1,
                   help="timed prefill + decode runs, each on fresh ids; the figures are their mean (llama-bench's -r)")
    b.add_argument("--warmup", choices=("full", "short"), default="full",
                   help="before the timed runs: a prefill of the prompt's size (full, as llama-bench) "
                        "or of 4 tokens (short: the first timed prefill pays first touches), then 3 decode steps")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    _speculative(b)
    b.set_defaults(func=cmd_bench)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _common(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    sv.add_argument("--port", type=int, default=8000, help="port to listen on")
    sv.add_argument("--api-key", default=None, help="require this bearer key")
    sv.add_argument("--max-concurrency", type=int, default=4, help="requests decoded together (cache slots)")
    sv.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond those; then 429")
    sv.add_argument("--max-len", type=int, default=None, help="tokens per request (prompt + completion)")
    sv.add_argument("--max-prompt-tokens", type=int, default=None,
                    help="the longest prompt taken, in tokens (default: what --max-len leaves room for)")
    sv.add_argument("--max-body", default="4MiB", help="the largest request body (default 4MiB); 413 past it")
    sv.add_argument("--allowed-hosts", nargs="+", default=[], metavar="HOST",
                    help="Host header names answered besides loopback's ('*': any; see docs/security.md)")
    sv.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                    help="let pages from this origin call the API (repeatable; '*': any). Default: none")
    sv.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="seconds running requests get to finish on SIGTERM or Ctrl-C (default 30)")
    _speculative(sv)  # requests then run one at a time
    sv.set_defaults(func=cmd_serve)

    pr = sub.add_parser("profile", help="record a routing trace (and plots)")
    _common(pr)
    pr.add_argument("--prompts", required=True, help="text file: one prompt per line, or documents separated by blank lines")
    pr.add_argument("-o", "--output", required=True, help="trace file (.npz)")
    pr.add_argument("--mode", default="generate", choices=["generate", "text"], help="route generated tokens, or the prompts' own text")
    pr.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt (--mode generate)")
    pr.add_argument("--max-sequences", type=int, default=None, help="profile at most this many prompts")
    pr.add_argument("--logits", action="store_true", help="also record router logits")
    pr.add_argument("--plots", default=None, help="directory for PNG plots")
    pr.set_defaults(func=cmd_profile)

    pe = sub.add_parser("predict-eval", help="score expert predictors on a trace")
    pe.add_argument("trace", help="a routing trace (.npz) written by `moerun profile`")
    pe.add_argument("--json", action="store_true", help="print one JSON object")
    pe.add_argument("--predictors", default=None, help="comma-separated subset")
    _common(pe, model=False)
    pe.set_defaults(func=cmd_predict_eval)

    si = sub.add_parser("simulate", help="replay a trace through a CPU+GPU+link model")
    si.add_argument("trace", nargs="?", default=None, help="a routing trace (.npz) written by `moerun profile`")
    si.add_argument("--trace", dest="trace_flag", default=None, help=argparse.SUPPRESS)  # the older spelling, hidden
    si.add_argument("--hardware", default="pcie4+rtx4090", help="link + GPU preset to model, e.g. pcie4+rtx4090")
    si.add_argument("--model-geometry", default="qwen3.6-35b-a3b", help="the model whose shapes the trace is mapped onto")
    si.add_argument("--vram-gb", type=float, default=None, help="GPU memory for experts (default: the preset's)")
    si.add_argument("--json", action="store_true", help="print one JSON object")
    _common(si, model=False)
    si.set_defaults(func=cmd_simulate)

    q = sub.add_parser("quantize", help="write a quantized checkpoint that loads without re-quantizing")
    q.add_argument("-m", "--model", required=True, help="float Hugging Face model directory")
    q.add_argument("-o", "--output", required=True, help="directory to write (refused if not empty, unless --force)")
    q.add_argument("--policy", default="int4-q6k", choices=["int4", "int8", "int4-all", "int4-q6k", "int4-kq", "kq"],
                   help="int4-q6k (default) = routed experts and attention int4, shared experts int8, head Q6_K; "
                        "int4 = routed experts int4, attention/shared/head int8; int8; int4-all; int4-kq, kq "
                        "with llama.cpp's K-quants (moerun.quant.POLICIES)")
    for comp in QUANT_COMPONENTS:
        q.add_argument("--" + comp.replace("_", "-"), default=None,
                       choices=["int4", "int8", "q4_k", "q5_k", "q6_k", "q5_0", "none"],
                       help=f"format of the {comp.replace('_', ' ')} (overrides --policy; none keeps them float)")
    q.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="dtype of the tensors kept in float")
    q.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    _common(q, model=False)
    q.set_defaults(func=cmd_quantize)

    x = sub.add_parser("export-gguf", help="write a model directory as one GGUF file (llama.cpp's format)")
    x.add_argument("-m", "--model", required=True, help="Hugging Face model directory, float or written by `moerun quantize`")
    x.add_argument("-o", "--output", required=True, help="GGUF file to write (refused if it exists, unless --force)")
    x.add_argument("--type", default="bf16", choices=["bf16", "f32", "q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k"],
                   help="tensor types (default bf16); a quantized checkpoint's int8/int4 blocks are written as Q8_0/Q4_0")
    x.add_argument("--force", action="store_true", help="replace an existing output file")
    x.add_argument("--split-max-size", metavar="SIZE", help="cut into files of at most SIZE of tensor data (e.g. 2G, "
                   "500MB), named NAME-00001-of-0000N.gguf as llama.cpp's gguf-split does; -m takes the first")
    _common(x, model=False)
    x.set_defaults(func=cmd_export_gguf)

    pl = sub.add_parser("pull", help="download a model from the Hugging Face Hub into its cache; prints the path")
    pl.add_argument("name", help="org/name, org/name:FILE.gguf or org/name:QUANT (e.g. :Q4_K_M, the matching GGUF files)")
    pl.add_argument("--include", action="append", default=[], metavar="PATTERN",
                    help="download only the files matching this glob, e.g. '*Q4_K_M*' (repeatable)")
    pl.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    _common(pl, model=False)
    pl.set_defaults(func=cmd_pull)

    r = sub.add_parser("random-model", help="write a random-weight checkpoint with a real model's shapes")
    r.add_argument("preset", help="qwen3-30b-a3b, qwen3.6-35b-a3b, qwen1.5-moe-a2.7b, olmoe-1b-7b, mixtral-8x7b or deepseek-v3")
    r.add_argument("-o", "--output", required=True, help="directory to write (with --quant: the GGUF file)")
    r.add_argument("--layers", type=int, default=None, help="decoder layers (default: the real model's)")
    r.add_argument("--quant", default=None, choices=["q8_0", "q4_0"],
                   help="write one GGUF file of random blocks of this type, streamed (llama.cpp reads it too)")
    r.add_argument("--force", action="store_true", help="with --quant: replace an existing file")
    _common(r, model=False)
    r.set_defaults(func=cmd_random_model)
    return p


class _Stderr(logging.Handler):
    """The library's notices as lines `moerun: ...` on whatever stderr is now."""

    def emit(self, record):
        print(f"moerun: {record.getMessage()}", file=sys.stderr)


def _say_on_stderr(level: int) -> None:
    log = logging.getLogger("moerun")
    if not any(isinstance(h, _Stderr) for h in log.handlers):
        log.addHandler(_Stderr())
    log.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    # Idle OpenMP threads (torch's, after each of its parallel ops) sleep rather than spin:
    # moerun's own pool runs the heavy ops on the same cores, and spinning threads took them
    # (a 512-token prompt pass of a Qwen3-30B-A3B-shaped Q4_K_M file on 2 threads: libgomp 14%
    # of the samples, the pass ~5% slower; docs/benchmarks.md). Set before torch loads; a
    # value the user set is kept.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from .errors import MoerunError

    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # a newcomer's first try: the usage, not an error
        parser.print_help()
        return 0
    a = parser.parse_args(argv)
    _say_on_stderr(logging.INFO if getattr(a, "verbose", False) else logging.WARNING)
    try:
        if a.threads is not None and a.threads < 1:
            raise MoerunError("--threads must be at least 1")
        if getattr(a, "model", None) is not None:  # org/name: the Hugging Face cache, before anything loads
            from .loaders.hub import resolve

            a.model = str(resolve(a.model))
        return a.func(a)
    except MoerunError as e:
        if a.debug:
            raise
        print(f"moerun: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # anything else is our bug: still one line unless --debug
        if a.debug:
            raise
        print(f"moerun: error: {type(e).__name__}: {e} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
