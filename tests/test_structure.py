"""The package's structure: no import circles, no imports from models/ or kernels/ up into
decode/ or serve/, and no patching of other packages outside compat.py."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "python" / "mlx_dspark"


def _modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = list(f.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(name: str, path: Path, mods: dict) -> set[str]:
    """Every module of the package that `name` imports, at module level or inside a function
    (imports under `if TYPE_CHECKING:` do not run, so they do not count)."""
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for top in ast.walk(tree)
        if isinstance(top, ast.If) and "TYPE_CHECKING" in ast.unparse(top.test)
        for b in top.body
        for n in ast.walk(b)
    }  # annotations only: never imported at run time
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        targets = []
        if isinstance(node, ast.ImportFrom):
            base = (
                ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
                if node.level
                else (node.module or "")
            )
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for t in targets:
            while t and t not in mods and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in mods and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, f, mods) for m, f in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_models_and_kernels_never_import_decode_or_serve():
    up = [
        (m, t)
        for m, ts in _graph().items()
        for t in ts
        if m.startswith(("mlx_dspark.models", "mlx_dspark.kernels"))
        and t.startswith(("mlx_dspark.decode", "mlx_dspark.serve"))
    ]
    assert up == []


def test_other_packages_are_patched_only_in_compat():
    """No class swaps (`x.__class__ = ...`) and no assignments to another package's attributes
    (`mx.fast.f = ...`, `nn.Module.f = ...`) outside compat.py."""
    found = []
    for name, path in _modules().items():
        if name == "mlx_dspark.compat":
            continue
        tree = ast.parse(path.read_text())
        imported = {
            a.asname or a.name.split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, (ast.Import, ast.ImportFrom))
            for a in n.names
            if not (isinstance(n, ast.ImportFrom) and n.level)
        }
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Assign, ast.AugAssign)):
                continue
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Attribute) and t.attr == "__class__":
                    found.append(f"{name}:{node.lineno} swaps a class")
                root = t
                while isinstance(root, ast.Attribute):
                    root = root.value
                if (
                    isinstance(t, ast.Attribute)
                    and isinstance(root, ast.Name)
                    and root.id in imported
                    and root.id not in ("self", "cls")
                ):
                    found.append(f"{name}:{node.lineno} assigns {ast.unparse(t)}")
    assert found == []


def test_no_large_files_but_the_demo_targets_drafters():
    """Weights do not pile up in git: the demo target's shipped drafters, one per drafting mode
    (replaced only at a release, see the README's "Repository" note), are the only tracked files
    over 1 MB."""
    import subprocess

    root = PKG.parents[1]
    files = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout.split(b"\0")
    big = sorted(
        f.decode()
        for f in files
        if f and (root / f.decode()).is_file() and (root / f.decode()).stat().st_size > 1 << 20
    )
    assert big == [
        "python/mlx_dspark/assets/dflash-smollm2-135m-instruct/model.safetensors",
        "python/mlx_dspark/assets/dspark-smollm2-135m-instruct/model.safetensors",
    ]
    assert all((root / f).stat().st_size < 30 << 20 for f in big)


def test_test_and_bench_runs_leave_no_temporary_folders():
    """A temporary folder made by a test or a benchmark is removed when its process exits: tests
    take fixtures.scratch_dir (the test cache in conftest.py registers its own removal), and a
    benchmark registers shutil.rmtree with atexit right after its mkdtemp. (Unremoved, one test run
    left ~50 folders in /tmp, and each auto benchmark a 600 MB converted model.)"""
    import re

    root = PKG.parents[1]
    leaks = []
    for f in sorted((root / "tests").glob("*.py")) + sorted((root / "bench").glob("*.py")):
        lines = f.read_text().splitlines()
        for i, line in enumerate(lines):
            m = re.search(r"(\w+) = (?:Path\()?tempfile\.mkdtemp\(", line)
            if "mkdtemp(" not in line or f.name in ("fixtures.py", "test_structure.py"):
                continue
            after = "\n".join(lines[i + 1 : i + 3])
            if not (m and re.search(rf"atexit\.register\(shutil\.rmtree, {m.group(1)}\b", after)):
                leaks.append(f"{f.relative_to(root)}:{i + 1}")
    assert leaks == []
