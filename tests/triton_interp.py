"""Run a snippet through Triton's interpreter (CPU) in a subprocess: TRITON_INTERPRET must be set
before triton is imported, so kernels' indexing can be checked without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_in_interpreter(code: str) -> None:
    """Skip where the interpreter is too old, else assert that `code` runs and prints 'ok'."""
    triton = pytest.importorskip("triton")
    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 7):
        # Triton 3.6's interpreter cannot take a scalar argument as a loop bound (GPU-tested instead).
        pytest.skip(f"Triton {triton.__version__}'s interpreter; tests/test_gpu.py checks the kernel on a GPU")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT / "python_models"))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
