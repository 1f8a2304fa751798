"""Project plumbing: pixi tasks call real nox sessions, CI runs exactly the README's test command."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _nox_sessions() -> set[str]:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            for dec in node.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                if ast.unparse(target) == "nox.session":
                    names.add(node.name)
    return names


def test_pixi_manifest_is_valid_and_tasks_name_nox_sessions():
    manifest = tomllib.loads((ROOT / "pixi.toml").read_text())
    assert manifest["workspace"]["platforms"] == ["linux-64"]
    deps = manifest["pypi-dependencies"]
    for pkg in ("torch", "triton", "max", "mojo", "nox"):
        assert pkg in deps, pkg
    assert deps["max"] == "==26.7.0" and deps["mojo"] == "==1.2.0"
    sessions = _nox_sessions()
    assert {"tests", "lint", "aot", "bench", "report"} <= sessions
    for task, cmd in manifest["tasks"].items():
        m = re.fullmatch(r"nox -s ((?:[\w-]+ ?)+)", cmd)
        assert m, f"task {task!r} does not call nox sessions: {cmd!r}"
        for s in m.group(1).split():
            assert s in sessions, f"task {task!r} names unknown nox session {s!r}"


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci_cmds = [
        ln
        for ln in (ROOT / ".ci/run").read_text().splitlines()
        if ln and not ln.startswith(("#", "set ", "cd "))
    ]
    assert len(ci_cmds) == 1, ci_cmds
    assert f"\n{ci_cmds[0]}\n" in readme, "README's test command must be the line .ci/run runs"


def test_every_python_package_is_in_the_wheel():
    """pyproject lists packages by hand: a new package left out installs without its modules (nox sessions
    install the project, not the checkout)."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT / "python").parts)
        for p in (ROOT / "python" / "fusekit").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"


def test_every_mojo_source_ships_in_the_wheel():
    """An installed fusekit compiles its Mojo ops from the package data: a .mojo file the globs miss
    (a new subpackage such as mojo/tc/) would be absent from a wheel and its op would fail to build."""
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = py["tool"]["setuptools"]["package-data"]["fusekit._mojo"]
    mojo = ROOT / "mojo"
    missing = [
        str(p.relative_to(mojo))
        for p in mojo.rglob("*.mojo")
        if not any(
            p.relative_to(mojo).match(g) and len(p.relative_to(mojo).parts) == len(Path(g).parts)
            for g in globs
        )
    ]
    assert not missing, f"not in [tool.setuptools.package-data] fusekit._mojo: {missing}"
