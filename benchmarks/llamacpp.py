"""llama.cpp as its users build it: from the registry's llama-cpp-python sdist, compiled for this CPU.

    python benchmarks/llamacpp.py build   [--dir DIR] [--sdist FILE] [--jobs 2]
    python benchmarks/llamacpp.py where   [--dir DIR]       # paths of the tools and libllama
    python benchmarks/llamacpp.py check   [--dir DIR]       # load its ctypes binding against it

llama-cpp-python 0.3.36's sdist vendors llama.cpp under vendor/llama.cpp. `build` unpacks it
into the cache dir and builds llama.cpp itself (not the python wheel) with

    cmake -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF

the targets llama-bench, llama-quantize, llama-perplexity and the shared libllama (with its
libggml*). The cache dir is $MOERUN_LLAMACPP_DIR, else ~/.cache/moerun/llama.cpp-0.3.36-native;
a finished build (a stamp file naming the flags and targets) is reused, never rebuilt. The
build is heavy (10-20 minutes on 2 cores): on a shared machine run it under
`flock /tmp/moerun-heavy.lock nice -n 10`.

The sdist comes from $MOERUN_LLAMACPP_SDIST, DIR/dl/, /var/tmp/llamacpp/, or else from
`pip download llama-cpp-python==0.3.36 --no-deps --no-binary llama-cpp-python` (under a time
limit, --pip-timeout): pip prepares the sdist's metadata after downloading it, in an isolated
build environment, and with `--no-binary :all:` that environment's requirements are built
from source too (most likely the hang seen with a plain `--no-binary :all:`); on a time-out or failure the
module says so in one sentence and how to put the file in place by hand.

From Python:

    from llamacpp import ensure_built, tool, import_llama_cpp
    build = ensure_built()            # the cache dir, built if it is not yet (slow)
    tool("llama-bench")               # path of a binary
    llama_cpp = import_llama_cpp()    # the sdist's llama_cpp package, loading the native libllama
    ll = import_llama_cpp_lowlevel()  # its ctypes binding alone (no diskcache/jinja2 needed)
    logits("m.gguf", ids)             # per-position logits [len(ids), vocab] from the native build
    with Session("m.gguf", n_ctx=512) as s:   # one model and context for many calls
        s.tokenize(text); s.logits(ids); s.greedy(ids, 32)
    perplexity_tool("m.gguf", "text.txt", n_ctx=128)   # llama-perplexity's own figure

`import_llama_cpp` puts the unpacked sdist's package dir first on sys.path and sets
LLAMA_CPP_LIB_PATH (llama_cpp/llama_cpp.py loads lib{llama}.so from there instead of its
own llama_cpp/lib, which the sdist does not have); it needs numpy, typing-extensions,
diskcache and jinja2 (the package's own dependencies) only where `llama_cpp.Llama` is used.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

VERSION = "0.3.36"
PACKAGE = "llama-cpp-python"
SDIST_NAME = f"llama_cpp_python-{VERSION}.tar.gz"
TARGETS = ("llama", "llama-bench", "llama-quantize", "llama-perplexity")
CMAKE_FLAGS = (
    "-DGGML_NATIVE=ON",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DLLAMA_CURL=OFF",
    # not needed by the four targets; off so configuring asks for nothing more of the machine
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
)
PIP_TIMEOUT_S = 600
STAMP = ".moerun-built.json"


class BuildError(RuntimeError):
    pass


def default_dir() -> Path:
    env = os.environ.get("MOERUN_LLAMACPP_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "moerun" / f"llama.cpp-{VERSION}-native"


def _dir(d) -> Path:
    return Path(d).expanduser() if d else default_dir()


def find_sdist(d=None) -> Path | None:
    """The sdist if it is somewhere already, else None."""
    cands = []
    env = os.environ.get("MOERUN_LLAMACPP_SDIST")
    if env:
        cands.append(Path(env).expanduser())
    cands += [_dir(d) / "dl" / SDIST_NAME, Path("/var/tmp/llamacpp") / SDIST_NAME]
    for c in cands:
        if c.is_file() and c.stat().st_size > 0:
            return c
    return None


def download_sdist(d=None, timeout_s: float = PIP_TIMEOUT_S) -> Path:
    """`pip download` the sdist into DIR/dl under a time limit."""
    dl = _dir(d) / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    # `--no-binary :all:` would apply to the isolated build environment pip makes to prepare
    # the sdist's metadata too: it then builds scikit-build-core's own requirements (cmake,
    # ninja, ...) from source, most likely where a plain `pip download --no-binary :all:` sat
    # for many minutes here. Naming the one package keeps its build requirements as wheels.
    cmd = [sys.executable, "-m", "pip", "download", f"{PACKAGE}=={VERSION}", "--no-deps",
           "--no-binary", PACKAGE, "-d", str(dl)]
    print("llamacpp: " + " ".join(cmd), file=sys.stderr)
    hint = (f"put {SDIST_NAME} (from https://pypi.org/project/{PACKAGE}/{VERSION}/#files) in "
            f"{dl} or point MOERUN_LLAMACPP_SDIST at it")
    try:
        subprocess.run(cmd, check=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise BuildError(f"pip download of {PACKAGE}=={VERSION} took over {timeout_s:.0f} s "
                         f"(pip prepares the sdist's metadata after downloading it, and that "
                         f"step can hang); {hint}") from None
    except subprocess.CalledProcessError as e:
        # pip fails in metadata preparation when scikit-build-core is not installed (no build
        # isolation), but the file may already be in place only in pip's cache: say what to do
        raise BuildError(f"pip download of {PACKAGE}=={VERSION} failed (exit {e.returncode}); "
                         f"{hint}") from None
    got = dl / SDIST_NAME
    if not got.is_file():
        raise BuildError(f"pip download finished but {got} is not there; {hint}")
    return got


def source_dir(d=None) -> Path:
    return _dir(d) / "src" / f"llama_cpp_python-{VERSION}"


def build_dir(d=None) -> Path:
    return _dir(d) / "build"


def unpack(d=None, sdist: Path | None = None) -> Path:
    """The unpacked sdist (unpacked now if it is not yet)."""
    src = source_dir(d)
    if (src / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file() and (src / ".unpacked").exists():
        return src
    sdist = sdist or find_sdist(d) or download_sdist(d)
    dest = src.parent
    if src.exists():
        shutil.rmtree(src)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers()
                   if m.name.startswith(f"llama_cpp_python-{VERSION}/")
                   and "/.git/" not in m.name]
        tf.extractall(dest, members=members, filter="data") if hasattr(tarfile, "data_filter") \
            else tf.extractall(dest, members=members)
    (src / ".unpacked").write_text(str(sdist) + "\n")
    vendor_commit(d, sdist)
    return src


def vendor_commit(d=None, sdist: Path | None = None) -> str:
    """The llama.cpp commit the sdist vendors (its .git/modules/vendor/llama.cpp/HEAD; the
    build's own `build_commit` is "unknown": the unpacked tree is no git checkout)."""
    mark = source_dir(d) / ".vendor-commit"
    if mark.is_file():
        return mark.read_text().strip()
    sdist = sdist or find_sdist(d)
    if sdist is None:
        return ""
    name = f"llama_cpp_python-{VERSION}/.git/modules/vendor/llama.cpp/HEAD"
    try:
        with tarfile.open(sdist) as tf:
            commit = tf.extractfile(name).read().decode().strip()
    except (KeyError, OSError, AttributeError):
        return ""
    if mark.parent.is_dir():
        mark.write_text(commit + "\n")
    return commit


def stamp(d=None) -> dict | None:
    p = build_dir(d) / STAMP
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def is_built(d=None) -> bool:
    s = stamp(d)
    return bool(s) and s.get("version") == VERSION and all(
        Path(p).exists() for p in s.get("outputs", {}).values())


def build(d=None, jobs: int = 2, sdist: Path | None = None, verbose: bool = True) -> Path:
    """Configure and build the targets into DIR/build; write the stamp. Slow."""
    src = unpack(d, sdist)
    llama_src = src / "vendor" / "llama.cpp"
    bdir = build_dir(d)
    bdir.mkdir(parents=True, exist_ok=True)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    t0 = time.time()
    out = None if verbose else subprocess.DEVNULL
    subprocess.run(["cmake", "-S", str(llama_src), "-B", str(bdir), *gen, *CMAKE_FLAGS],
                   check=True, stdout=out)
    subprocess.run(["cmake", "--build", str(bdir), "-j", str(jobs), "--target", *TARGETS],
                   check=True, stdout=out)
    outputs = {t: str(_find_output(bdir, t)) for t in TARGETS}
    info = {
        "version": VERSION, "sdist": str(sdist or find_sdist(d) or ""),
        "cmake_flags": list(CMAKE_FLAGS), "targets": list(TARGETS), "outputs": outputs,
        "lib_dir": str(Path(outputs["llama"]).parent),
        "compiler": _compiler(bdir), "build_s": round(time.time() - t0, 1),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu": cpu_model(), "llama_cpp_commit": vendor_commit(d),
    }
    (bdir / STAMP).write_text(json.dumps(info, indent=1) + "\n")
    return bdir


def _find_output(bdir: Path, target: str) -> Path:
    name = "libllama.so" if target == "llama" else target
    for c in (bdir / "bin" / name, bdir / "src" / name):
        if c.exists():
            return c
    hits = sorted(glob.glob(str(bdir / "**" / name), recursive=True))
    if not hits:
        raise BuildError(f"built {target} but cannot find {name} under {bdir}")
    return Path(hits[0])


def _compiler(bdir: Path) -> str:
    try:
        for line in (bdir / "CMakeCache.txt").read_text().splitlines():
            if line.startswith("CMAKE_CXX_COMPILER:"):
                cxx = line.split("=", 1)[1]
                return subprocess.run([cxx, "--version"], capture_output=True,
                                      text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        pass
    return ""


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def ensure_built(d=None, jobs: int = 2) -> Path:
    """DIR/build, building it first if there is no finished build."""
    if not is_built(d):
        build(d, jobs=jobs)
    return build_dir(d)


def require_built(d=None) -> dict:
    """The stamp of a finished build (with the vendored llama.cpp commit), or a BuildError
    saying how to make one."""
    if not is_built(d):
        raise BuildError(f"no finished llama.cpp {VERSION} build in {_dir(d)}; run "
                         f"`flock /tmp/moerun-heavy.lock nice -n 10 python benchmarks/llamacpp.py "
                         f"build` (10-20 minutes on 2 cores)")
    s = stamp(d)
    s.setdefault("llama_cpp_commit", vendor_commit(d))
    return s


def tool(name: str, d=None) -> Path:
    """Path of a built binary (llama-bench, llama-quantize, llama-perplexity)."""
    s = require_built(d)
    return Path(s["outputs"].get(name) or _find_output(build_dir(d), name))


def lib_dir(d=None) -> Path:
    return Path(require_built(d)["lib_dir"])


def import_llama_cpp(d=None):
    """The sdist's `llama_cpp` package, loading this native libllama (LLAMA_CPP_LIB_PATH)."""
    if "llama_cpp" in sys.modules:
        mod = sys.modules["llama_cpp"]
        want = str(source_dir(d))
        if not str(getattr(mod, "__file__", "")).startswith(want):
            raise BuildError(f"llama_cpp is already imported from {mod.__file__}, not {want}")
        return mod
    os.environ["LLAMA_CPP_LIB_PATH"] = str(lib_dir(d))
    sys.path.insert(0, str(source_dir(d)))
    try:
        import llama_cpp  # noqa: PLC0415
    except ModuleNotFoundError as e:
        raise BuildError(f"the llama_cpp package needs {e.name} (pip install {e.name}); "
                         f"import_llama_cpp_lowlevel() gives its ctypes binding without it") from None
    return llama_cpp


def import_llama_cpp_lowlevel(d=None):
    """Only the sdist's ctypes binding, `llama_cpp.llama_cpp`, loading this native libllama:
    without running the package's __init__ (which imports its high-level `Llama` and with it
    diskcache and jinja2); needs typing-extensions alone."""
    import importlib
    import types

    if "llama_cpp.llama_cpp" in sys.modules:
        return sys.modules["llama_cpp.llama_cpp"]
    if "llama_cpp" not in sys.modules:
        os.environ["LLAMA_CPP_LIB_PATH"] = str(lib_dir(d))
        pkg = types.ModuleType("llama_cpp")
        pkg.__path__ = [str(source_dir(d) / "llama_cpp")]
        pkg.__file__ = str(source_dir(d) / "llama_cpp" / "__init__.py")
        sys.modules["llama_cpp"] = pkg
    return importlib.import_module("llama_cpp.llama_cpp")


_QUIET = None


def decode_batch(ll, ctx, batch, ids, start: int, all_logits: bool) -> None:
    """ids at positions start.. of sequence 0 through llama_decode, in one batch; logits kept
    for every position or the last one."""
    batch.n_tokens = len(ids)
    for i, t in enumerate(ids):
        batch.token[i] = int(t)
        batch.pos[i] = start + i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = 1 if all_logits or i == len(ids) - 1 else 0
    rc = ll.llama_decode(ctx, batch)
    if rc != 0:
        raise BuildError(f"llama_decode returned {rc}")


def logits(model_path, ids: list[int], threads: int = 2, n_batch: int = 512, d=None, quiet: bool = True,
           kv_type: str | None = None, flash_attn: bool | None = None):
    """Per-position logits [len(ids), vocab] (float32 numpy) of the GGUF at `model_path` run by
    the native libllama on token ids `ids` (one sequence from position 0, every position's
    logits output), through the sdist's ctypes binding. `kv_type` "f32"/"f16"/"bf16"/"q8_0"
    sets the K and V cache types (llama.cpp's -ctk/-ctv; None: its default, f16);
    `flash_attn` True/False sets -fa on/off (None: its default, auto)."""
    import ctypes

    import numpy as np

    global _QUIET
    ll = import_llama_cpp_lowlevel(d)
    if quiet and _QUIET is None:
        _QUIET = ll.llama_log_callback(lambda level, text, user: None)
        ll.llama_log_set(_QUIET, ctypes.c_void_p(0))
    ll.llama_backend_init()
    mp = ll.llama_model_default_params()
    model = ll.llama_model_load_from_file(str(model_path).encode(), mp)
    if not model:
        raise BuildError(f"libllama could not load {model_path}")
    n = len(ids)
    cp = ll.llama_context_default_params()
    cp.n_ctx = max(n, 16)
    cp.n_batch = cp.n_ubatch = min(n_batch, max(n, 16))
    cp.n_threads = cp.n_threads_batch = threads
    _set_kv(ll, cp, kv_type, flash_attn)
    ctx = ll.llama_init_from_model(model, cp)
    if not ctx:
        ll.llama_model_free(model)
        raise BuildError(f"libllama could not make a context for {model_path}")
    try:
        n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
        out = np.empty((n, n_vocab), dtype=np.float32)
        step = cp.n_batch
        batch = ll.llama_batch_init(step, 0, 1)
        try:
            for s in range(0, n, step):
                chunk = ids[s:s + step]
                decode_batch(ll, ctx, batch, chunk, s, all_logits=True)
                for i in range(len(chunk)):
                    out[s + i] = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
        finally:
            ll.llama_batch_free(batch)
        return out
    finally:
        ll.llama_free(ctx)
        ll.llama_model_free(model)


class Session:
    """One GGUF model and one context of the native libllama, for many calls: tokenize with
    the file's own tokenizer, all-position logits of a sequence, greedy decoding through the
    KV cache (and, for hybrid models, the recurrent state). The memory is cleared before each
    sequence, so every call starts from position 0. `kv_type` and `flash_attn` as in `logits`;
    llama.cpp casts an f32 cache to f16 for flash attention, so float32 attention throughout
    needs kv_type="f32" with flash_attn=False."""

    def __init__(self, model_path, n_ctx: int = 512, threads: int = 2, n_batch: int = 512, d=None,
                 quiet: bool = True, kv_type: str | None = None, flash_attn: bool | None = None):
        import ctypes

        global _QUIET
        self.ll = ll = import_llama_cpp_lowlevel(d)
        if quiet and _QUIET is None:
            _QUIET = ll.llama_log_callback(lambda level, text, user: None)
            ll.llama_log_set(_QUIET, ctypes.c_void_p(0))
        ll.llama_backend_init()
        self.path = str(model_path)
        self.model = ll.llama_model_load_from_file(self.path.encode(), ll.llama_model_default_params())
        if not self.model:
            raise BuildError(f"libllama could not load {model_path}")
        cp = ll.llama_context_default_params()
        cp.n_ctx = max(n_ctx, 16)
        cp.n_batch = cp.n_ubatch = min(n_batch, cp.n_ctx)
        cp.n_threads = cp.n_threads_batch = threads
        _set_kv(ll, cp, kv_type, flash_attn)
        self.ctx = ll.llama_init_from_model(self.model, cp)
        if not self.ctx:
            ll.llama_model_free(self.model)
            raise BuildError(f"libllama could not make a context for {model_path} "
                             f"(kv_type={kv_type}, flash_attn={flash_attn})")
        self.n_ctx, self.n_batch = cp.n_ctx, cp.n_batch
        self.vocab = ll.llama_model_get_vocab(self.model)
        self.n_vocab = ll.llama_vocab_n_tokens(self.vocab)
        self.batch = ll.llama_batch_init(self.n_batch, 0, 1)

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.ll.llama_batch_free(self.batch)
            self.ll.llama_free(self.ctx)
            self.ll.llama_model_free(self.model)
            self.ctx = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """The file's tokenizer (llama_tokenize); add_special adds BOS where the file says so."""
        raw = text.encode("utf-8")
        n_max = len(raw) + 8
        buf = (self.ll.llama_token * n_max)()
        n = self.ll.llama_tokenize(self.vocab, raw, len(raw), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (self.ll.llama_token * n_max)()
            n = self.ll.llama_tokenize(self.vocab, raw, len(raw), buf, n_max, add_special, parse_special)
        if n < 0:
            raise BuildError(f"llama_tokenize failed ({n})")
        return list(buf[:n])

    def _decode(self, ids, start: int, all_logits: bool) -> None:
        decode_batch(self.ll, self.ctx, self.batch, ids, start, all_logits)

    def _row(self, i: int):
        import numpy as np

        return np.ctypeslib.as_array(self.ll.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).copy()

    def reset(self) -> None:
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)

    def logits(self, ids: list[int]):
        """Logits [len(ids), vocab] (float32 numpy) of every position, from position 0."""
        import numpy as np

        if len(ids) > self.n_ctx:
            raise BuildError(f"{len(ids)} tokens do not fit n_ctx={self.n_ctx}")
        self.reset()
        out = np.empty((len(ids), self.n_vocab), dtype=np.float32)
        for s in range(0, len(ids), self.n_batch):
            chunk = ids[s:s + self.n_batch]
            self._decode(chunk, s, True)
            for i in range(len(chunk)):
                out[s + i] = self._row(i)
        return out

    def greedy(self, ids: list[int], n: int, stop_at_eog: bool = False) -> list[int]:
        """n tokens by argmax after the prompt `ids`, one decode step each (the KV cache path)."""
        if len(ids) + n > self.n_ctx:
            raise BuildError(f"{len(ids)} + {n} tokens do not fit n_ctx={self.n_ctx}")
        self.reset()
        for s in range(0, len(ids), self.n_batch):
            chunk = ids[s:s + self.n_batch]
            self._decode(chunk, s, False)
        last = len(ids[s:s + self.n_batch]) - 1
        out, pos = [], len(ids)
        for _ in range(n):
            t = int(self._row(last).argmax())
            out.append(t)
            if stop_at_eog and self.ll.llama_vocab_is_eog(self.vocab, t):
                break
            self._decode([t], pos, True)
            pos, last = pos + 1, 0
        return out


def perplexity_tool(model_path, text_file, n_ctx: int = 128, chunks: int | None = None, threads: int = 2,
                    extra: tuple = (), d=None) -> dict:
    """Run `llama-perplexity -f text_file -c n_ctx` and return its final estimate and the
    per-chunk running values it prints ({"ppl", "ppl_err", "chunks", "running"}). It tokenizes
    the file itself (BOS in front of each chunk when the file's tokenizer adds one) and scores
    only the second half of each chunk: positions n_ctx/2 .. n_ctx-2 predicting the next token."""
    import re

    cmd = [str(tool("llama-perplexity", d)), "-m", str(model_path), "-f", str(text_file), "-c", str(n_ctx),
           "-t", str(threads), *map(str, extra)]
    if chunks:
        cmd += ["--chunks", str(chunks)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise BuildError(f"llama-perplexity exited {r.returncode}: {' | '.join(tail)}")
    text = r.stdout + r.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", text)
    if not m:
        raise BuildError("llama-perplexity printed no final estimate")
    n = re.search(r"calculating perplexity over (\d+) chunks", text)
    running = [float(x) for x in re.findall(r"\[\d+\]([0-9.]+),", text)]
    return {"ppl": float(m.group(1)), "ppl_err": float(m.group(2)), "chunks": int(n.group(1)) if n else None,
            "running": running, "cmd": cmd}


KV_TYPES = {"f32": 0, "f16": 1, "q8_0": 8, "bf16": 30}  # ggml_type ids


def _set_kv(ll, cp, kv_type: str | None, flash_attn: bool | None) -> None:
    if kv_type is not None:
        if kv_type not in KV_TYPES:
            raise BuildError(f"kv_type {kv_type!r} is not one of {', '.join(KV_TYPES)}")
        cp.type_k = cp.type_v = KV_TYPES[kv_type]
    if flash_attn is not None:
        cp.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cmd", choices=["build", "where", "check"])
    ap.add_argument("--dir", help=f"cache dir (default $MOERUN_LLAMACPP_DIR or {default_dir()})")
    ap.add_argument("--sdist", help="the sdist file (default: found or pip-downloaded)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--pip-timeout", type=float, default=PIP_TIMEOUT_S)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "build":
            if is_built(a.dir):
                print(f"already built: {build_dir(a.dir)}")
            else:
                sd = Path(a.sdist) if a.sdist else (find_sdist(a.dir)
                                                    or download_sdist(a.dir, a.pip_timeout))
                build(a.dir, jobs=a.jobs, sdist=sd)
            print(json.dumps(stamp(a.dir), indent=1))
        elif a.cmd == "where":
            print(json.dumps(require_built(a.dir), indent=1))
        else:
            m = import_llama_cpp_lowlevel(a.dir)
            print(f"llama_cpp (ctypes binding) from {Path(m.__file__).parent}, "
                  f"libllama from {os.environ['LLAMA_CPP_LIB_PATH']}")
            print(m.llama_print_system_info().decode())
    except BuildError as e:
        print(f"llamacpp: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
