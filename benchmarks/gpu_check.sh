#!/usr/bin/env bash
# The GPU checks, in one call of the device tool (a lent CUDA machine), or here with the CPU
# standing in (the link emulated: its figures are EMULATED, and the script says so).
#
#   device tool:  run(command="bash benchmarks/gpu_check.sh", timeout_s=480)
#   here:         bash benchmarks/gpu_check.sh
#
# What it checks, with the demo model:
#   1. the machine: GPU, driver, torch, CPU;
#   2. the native extension builds against that machine's own torch (no libtorch link);
#   3. greedy text through the expert store with a device tier (CudaLink: host->GPU copies on
#      a side stream) equals the text with every expert resident; exits non-zero where not;
#   4. the store's accounting of that run (hits, bytes moved, stall) and decode tok/s.
# Everything it prints also goes to $OUT/gpu_check.log (OUT: the device tool's folder, or
# ./out/gpu-check here). Packages the GPU machine's image lacks (gguf, fastapi, ...) travel as
# wheels: see /work/.library/device/README.md ("nvidia-h200: a Python package missing there").
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/gpu-check}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1

if [ -z "${PY:-}" ]; then
    PY=python3
    [ -x .venv/bin/python ] && PY=.venv/bin/python
fi
echo "== machine ($(date -u +%FT%TZ))"
lscpu | grep -E '^(Model name|L3 cache|CPU\(s\))' || true
command -v nvidia-smi >/dev/null && nvidia-smi -L || echo "no nvidia-smi"
GPU=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))')
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda" if torch.cuda.is_available() else "no cuda",
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'

echo "== native extension"
if ! "$PY" -c 'import moerun._native' 2>/dev/null; then
    # the machine's own torch stays (no deps pulled); the build links no libtorch
    "$PY" -m pip install -q --no-deps --no-build-isolation -e .
fi
"$PY" -c 'import moerun.kernels as k; print("kernels:", k.describe())'
missing=$("$PY" - <<'EOF'
import importlib.util
need = ["safetensors", "tokenizers", "numpy", "jinja2", "tqdm", "gguf", "huggingface_hub"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
EOF
)
if [ -n "$missing" ]; then
    echo "missing Python packages: $missing (carry them as wheels, see the header)"
    exit 2
fi

MOERUN=("$PY" -m moerun.cli)
PROMPT='def fibonacci(n):'
if [ "$GPU" = 1 ]; then
    LINK=()
    echo "== device tier: CUDA (real copies)"
else
    LINK=(--emulate-link pcie4)
    echo "== device tier: no GPU here, the link is EMULATED (pcie4 preset)"
fi

echo "== greedy text: every expert resident vs the store with a device tier"
"${MOERUN[@]}" generate "$PROMPT" --max-tokens 48 --temperature 0 >"$OUT/resident.txt" 2>"$OUT/resident.err"
"${MOERUN[@]}" generate "$PROMPT" --max-tokens 48 --temperature 0 --ram-budget 4MiB --vram-budget 2MiB \
    "${LINK[@]}" --stats >"$OUT/device.txt" 2>"$OUT/device.err"
tail -n 3 "$OUT/resident.err" "$OUT/device.err"
if cmp -s "$OUT/resident.txt" "$OUT/device.txt"; then
    echo "PASS: same greedy text ($(wc -c <"$OUT/resident.txt") bytes)"
else
    echo "FAIL: the text differs"
    diff "$OUT/resident.txt" "$OUT/device.txt" || true
    exit 1
fi

echo "== decode speed, demo model (a correctness model: its speed is not a benchmark)"
"${MOERUN[@]}" bench --prompt-tokens 64 --gen-tokens 64 --ram-budget 4MiB --vram-budget 2MiB "${LINK[@]}" \
    --json >"$OUT/bench_device.json" && cat "$OUT/bench_device.json" || echo "bench with a device tier failed"
echo "done: $OUT"
