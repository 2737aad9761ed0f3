"""Models named as on the Hugging Face Hub: `-m org/name`, `-m org/name:FILE.gguf` and
`-m org/name:Q4_K_M` (a quant tag, as llama.cpp's `-hf` takes it), resolved through
huggingface_hub's cache: the one transformers and llama.cpp share, placed by `HF_HOME` or
`HF_HUB_CACHE`. `moerun pull` fills it.

Resolving never touches the network: a name that is not cached is one error line that says
to run `moerun pull`. A path that exists on disk always wins over a name."""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import MoerunError, one_line
from .gguf import SPLIT

_NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<sel>[^:/][^:]*))?$")


def parse(spec) -> tuple[str, str | None] | None:
    """(repo id, what follows its colon or None) of `org/name[:SEL]`; None for anything else."""
    m = _NAME.match(str(spec))
    if not m:
        return None
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(m["repo"])
    except HFValidationError:
        return None
    return m["repo"], m["sel"]


def resolve(spec) -> Path:
    """The local path `-m spec` names: `spec` itself where it exists or is no Hub name;
    otherwise the cached snapshot directory (config.json + safetensors) or GGUF file (a split
    set's first part) of `org/name[:FILE.gguf|:TAG]`."""
    path = Path(spec)
    name = None if path.exists() else parse(spec)
    if name is None:
        return path
    repo, sel = name
    return pick(repo, sel, _snapshot(repo, sel))


def _snapshot(repo: str, sel: str | None, revision: str | None = None) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError as e:
        if getattr(e, "snapshot_path", None):  # IncompleteSnapshotError, pulled in part (--include): what is there counts
            return Path(e.snapshot_path)
        full = repo + (f":{sel}" if sel else "")
        raise MoerunError(f"{full} is neither a local path nor in the Hugging Face cache ({constants.HF_HUB_CACHE}): "
                          f"download it with `moerun pull {full}` where a network exists, or pass a local path") from None


def pick(repo: str, sel: str | None, snap: Path, revision: str | None = None) -> Path:
    """The model in the snapshot `snap` of `repo`: the directory where it holds config.json and
    safetensors, else its one GGUF model; `sel` names a GGUF file or a quant tag."""
    ggufs = sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*.gguf") if p.is_file())
    if sel is not None and sel.endswith(".gguf"):
        m = SPLIT.match(Path(sel).name)
        parts = [sel] if not m else [str(Path(sel).with_name(f"{m['stem']}-{i:05d}-of-{m['n']}.gguf"))
                                     for i in range(1, int(m["n"]) + 1)]
        return [_cached_file(repo, p, revision) for p in parts][0]
    if sel is None and (snap / "config.json").is_file() and any(snap.glob("*.safetensors")):
        return snap
    cached = sorted({_first_part(f) for f in ggufs if "mmproj" not in Path(f).name.lower()})  # a split set is one
    models = cached
    if sel is not None:  # a quant tag, between separators, in any case (llama.cpp's -hf org/name:Q4_K_M)
        tag = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(sel)}(?![A-Za-z0-9_])", re.IGNORECASE)
        models = [f for f in cached if tag.search(f)]
    if len(models) == 1:
        return snap / models[0]
    full = repo + (f":{sel}" if sel else "")
    if len(models) > 1:
        raise MoerunError(f"{full} holds {len(models)} GGUF models ({', '.join(models)}): "
                          f"pick one with -m {repo}:FILE.gguf or a quant tag such as -m {repo}:Q4_K_M")
    if sel is None and (snap / "config.json").is_file():
        return snap  # the directory's loader says what it lacks
    found = f"cached: {', '.join(cached)}" if cached else "no GGUF file is cached"
    raise MoerunError(f"{full}: no {'GGUF file matches ' + repr(sel) if sel else 'model'} in {snap} ({found}); "
                      f"download it with `moerun pull {full}`")


def _first_part(f: str) -> str:
    m = SPLIT.match(Path(f).name)
    return f if not m else str(Path(f).with_name(f"{m['stem']}-00001-of-{m['n']}.gguf"))


def _cached_file(repo: str, name: str, revision: str | None) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(repo, name, revision=revision, local_files_only=True))
    except EntryNotFoundError:
        raise MoerunError(f"{repo}:{name} is not in the Hugging Face cache: download it with "
                          f"`moerun pull {repo} --include {name}` where a network exists, or pass a local path") from None


def pull(spec: str, include=(), revision: str | None = None) -> Path:
    """Download `org/name` (only the files matching `include`, or those `:FILE.gguf` or a
    quant tag name) into the cache with huggingface_hub's progress bars; returns what `-m spec`
    then resolves to."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    name = parse(spec)
    if name is None:
        raise MoerunError(f"{spec!r} is not a Hugging Face model name (org/name, org/name:FILE.gguf or org/name:TAG)")
    repo, sel = name
    patterns = list(include)
    if sel is not None:
        m = SPLIT.match(sel)
        sel_pattern = f"{m['stem']}-*-of-{m['n']}.gguf" if m else sel
        patterns.append(sel_pattern if sel.endswith(".gguf") else
                        "*" + "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else c for c in sel) + "*.gguf")
    try:
        snap = Path(snapshot_download(repo, revision=revision, allow_patterns=patterns or None))
    except GatedRepoError:
        raise MoerunError(f"{repo} is gated: accept its terms on the Hub, then log in (`hf auth login` or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise MoerunError(f"{repo} is not on the Hub ({constants.ENDPOINT}), or it is private: "
                          "check the name, or log in (`hf auth login` or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise MoerunError(f"{repo} has no revision {revision!r}") from None
    except LocalEntryNotFoundError as e:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else one_line(e.__cause__ or e)
        raise MoerunError(f"cannot download {repo}: the Hub ({constants.ENDPOINT}) cannot be reached ({why}); "
                          "pull it where a network exists, or pass -m a local path") from None
    except HfHubHTTPError as e:
        raise MoerunError(f"cannot download {repo}: {one_line(e)}") from None
    try:
        return pick(repo, sel, snap, revision)
    except MoerunError:  # several models, or none moerun picks: the snapshot, for -m DIR or -m org/name:FILE
        return snap
