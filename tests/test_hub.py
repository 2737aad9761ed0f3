"""Models named as on the Hugging Face Hub (issue 36, "Model sources users expect"): `-m
org/name`, `-m org/name:FILE.gguf` and `-m org/name:TAG` resolved through huggingface_hub's
cache, `moerun pull`, and their errors. These machines have no hub: each test lays out the
cache itself (models--org--name/refs/main, snapshots/<commit>/ links into blobs/, as
huggingface_hub writes it) under a temporary HF_HOME with HF_HUB_OFFLINE=1."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import moerun
from moerun.errors import MoerunError
from moerun.loaders import hub

from conftest import assert_one_line_error, cli

DEMO = Path(moerun.__file__).parent / "demo_model"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out(hf_home: Path, repo: str, files: dict[str, Path]) -> Path:
    """`files` (name in the repo -> source) as huggingface_hub caches a download of `repo` at
    main; returns the snapshot directory."""
    root = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / COMMIT
    for name, src in files.items():
        blob = root / "blobs" / hashlib.sha256(src.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            shutil.copyfile(src, blob)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(COMMIT)
    return snap


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """The demo model as one BF16 GGUF file and as a Q8_0 set split in parts."""
    from moerun.loaders.gguf_write import export

    d = tmp_path_factory.mktemp("ggufs")
    export(DEMO, d / "demo-BF16.gguf", "bf16")
    export(DEMO, d / "demo-Q8_0.gguf", "q8_0", split_bytes=4 << 20)
    parts = sorted(d.glob("demo-Q8_0-*-of-*.gguf"))
    assert len(parts) > 1
    return d


@pytest.fixture()
def hf_home(tmp_path, monkeypatch, ggufs):
    """A cache holding org/demo (the demo's safetensors directory), org/demo-GGUF (a BF16 file
    and a split Q8_0 set) and org/one-GGUF (one file); the environment a subprocess gets, and
    huggingface_hub's constants (read at its import) as that environment sets them."""
    import huggingface_hub.constants as c

    home = tmp_path / "hf"
    lay_out(home, "org/demo", {p.name: p for p in DEMO.iterdir() if p.is_file()})
    lay_out(home, "org/demo-GGUF", {p.name: p for p in ggufs.glob("*.gguf")})
    lay_out(home, "org/one-GGUF", {"sub/demo-BF16.gguf": ggufs / "demo-BF16.gguf"})
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    return home


def cli_out(capsys, *args):
    """`moerun ARGS` in process, on one thread: (exit code, stdout, stderr)."""
    from moerun.cli import main

    rc = main([*map(str, args), "--threads", "1"])
    out, err = capsys.readouterr()
    return rc, out, err


def snapshot(home: Path, repo: str) -> Path:
    return home / "hub" / ("models--" + repo.replace("/", "--")) / "snapshots" / COMMIT


def run(*args, env=None, cwd=None):
    """The installed command in its own process (huggingface_hub reads the environment once, at import)."""
    return subprocess.run([sys.executable, "-m", "moerun.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})}, cwd=cwd)


def test_the_laid_out_cache_is_what_huggingface_hub_reads(hf_home):
    from huggingface_hub import scan_cache_dir

    repos = {r.repo_id: r for r in scan_cache_dir(hf_home / "hub").repos}
    assert set(repos) == {"org/demo", "org/demo-GGUF", "org/one-GGUF"}
    (rev,) = repos["org/demo"].revisions
    assert rev.commit_hash == COMMIT and "main" in rev.refs and {f.file_name for f in rev.files} >= {"config.json", "model.safetensors"}


def test_names_resolve_to_the_cached_files(hf_home):
    snap = snapshot(hf_home, "org/demo-GGUF")
    first = sorted(p.name for p in snap.glob("demo-Q8_0-00001-of-*.gguf"))[0]
    assert hub.resolve("org/demo") == snapshot(hf_home, "org/demo")  # config.json + safetensors: the directory
    assert hub.resolve("org/one-GGUF") == snapshot(hf_home, "org/one-GGUF") / "sub" / "demo-BF16.gguf"
    assert hub.resolve("org/demo-GGUF:demo-BF16.gguf") == snap / "demo-BF16.gguf"
    assert hub.resolve(f"org/demo-GGUF:{first}") == snap / first  # every part of the set is checked cached
    assert hub.resolve("org/demo-GGUF:Q8_0") == snap / first  # a quant tag picks the set's first part
    assert hub.resolve("org/demo-GGUF:bf16") == snap / "demo-BF16.gguf"  # in any case
    for not_a_name in ("./org/demo", "/org/demo", "a/b/c", "org/demo-GGUF:", "org/..", "demo"):
        assert hub.parse(not_a_name) is None, not_a_name
        assert hub.resolve(not_a_name) == Path(not_a_name)  # left to the loader, which says it is missing


def test_generate_on_a_cached_name_as_on_the_directory(hf_home):
    """The real command in its own process, the cache found through HF_HOME alone."""
    argv = ["generate", "def add(a, b):", "--max-tokens", "6", "--temperature", "0", "--threads", "1"]
    r = run(*argv, "-m", "org/demo")
    assert r.returncode == 0, r.stderr
    llm = moerun.load(DEMO, threads=1)
    want = "".join(llm.generate("def add(a, b):", max_tokens=6, temperature=0.0))
    assert r.stdout.rstrip("\n") == want
    assert moerun.load("org/demo", threads=1).path == snapshot(hf_home, "org/demo")  # the Python API too


def test_gguf_names_through_the_cli(hf_home, ggufs, capsys):
    rc, out, err = cli_out(capsys, "info", "-m", "org/demo-GGUF:demo-BF16.gguf", "--json")
    assert rc == 0, err
    info = json.loads(out)
    assert info["model"] == str(snapshot(hf_home, "org/demo-GGUF") / "demo-BF16.gguf")
    assert info["architecture"] == "qwen3_5_moe_text"
    argv = ["generate", "def add(a, b):", "--max-tokens", "6", "--temperature", "0"]
    first = sorted(ggufs.glob("demo-Q8_0-00001-of-*.gguf"))[0]
    rc, local, err = cli_out(capsys, *argv, "-m", first)
    assert rc == 0 and local.strip(), err
    rc, out, err = cli_out(capsys, *argv, "-m", "org/demo-GGUF:Q8_0")
    assert rc == 0 and out == local, err


def test_several_ggufs_are_listed_in_one_line(hf_home, capsys):
    first = sorted(p.name for p in snapshot(hf_home, "org/demo-GGUF").glob("demo-Q8_0-00001-of-*.gguf"))[0]
    assert_one_line_error(cli(capsys, "info", "-m", "org/demo-GGUF"), "holds 2 GGUF models",
                          f"demo-BF16.gguf, {first}", "-m org/demo-GGUF:FILE.gguf")
    assert_one_line_error(cli(capsys, "info", "-m", "org/demo-GGUF:Q5_K_M"), "no GGUF file matches 'Q5_K_M'",
                          "demo-BF16.gguf", "moerun pull org/demo-GGUF:Q5_K_M")


def test_what_is_not_cached_says_to_pull(hf_home, capsys):
    for command in (["info"], ["generate", "hi"], ["bench"], ["serve", "--port", "1"], ["chat"],
                    ["profile", "--prompts", "p.txt", "-o", "t.npz"], ["quantize", "-o", "q"], ["export-gguf", "-o", "x.gguf"]):
        assert_one_line_error(cli(capsys, *command, "-m", "org/absent"), "org/absent is neither a local path nor in "
                              f"the Hugging Face cache ({hf_home / 'hub'})", "`moerun pull org/absent`")
    assert_one_line_error(cli(capsys, "info", "-m", "org/demo-GGUF:demo-Q4_K_M.gguf"),
                          "`moerun pull org/demo-GGUF --include demo-Q4_K_M.gguf`")
    snap = snapshot(hf_home, "org/demo-GGUF")
    last = sorted(snap.glob("demo-Q8_0-*.gguf"))[-1]
    first = sorted(snap.glob("demo-Q8_0-00001-of-*.gguf"))[0]
    last.unlink()  # a split set with a part missing from the cache
    assert_one_line_error(cli(capsys, "info", "-m", f"org/demo-GGUF:{first.name}"), f"--include {last.name}")
    with pytest.raises(MoerunError, match="moerun pull org/absent"):
        moerun.load("org/absent")


def test_a_local_path_named_like_a_repo_wins(hf_home, tmp_path, monkeypatch, capsys):
    local = tmp_path / "cwd" / "org" / "demo-GGUF"  # in the cache this name holds 2 GGUF models: an error
    local.mkdir(parents=True)
    for p in DEMO.iterdir():
        (local / p.name).symlink_to(p)
    monkeypatch.chdir(tmp_path / "cwd")
    rc, out, err = cli_out(capsys, "info", "-m", "org/demo-GGUF", "--json")
    assert rc == 0 and json.loads(out)["model"] == "org/demo-GGUF", err


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_pull_without_a_network_is_one_line(hf_home):
    env = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}", "HF_HUB_ETAG_TIMEOUT": "2",
           "HF_HUB_DOWNLOAD_TIMEOUT": "2"}
    r = run("pull", "org/absent", env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and r.stdout == "", r.stderr
    assert lines[0].startswith("moerun: error: cannot download org/absent: the Hub (http://127.0.0.1:")
    assert "cannot be reached" in lines[0] and "Traceback" not in r.stderr
    r = run("pull", "org/absent", "--include", "*.gguf")  # HF_HUB_OFFLINE=1
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("moerun: error: cannot download org/absent"), r.stderr
    assert lines[0].endswith("cannot be reached (HF_HUB_OFFLINE is set); pull it where a network exists, or pass -m a local path")
    # what is cached already is found without the Hub, and its path printed; HF_HUB_CACHE over HF_HOME
    r = run("pull", "org/demo-GGUF:bf16", env={"HF_HOME": str(hf_home.parent / "elsewhere"),
                                              "HF_HUB_CACHE": str(hf_home / "hub")})
    assert r.returncode == 0 and r.stdout.strip() == str(snapshot(hf_home, "org/demo-GGUF") / "demo-BF16.gguf"), r.stderr


def test_pull_downloads_only_what_the_name_picks(monkeypatch, tmp_path):
    """The patterns `pull org/name:SEL` hands to snapshot_download, matched as it matches them."""
    from huggingface_hub.utils import filter_repo_objects

    asked = []

    def fake_download(repo, revision=None, allow_patterns=None):
        asked.append((repo, revision, allow_patterns))
        return str(tmp_path)
    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_download)
    files = ["m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "Q8_0/m-Q8_0-00001-of-00002.gguf", "Q8_0/m-Q8_0-00002-of-00002.gguf",
             "README.md"]
    picked = {}
    for spec in ("org/m:q4_k_m", "org/m:Q8_0", "org/m:Q8_0/m-Q8_0-00001-of-00002.gguf", "org/m"):
        asked.clear()
        assert hub.pull(spec, include=["README.md"], revision="v1") == tmp_path  # nothing there: the snapshot
        ((repo, rev, patterns),) = asked
        assert repo == "org/m" and rev == "v1"
        picked[spec] = list(filter_repo_objects(files, allow_patterns=patterns))
    assert picked["org/m:q4_k_m"] == ["m-Q4_K_M.gguf", "README.md"]
    assert picked["org/m:Q8_0"] == picked["org/m:Q8_0/m-Q8_0-00001-of-00002.gguf"] == files[2:]
    assert picked["org/m"] == ["README.md"]
    with pytest.raises(MoerunError, match="not a Hugging Face model name"):
        hub.pull("a/b/c")
