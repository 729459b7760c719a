"""The type checker over the whole package: mypy with pyproject.toml's ``[tool.mypy]``
(``files = ["pmd_jax"]``) exits 0, as
``python -m mypy`` run by hand in the repository root does. Its report is printed when it
does not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_clean():
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    report = f"{proc.stdout}{proc.stderr}"
    print(report)
    assert proc.returncode == 0, (
        f"mypy (pyproject.toml [tool.mypy]) exited {proc.returncode}:\n{report}")
