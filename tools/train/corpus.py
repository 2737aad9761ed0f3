"""Build the demo model's corpus from files that Debian packages install.

Sources: the reStructuredText sources of the Python 3.11 documentation (package
python3.11-doc, under /usr/share/doc/python3.11/html/_sources) and the Python standard
library's own source (package libpython3.11-stdlib, /usr/lib/python3.11/**/*.py).
Each file is one document. The split is by file and deterministic: a file is held out
when sha1 of its corpus-relative name falls in the first `heldout_percent` of 100 buckets.

Output (JSON lines, one document per line, {"name": ..., "text": ...}):
    <out>/train.jsonl  <out>/heldout.jsonl  <out>/manifest.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

DOC_ROOT = Path("/usr/share/doc/python3.11/html/_sources")
LIB_ROOT = Path("/usr/lib/python3.11")
# Tests carry deliberately odd files (bad encodings, broken syntax); vendored packages are
# not the standard library.
LIB_SKIP_DIRS = {"test", "idle_test", "tests", "site-packages", "dist-packages", "__pycache__"}
MAX_FILE_BYTES = 300_000  # pydoc_data/topics.py and similar generated blobs


def iter_documents():
    """Yield (name, text) in a fixed order."""
    if not DOC_ROOT.is_dir() or not LIB_ROOT.is_dir():
        raise SystemExit(f"missing {DOC_ROOT} or {LIB_ROOT}: run scripts/fetch_corpus.sh (apt-get install python3.11-doc)")
    for p in sorted(DOC_ROOT.rglob("*.txt")):
        yield "doc/" + p.relative_to(DOC_ROOT).as_posix(), p
    for p in sorted(LIB_ROOT.rglob("*.py")):
        rel = p.relative_to(LIB_ROOT)
        if any(part in LIB_SKIP_DIRS for part in rel.parts[:-1]):
            continue
        yield "lib/" + rel.as_posix(), p


def is_heldout(name: str, heldout_percent: int) -> bool:
    return int(hashlib.sha1(name.encode()).hexdigest(), 16) % 100 < heldout_percent


def build(out: Path, heldout_percent: int = 3) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    counts = {"train": [0, 0], "heldout": [0, 0]}
    tmp = {s: out / f"{s}.jsonl.tmp" for s in counts}
    files = {s: open(tmp[s], "w", encoding="utf-8") for s in counts}
    try:
        for name, path in iter_documents():
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            if not text.strip():
                continue
            split = "heldout" if is_heldout(name, heldout_percent) else "train"
            files[split].write(json.dumps({"name": name, "text": text}, ensure_ascii=False) + "\n")
            counts[split][0] += 1
            counts[split][1] += len(text)
    finally:
        for f in files.values():
            f.close()
    for s in counts:
        os.replace(tmp[s], out / f"{s}.jsonl")
    manifest = {
        "sources": [str(DOC_ROOT), str(LIB_ROOT)],
        "heldout_percent": heldout_percent,
        "split_rule": "sha1(name) % 100 < heldout_percent",
        **{f"{s}_files": c[0] for s, c in counts.items()},
        **{f"{s}_chars": c[1] for s, c in counts.items()},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_documents(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("data/corpus"))
    ap.add_argument("--heldout-percent", type=int, default=3)
    args = ap.parse_args(argv)
    print(json.dumps(build(args.out, args.heldout_percent), indent=2))


if __name__ == "__main__":
    main()
