"""The README's Python examples run as written: every ```python block of README.md, in order, each in a
fresh interpreter (this venv's python) started in an empty directory. Line numbers in a failing
block's traceback are README.md's.

A block that is deliberately not runnable says so on its first line, ``# not run: <why>`` (e.g. it
needs a GPU, a second program or a cluster); those are skipped, and the skip names the block's line
and reason. A failing block fails its test with the README line it starts on and the block's stderr.
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
NOT_RUN = re.compile(r"^#\s*not run:\s*(?P<why>.+)$")
BLOCK_TIMEOUT_S = 600


def python_blocks(text: str) -> list[tuple[int, str]]:
    """-> [(line number of the block's first code line, code)] for every top-level ```python fence."""
    blocks: list[tuple[int, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python" and not lines[i].startswith(" "):
            start = i + 1
            j = start
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            if j == len(lines):
                raise AssertionError(f"README.md line {i + 1}: ```python block is never closed")
            blocks.append((start + 1, "\n".join(lines[start:j]) + "\n"))
            i = j
        i += 1
    return blocks


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def test_parser_finds_blocks_and_their_lines():
    text = "intro\n```python\nx = 1\n```\n\n```\nshell\n```\n  ```python\nindented = 1\n  ```\n```python\n# not run: demo\ny\n```\n"
    assert python_blocks(text) == [(3, "x = 1\n"), (13, "# not run: demo\ny\n")]
    assert BLOCKS, "README.md has no ```python block"


@pytest.mark.slow
@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_python_block_runs(line, code, tmp_path):
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    skip = NOT_RUN.match(first.strip())
    if skip:
        pytest.skip(f"README.md line {line}: not run: {skip.group('why')}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("RUNNEL_RESULTS_DIR", str(tmp_path / "runnel_results"))
    script = tmp_path / f"readme_line_{line}.py"
    script.write_text("\n" * (line - 1) + code, encoding="utf-8")  # tracebacks give README.md's line numbers
    try:
        run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"README.md block at line {line} did not finish in {BLOCK_TIMEOUT_S} s; stderr tail:\n"
                    f"{(err.stderr or b'')[-3000:]!r}")
    if run.returncode != 0:
        pytest.fail(f"README.md block at line {line} failed (exit status {run.returncode}); stderr tail:\n"
                    f"{run.stderr[-4000:]}", pytrace=False)
