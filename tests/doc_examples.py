"""A docs page's examples, run as they are written against a test gateway: its ```python blocks
in one namespace, in order, and its ```sh blocks in bash, in the current folder (the page's
localhost:8080 replaced by the test gateway's address)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.M | re.S)
RUN = ("python", "sh")  # the languages run; others (json) are shown only


def code_blocks(text: str) -> list[tuple[str, str]]:
    return [(m[1], m[2]) for m in BLOCK.finditer(text)]


def run_examples(page: Path, url: str) -> tuple[dict, list[str]]:
    """Run `page`'s python and sh blocks against the gateway at `url` -> (the python blocks'
    namespace, each sh block's stderr)."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    namespace: dict = {}
    logs = []
    for lang, code in code_blocks(page.read_text()):
        if lang not in RUN:
            continue
        code = code.replace("http://localhost:8080", url)
        if lang == "python":
            exec(compile(code, str(page), "exec"), namespace)  # noqa: S102 - the page's own examples
            continue
        done = subprocess.run(["bash", "-ec", code], env=env, capture_output=True, timeout=300)
        assert done.returncode == 0, done.stderr.decode()
        logs.append(done.stderr.decode())
    return namespace, logs
