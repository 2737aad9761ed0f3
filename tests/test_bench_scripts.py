"""The benchmark scripts' own bad-input paths: one clear line, not a traceback or a dead process."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_llamacpp_probe_names_a_crash_and_a_failure(monkeypatch, tmp_path):
    bench = _load("vs_llamacpp")
    gguf = tmp_path / "m.gguf"
    # a child that dies on an illegal instruction, as llama.cpp's AMX path does on some Xeons
    monkeypatch.setattr(bench, "PROBE", "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    msg = bench.probe_llamacpp(gguf, 2)
    assert "died with SIGILL" in msg and "m.gguf" in msg and "-DGGML_NATIVE=OFF" in msg and "\n" not in msg
    monkeypatch.setattr(bench, "PROBE", "raise SystemExit('no such model')")
    assert bench.probe_llamacpp(gguf, 2) == "llama.cpp failed on a probe run: no such model"
    monkeypatch.setattr(bench, "PROBE", "pass")
    assert bench.probe_llamacpp(gguf, 2) is None


def test_gemm_benchmark_refuses_an_unknown_kernel_path():
    r = subprocess.run([sys.executable, str(BENCH / "gemm.py"), "--isas", "avx9000", "--shapes", "1x8x32",
                        "--formats", "int8", "--rounds", "1"], capture_output=True, text=True, cwd=BENCH)
    assert r.returncode == 1
    assert r.stdout.strip().splitlines() == [r.stdout.strip()]  # one line
    assert r.stdout.startswith("error: kernel path 'avx9000' is not available here") and "Traceback" not in r.stderr
