"""`--import-from DIR` for before/after benchmarks: measure another checkout's moerun package
(`git worktree add /tmp/old COMMIT`, its native extension built or copied into
DIR/moerun) instead of this one, back to back with it."""

from __future__ import annotations

import argparse
import sys


def parse_args(ap: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """ap's arguments plus --import-from, parsed; that checkout's moerun is then the one
    imported (call before the first `import moerun`)."""
    ap.add_argument("--import-from", default=None, help="a checkout whose moerun package to import instead")
    a = ap.parse_args(argv)
    import_from(a.import_from)
    return a


def import_from(path: str | None) -> None:
    """Put the checkout at `path` ahead of the editable install's import hook (call before
    the first `import moerun`)."""
    if path:
        sys.meta_path = [f for f in sys.meta_path if "ScikitBuild" not in type(f).__name__]
        sys.path.insert(0, path)
