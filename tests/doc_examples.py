"""The examples of README.md and docs/*.md (as the site shows them), found and run as they are
written (tests/test_docs.py).

A page's fenced blocks in python, bash, sh or console are its examples. The python blocks run in
one namespace per page, in order (a block may use what an earlier one made); the shell blocks run
in bash with `set -eo pipefail`, every `curl` failing on an HTTP error status, in the current
folder; a console block's `$ ` lines are its commands. Before a block runs, the page's
localhost:8080 (the gateway), :8000, :8001 and :8002 (Triton's HTTP, gRPC and metrics ports)
become the test server's, and `.venv/bin/` the running Python's folder. A block that cannot run
against a test server is marked on the line before it, `<!-- not-run: REASON -->`; blocks in other
languages (json, text) are shown, not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SITE_SOURCE = re.compile(r"\A<!-- site: (\S+) -->\n")  # the site shows that file instead (scripts/mkdocs_hooks.py)


def shown(page: Path) -> Path:
    """The file whose Markdown the site shows for `page`: itself, or the one its marker names."""
    marker = SITE_SOURCE.match(page.read_text())
    return (page.parent / marker[1]).resolve() if marker else page


# README.md and every docs page as the site shows them (docs/index.md: the README; benchmarks.md: perf/README.md).
PAGES = list(dict.fromkeys([ROOT / "README.md", *(shown(page) for page in sorted(DOCS.glob("*.md")))]))
RUN = ("python", "bash", "sh", "console")  # the languages run; others are shown only
FENCE = re.compile(r"^(?:<!-- not-run:(?P<reason>[^\n]*?)-->\n)?```(?P<lang>[\w-]*)[^\n]*\n(?P<code>.*?)^```$",
                   re.M | re.S)
NOT_RUN = re.compile(r"^<!-- not-run:", re.M)
# The shell examples' prelude: stop at the first failure, a failed request included.
SHELL = 'set -eo pipefail\ncurl() { command curl --silent --show-error --fail-with-body "$@"; }\n'


@dataclass(frozen=True)
class Example:
    page: Path
    line: int  # the fence's line number (1-based)
    lang: str
    code: str
    not_run: str | None  # the page's reason for not running it; None: no marker

    @property
    def runs(self) -> bool:
        return self.lang in RUN and self.not_run is None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def examples(page: Path) -> list[Example]:
    """Every fenced block of `page`, in order."""
    text = page.read_text()
    found = []
    for m in FENCE.finditer(text):
        fence_at = m.start("lang") - 3
        reason = m["reason"].strip() if m["reason"] is not None else None
        found.append(Example(page, text.count("\n", 0, fence_at) + 1, m["lang"], m["code"], reason))
    return found


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block of a page's text."""
    return [(m["lang"], m["code"]) for m in FENCE.finditer(text)]


@dataclass(frozen=True)
class Ports:
    """Where a page's localhost ports go: the gateway's URL, and Triton's HOST:PORT addresses."""

    gateway: str  # http://HOST:PORT
    http: str | None = None
    grpc: str | None = None
    metrics: str | None = None

    def substitute(self, code: str, where: str) -> str:
        code = code.replace("http://localhost:8080", self.gateway).replace("localhost:8080",
                                                                          self.gateway.split("://", 1)[1])
        for port, address in (("8000", self.http), ("8001", self.grpc), ("8002", self.metrics)):
            if f"localhost:{port}" in code:
                assert address, f"{where} calls localhost:{port}, which this test server does not serve"
                code = code.replace(f"localhost:{port}", address)
        return code.replace(".venv/bin/", f"{Path(sys.executable).parent}/")


def shell_code(example: Example) -> str:
    if example.lang != "console":
        return example.code
    return "".join(line[2:] + "\n" for line in example.code.splitlines() if line.startswith("$ "))


def run_examples(page: Path, target: str | Ports, folder: Path | None = None) -> tuple[dict, list[str]]:
    """Run `page`'s examples against the gateway at `target` (a URL), or at the server `target`
    names, in `folder` (default: the current one) -> (the python blocks' namespace, each shell
    block's stderr)."""
    ports = Ports(target) if isinstance(target, str) else target
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    namespace: dict = {}
    logs = []
    for example in examples(page):
        if not example.runs:
            continue
        code = ports.substitute(example.code if example.lang == "python" else shell_code(example), example.where)
        if example.lang == "python":
            padded = "\n" * example.line + code  # tracebacks give the page's line numbers
            exec(compile(padded, str(page), "exec"), namespace)  # noqa: S102 - the page's own examples
            continue
        done = subprocess.run(["bash", "-c", SHELL + code], env=env, cwd=folder, capture_output=True, timeout=300)
        assert done.returncode == 0, (f"{example.where} failed ({done.returncode}):\n{code}\n"
                                      f"stdout: {done.stdout.decode()[-3000:]}\nstderr: {done.stderr.decode()[-3000:]}")
        logs.append(done.stderr.decode())
    return namespace, logs
