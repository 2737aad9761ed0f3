"""The MTP-driven prefetcher runs inside the generate loop: it issues prefetches, output unchanged."""

import moerun
from moerun.experts.attach import load as load_with_store
from moerun.experts.predict import attach_predictor
from moerun.experts.profile import profile
from moerun.experts.store import StoreOptions


def test_mtp_predictor_prefetches_during_generation_without_changing_output(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\nimport sys\n\ndef main():\n    return 0\n\nclass Parser:\n    pass\n")
    profile(None, str(prompts), str(tmp_path / "trace.npz"), mode="text", max_tokens=32, threads=1)
    plain = moerun.load(threads=1)
    want = plain.generate_ids([plain.encode_prompt("def parse(argv):")], max_tokens=8, temperature=0.0)[0]
    llm = load_with_store(None, threads=1, options=StoreOptions(vram_budget="30%", emulate_link="pcie4"))
    try:
        llm.predictor = attach_predictor(llm.net, llm.store, "mtp", trace=tmp_path / "trace.npz")
        llm.predictor.name = "mtp"
        got = llm.generate_ids([llm.encode_prompt("def parse(argv):")], max_tokens=8, temperature=0.0)[0]
        stats = llm.store.stats()
    finally:
        llm.store.close()
    assert got == want
    assert stats["prefetch_issued"] > 0
