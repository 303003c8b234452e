"""The README and docs stay true: CI runs the README's test command, and every Python example runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(), flags=re.S)


def test_ci_runs_the_readme_test_command():
    readme_cmds = [b.strip() for b in blocks(ROOT / "README.md", "bash")]
    assert len(readme_cmds) >= 2, "the README starts with two commands: the main job, then the tests"
    test_cmd = readme_cmds[1]
    assert "pytest" in test_cmd
    ci_lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_cmd in ci_lines


@pytest.mark.parametrize("path, index", [(p, i) for p in DOCS for i in range(len(blocks(p, "python")))],
                         ids=lambda v: v.name if isinstance(v, Path) else str(v))
def test_python_examples_run(path, index, tmp_path, monkeypatch):
    code = blocks(path, "python")[index]
    if "transformers" in code:  # the hf extra
        pytest.importorskip("transformers")
    if "Trainer" in code:
        pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (the hf extra)")
    monkeypatch.chdir(tmp_path)
    code = code.replace('"/tmp/swap"', repr(str(tmp_path / "swap")))
    exec(compile(code, f"{path.name}[{index}]", "exec"), {"__name__": "__docs__"})
