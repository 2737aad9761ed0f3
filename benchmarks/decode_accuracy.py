"""How far a model's decode steps are from a float32 forward over the same tokens.

    python benchmarks/decode_accuracy.py [-m PATH] [--dtype bfloat16] [--quant none] [--import-from DIR]

For a few prompts it runs a 4-token prefill then one decode step per token (what generation
runs: the native kernels on every piece) and compares each position's logits with one
float32 forward pass of the same weights (torch's GEMMs): the error relative to the largest
logit, median / 90th percentile / max over all positions, and how often the greedy picks
agree. --import-from DIR measures another checkout's code (see checkout.py).
"""

from __future__ import annotations

import argparse

from checkout import parse_args

PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = ",
    "The os module provides a portable way of using",
    "class Foo:\n    def __init__(self, x):\n        self.x = x\n",
    "Changed in version 3.8: the default",
]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quant", default="none")
    ap.add_argument("--threads", type=int, default=2)
    a = parse_args(ap, argv)
    import torch

    import moerun
    from moerun.layers.cache import Cache

    quant = None if a.quant == "none" else a.quant
    llm = moerun.load(a.model, dtype=a.dtype, threads=a.threads, quant=quant)
    ref = moerun.load(a.model, dtype="float32", threads=a.threads).net
    net = llm.net
    errs, agree = [], []
    for text in PROMPTS:
        ids = torch.tensor([llm.tokenizer.encode(text)])
        T = ids.shape[1]
        with torch.inference_mode():
            full = ref(ids)[0].float()
            cache = Cache(net.cache_spec(), 1, T, llm.dtype, llm.kv_dtype)
            steps = torch.cat([net(ids[:, :4], cache)[0]] + [net(ids[:, t : t + 1], cache)[0] for t in range(4, T)])
        steps = steps.float()
        errs += ((steps - full).abs().amax(-1) / full.abs().amax(-1)).tolist()
        agree += (steps.argmax(-1) == full.argmax(-1)).tolist()
    errs.sort()
    n = len(errs)
    print(f"{moerun.__file__}: {a.dtype}, quant {a.quant}, {n} positions; error / largest logit: median "
          f"{errs[n // 2]:.4f}, p90 {errs[9 * n // 10]:.4f}, max {errs[-1]:.4f}; greedy agrees {sum(agree)}/{n}")


if __name__ == "__main__":
    main()
