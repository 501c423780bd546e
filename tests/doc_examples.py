"""The examples of README.md and docs/*.md (as the site shows them), found and run as they are
written (tests/test_docs.py).

A page's fenced blocks in python, bash, sh or console are its examples. The python blocks run in
one namespace per page, in order (a block may use what an earlier one made); the shell blocks run
in bash with `set -eo pipefail`, every `curl` failing on an HTTP error status, in the current
folder, each curl answer ending its own line. A console block is a transcript: each `$ ` line is a
command and the lines after it the answer shown, which must be the answer given (equal as JSON
when it is JSON; the command's curl does not fail on an error status there, so an error's answer
can be shown). Before a block runs, the page's
localhost:8080 (the gateway), :8000, :8001 and :8002 (Triton's HTTP, gRPC and metrics ports)
become the test server's, and `.venv/bin/` the running Python's folder. A block that cannot run
against a test server is marked on the line before it, `<!-- not-run: REASON -->`; blocks in other
languages (json, text) are shown, not run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
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
# The shell examples' prelude: stop at the first failure, a failed request included; each answer on a line of its own.
SHELL = 'set -eo pipefail\ncurl() { command curl --silent --show-error --fail-with-body "$@" && echo; }\n'
# A transcript's command: its curl answers whatever the status (the answer shown may be an error).
TRANSCRIPT = 'set -eo pipefail\ncurl() { command curl --silent --show-error "$@"; }\n'


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


def transcript(code: str) -> list[tuple[str, str]]:
    """A console block's (command, answer shown) pairs: each `$ ` line and the lines up to the next."""
    pairs: list[tuple[str, list[str]]] = []
    for line in code.splitlines():
        if line.startswith("$ "):
            pairs.append((line[2:], []))
        else:
            assert pairs, f"a console block's first line is not a `$ ` command: {line!r}"
            pairs[-1][1].append(line)
    return [(command, "\n".join(answer).strip()) for command, answer in pairs]


def same_answer(given: str, shown: str) -> bool:
    """The answer given is the one shown: equal as JSON when the shown one is JSON (its lines
    joined: a long answer is wrapped on the page), else as text."""
    try:
        expected = json.loads(shown.replace("\n", ""))
    except ValueError:
        return given.strip() == shown
    try:
        return json.loads(given) == expected
    except ValueError:
        return False


@dataclass
class Ran:
    """What a page's examples left: the python blocks' namespace, and each shell block's code, stdout and stderr."""

    namespace: dict = field(default_factory=dict)
    shell: list[Example] = field(default_factory=list)
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)


def run_shell(prelude: str, code: str, where: str, folder: Path | None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(["bash", "-c", prelude + code], env=env, cwd=folder, capture_output=True, timeout=300)
    assert done.returncode == 0, (f"{where} failed ({done.returncode}):\n{code}\n"
                                  f"stdout: {done.stdout.decode()[-3000:]}\nstderr: {done.stderr.decode()[-3000:]}")
    return done


def run_examples(page: Path, target: str | Ports, folder: Path | None = None) -> Ran:
    """Run `page`'s examples against the gateway at `target` (a URL), or at the server `target`
    names, in `folder` (default: the current one) -> what they left."""
    ports = Ports(target) if isinstance(target, str) else target
    ran = Ran()
    for example in examples(page):
        if not example.runs:
            continue
        if example.lang == "python":
            padded = "\n" * example.line + ports.substitute(example.code, example.where)  # tracebacks: the page's lines
            exec(compile(padded, str(page), "exec"), ran.namespace)  # noqa: S102 - the page's own examples
        elif example.lang == "console":
            for command, shown in transcript(example.code):
                given = run_shell(TRANSCRIPT, ports.substitute(command, example.where), example.where, folder)
                assert same_answer(given.stdout.decode(), shown), \
                    f"{example.where}: `{command}` answered\n{given.stdout.decode()}\nnot, as the page shows,\n{shown}"
        else:
            done = run_shell(SHELL, ports.substitute(example.code, example.where), example.where, folder)
            ran.shell.append(example)
            ran.stdout.append(done.stdout.decode())
            ran.stderr.append(done.stderr.decode())
    return ran
