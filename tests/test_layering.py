"""The package's floors (issue 34): kernels at the bottom, importing nothing of moerun's
above them; each torch reference beside its op, importing only torch; the KV and state
cache with the layers; no import circles between moerun's modules, counting the imports
made inside functions too; the demo model's training outside the installed package."""

from __future__ import annotations

import ast
from pathlib import Path

import moerun

ROOT = Path(moerun.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = ["moerun", *p.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = p
    return mods


MODULES = _modules()


MISSING: list[tuple[str, str]] = []  # (module, what it imports from a moerun module that does not exist)


def _imports(name: str, path: Path) -> set[str]:
    """The moerun modules `name` imports anywhere in its file (an imported name that is a
    module counts as that module, another name as the module it comes from)."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.startswith("moerun") and base not in MODULES and base != "moerun._native":
                MISSING.append((name, base))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:  # moerun._native (the extension) and names of modules
                t = t.rpartition(".")[0]
            if t and t != name and t != "moerun":
                out.add(t)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _floor(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_the_graph_is_read():
    """(The checks below would pass on an empty graph.)"""
    assert "moerun.kernels" in GRAPH["moerun.layers.moe"]
    assert "moerun.layers.cache" in GRAPH["moerun.engine.generate"]
    assert len(GRAPH) > 50


def test_every_import_names_a_module():
    """(A lazy import of a module that moved fails only when its line runs.)"""
    assert not MISSING, MISSING


def test_kernels_import_nothing_above_them():
    allowed = {"moerun.kernels", "moerun.errors"}
    bad = {(m, t) for m, ts in GRAPH.items() if _floor(m) == "moerun.kernels" for t in ts if _floor(t) not in allowed}
    assert not bad, sorted(bad)


def test_layers_import_only_kernels_and_themselves():
    allowed = {"moerun.kernels", "moerun.layers", "moerun.errors", "moerun.config"}
    bad = {(m, t) for m, ts in GRAPH.items() if _floor(m) == "moerun.layers" for t in ts if _floor(t) not in allowed}
    assert not bad, sorted(bad)


def test_references_import_only_torch():
    tree = ast.parse((ROOT / "kernels" / "reference.py").read_text())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert roots <= {"torch", "__future__"}, roots


def test_the_cache_lives_with_the_layers():
    assert "moerun.layers.cache" in MODULES and "moerun.engine.cache" not in MODULES
    for m in ("moerun.models.qwen3_moe", "moerun.models.qwen3_5_moe", "moerun.models.deepseek_v3"):
        assert not any(_floor(t) == "moerun.engine" for t in GRAPH[m]), m


def test_no_import_circles():
    index, low, stack, on, circles, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not circles, circles


def test_training_is_outside_the_package():
    assert not any(m.startswith(("moerun.train", "moerun.tools")) for m in MODULES)
    assert (ROOT.parent / "tools" / "train").is_dir()


def test_every_module_imports_alone():
    """Each module imported first, on its own (moerun's modules dropped from sys.modules before
    each): an import circle that a module's place in the import order hides fails here. (The
    graph above counts a module's own imports; importing moerun.a.b also runs moerun.a's
    package, which the graph does not follow.)"""
    import subprocess
    import sys

    code = f"""
import sys, importlib
failed = []
for name in {sorted(MODULES)!r}:
    for m in [m for m in sys.modules if m == "moerun" or m.startswith("moerun.") and m != "moerun._native"]:
        del sys.modules[m]
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{{name}}: {{type(e).__name__}}: {{e}}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
