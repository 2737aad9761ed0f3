"""Quantized checkpoints: file size, load time and peak memory, quantize-at-load vs stored.

Quantizes MODEL with `moerun quantize` (in a child process: its time and peak RSS), then
loads, each in a fresh process: the float checkpoint as is, the float checkpoint with
`quant=POLICY` (quantized at load), and the written quantized checkpoint. Reports the
load time, peak RSS during the load and RSS after one forward pass, each minus the RSS
before loading (python + torch), and the bytes of the loaded tensors.

  python benchmarks/quantized_checkpoint.py [--model DIR | --layers N] [--policy int4] [--dtype auto]

Without --model, the bundled demo model; with --layers, a random Qwen3-30B-A3B-shaped
checkpoint of N layers (bf16) written to a temporary directory first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# peak RSS from VmHWM: ru_maxrss carries the parent's high-water mark across fork + exec
HWM = r"""
def hwm():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
"""

QUANTIZE = HWM + r"""
import json, sys, time, torch
from moerun.loaders.quantized_write import quantize_checkpoint
torch.set_num_threads(int(sys.argv[5]))
t0 = time.perf_counter()
s = quantize_checkpoint(sys.argv[1], sys.argv[2], sys.argv[3], dtype=sys.argv[4])
s.update(seconds=time.perf_counter() - t0, peak_rss=hwm())
print(json.dumps(s))
"""

LOAD = HWM + r"""
import json, sys, time, torch, psutil
import moerun
from moerun import kernels, tokenizer
from moerun.engine import llm as _
from moerun.models import module_for
from moerun.loaders import quantized as checkpoint
module_for(json.load(open(sys.argv[1] + "/config.json"))["model_type"])  # imports out of the measured load
kernels.isa()
with torch.device("meta"):
    torch.nn.Embedding(2, 2)  # the first meta-device op imports much of torch
proc = psutil.Process()
before = proc.memory_info().rss
t0 = time.perf_counter()
llm = moerun.load(sys.argv[1], dtype=sys.argv[2], quant=sys.argv[3], threads=int(sys.argv[4]))
seconds = time.perf_counter() - t0
peak = hwm()
tensors = {t.data_ptr(): t.numel() * t.element_size() for t in llm.net.state_dict().values()}
with torch.inference_mode():
    llm.net(torch.tensor([[1, 2, 3]]))
print(json.dumps(dict(seconds=seconds, peak_load=peak - before, after_forward=proc.memory_info().rss - before,
                      tensors=sum(tensors.values()))))
"""


def child(script: str, *args) -> dict:
    r = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True)
    if r.returncode:
        sys.exit(r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--policy", default="int4")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    mib = 2**20
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        model = a.model
        if model is None and a.layers:
            from moerun.bench.random_model import preset_config, write_random_model

            model = write_random_model(Path(tmp) / "float", preset_config("qwen3-30b-a3b", layers=a.layers))
        if model is None:
            from moerun.engine.llm import DEMO_MODEL

            model = DEMO_MODEL
        out = Path(tmp) / "quantized"
        q = child(QUANTIZE, model, out, a.policy, a.dtype, a.threads)
        rows = [("float", child(LOAD, model, a.dtype, "none", a.threads)),
                (f"float, --quant {a.policy} at load", child(LOAD, model, a.dtype, a.policy, a.threads)),
                (f"stored {a.policy} checkpoint", child(LOAD, out, "auto", "none", a.threads))]
    print(f"model: {model}  policy {a.policy}  float tensors {q['dtype']}  {a.threads} thread(s)")
    print(f"safetensors: {q['source_bytes'] / mib:.1f} MiB float -> {q['bytes'] / mib:.1f} MiB quantized "
          f"({q['bytes'] / q['source_bytes']:.2f}x)")
    print(f"moerun quantize: {q['seconds']:.1f} s, peak RSS {q['peak_rss'] / mib:.0f} MiB")
    print(f"{'load':<36} {'seconds':>8} {'peak RSS in load':>17} {'RSS after forward':>18} {'tensors':>10}")
    for name, r in rows:
        print(f"{name:<36} {r['seconds']:>8.2f} {r['peak_load'] / mib:>13.0f} MiB {r['after_forward'] / mib:>14.0f} MiB"
              f" {r['tensors'] / mib:>6.0f} MiB")


if __name__ == "__main__":
    main()
