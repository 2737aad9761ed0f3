"""Peak resident memory while loading, relative to the size of the loaded weights.

Writes a random Qwen3-30B-A3B-shaped checkpoint (bf16, a few layers) unless --model is
given, then loads it in a fresh process and reports:
  peak RSS during load - RSS before load   (VmHWM: file-backed mmap pages count too; unlike
                                            ru_maxrss it is not inherited from the parent)
  RSS after one forward pass               (every weight has been touched by then)
both divided by the bytes of the loaded weights.

  python benchmarks/load_memory.py [--layers 2] [--dtype bfloat16] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, torch, psutil
import moerun
proc = psutil.Process()
def hwm():  # this process's own peak RSS (ru_maxrss would carry the parent's peak across exec)
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
before = proc.memory_info().rss
llm = moerun.load(sys.argv[1], dtype=sys.argv[2], threads=2)
peak_load = hwm()
after_load = proc.memory_info().rss
weights = sum(t.numel() * t.element_size() for t in {id(p): p for p in llm.net.parameters()}.values())
with torch.inference_mode():
    llm.net(torch.tensor([[1, 2, 3]]))
after_forward = proc.memory_info().rss
peak_all = hwm()
print(json.dumps(dict(weights=weights, before=before, peak_load=peak_load, after_load=after_load,
                      after_forward=after_forward, peak_all=peak_all)))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        model = a.model
        if model is None:
            from moerun.bench.random_model import preset_config, write_random_model

            model = write_random_model(Path(tmp) / "m", preset_config("qwen3-30b-a3b", layers=a.layers))
        out = subprocess.run([sys.executable, "-c", CHILD, str(model), a.dtype], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
    gib = 2**30
    w = r["weights"]
    print(f"model: {model}  dtype {a.dtype}")
    print(f"loaded weights:                 {w / gib:.2f} GiB")
    print(f"RSS before load:                {r['before'] / gib:.2f} GiB (python + torch)")
    print(f"peak RSS during load - before:  {(r['peak_load'] - r['before']) / gib:.2f} GiB = {(r['peak_load'] - r['before']) / w:.3f} x weights")
    print(f"RSS after first forward - before: {(r['after_forward'] - r['before']) / gib:.2f} GiB = {(r['after_forward'] - r['before']) / w:.3f} x weights")
    print(f"peak RSS overall - before:      {(r['peak_all'] - r['before']) / gib:.2f} GiB = {(r['peak_all'] - r['before']) / w:.3f} x weights")


if __name__ == "__main__":
    main()
