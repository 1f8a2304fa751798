"""Every ```python snippet of the README runs as written (on this machine's device)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SNIPPETS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_has_snippets():
    assert len(SNIPPETS) >= 3


@pytest.mark.parametrize("i", range(len(SNIPPETS)))
def test_readme_snippet_runs(i):
    code = SNIPPETS[i]
    if "transformers" in code:
        pytest.importorskip("transformers")
    env = {"PYTHONPATH": f"{ROOT / 'python'}:{ROOT}", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, f"README snippet {i} failed:\n{code}\n{proc.stdout}\n{proc.stderr}"


def test_readme_headline_table_is_the_committed_results():
    """The headline table is generated from benchmarks/results (the hand-kept one drifted from the JSON by
    up to 20%, and quoted ratios against baselines of other sessions): regenerate it with
    `python -m fusekit.report.readme_table --write` after merging new results."""
    from fusekit.report import readme_table

    text = (ROOT / "README.md").read_text()
    want = readme_table.block(ROOT / readme_table.RESULTS)
    assert want in text, "README's headline table differs from the results: run the command above"
