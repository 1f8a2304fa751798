"""The H200 check scripts (benchmarks/gpu_checks/*.py) still import on the CPU.

They run only where device time is spent, so a rename in fusekit broke one unseen for several sessions
(norms.py imported the removed `fusekit.reference`, and its first device call of 2026-12-02 failed). Each
script's `--help` must print its usage; a script that needs a GPU at import may instead stop on the
missing CUDA driver, never on a missing module or name of this repository. `--help` does not reach names
used only inside functions (hf_host_path.py called `e2e._shapes` after the e2e package stopped re-exporting
it), so every `alias.name` a script takes from a module of this repository must also resolve.
"""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks" / "gpu_checks").glob("*.py") if not p.name.startswith("_"))
NO_GPU = ("libcuda", "CUDA", "cuda")  # what a GPU-only import may stop on here


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_gpu_check_script_imports(script: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), str(ROOT)])}
    res = subprocess.run(
        [sys.executable, str(script), "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if res.returncode == 0:
        assert "usage" in res.stdout.lower(), res.stdout[-2000:]
        return
    last = (res.stderr.strip().splitlines() or [""])[-1]
    broken = ("ImportError", "ModuleNotFoundError", "AttributeError", "NameError", "SyntaxError")
    assert not last.startswith(broken) and any(s in last for s in NO_GPU), res.stderr[-3000:]


def _module(name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False


def _resolves(module: str, name: str) -> bool:
    """`module.name` exists, or is a subpackage reached as an attribute once imported (fusekit.hf)."""
    return hasattr(importlib.import_module(module), name) or _module(f"{module}.{name}")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_gpu_check_script_names_resolve(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`from fusekit... import x` and every `alias.attr` on an imported fusekit / kernels_triton module."""
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.syspath_prepend(str(ROOT / "python"))
    tree = ast.parse(script.read_text())
    ours = ("fusekit", "kernels_triton")
    aliases: dict[str, str] = {}  # local name -> module it is bound to
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ours:
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ours:
            for a in node.names:
                if not _resolves(node.module, a.name):
                    missing.append(f"from {node.module} import {a.name}")
                elif _module(f"{node.module}.{a.name}"):
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        attr = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        if attr and node.value.id in aliases and not _resolves(aliases[node.value.id], node.attr):
            missing.append(f"{node.value.id}.{node.attr} ({aliases[node.value.id]})")
    assert not missing, missing


def test_the_scripts_are_found() -> None:
    assert {"norms.py", "decode.py", "ffn.py"} <= {p.name for p in SCRIPTS}
