"""docs/batch.md's examples, run as they are written against a test gateway: its ```python blocks
in one namespace, in order, and its ```sh blocks in bash, in the same folder (the page's
localhost:8080 replaced by the test gateway's address)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import RunningServer
from test_gateway import port_of, start_gateway

PAGE = Path(__file__).resolve().parents[1] / "docs" / "batch.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.M | re.S)


def code_blocks(text: str) -> list[tuple[str, str]]:
    return [(m[1], m[2]) for m in BLOCK.finditer(text)]


@pytest.fixture(scope="module")
def gateway(server: RunningServer, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("batch-docs-gateway")  # (no API key: the page's examples send none)
    gw = start_gateway(tmp, server.grpc_url, "--batch-data", str(tmp / "data"), "--triton-repository",
                       str(server.repo), http=port_of(server.http_url))
    yield gw
    gw.stop()


def test_the_batch_page_examples_run(gateway, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    blocks = code_blocks(PAGE.read_text())
    assert [lang for lang, _ in blocks] == ["python", "python", "python", "sh", "python", "sh", "sh"]
    namespace: dict = {}
    logs = []
    for lang, code in blocks:
        code = code.replace("http://localhost:8080", gateway.url)
        if lang == "python":
            exec(compile(code, str(PAGE), "exec"), namespace)  # noqa: S102 - the page's own examples
            continue
        done = subprocess.run(["bash", "-ec", code], env=env, capture_output=True, timeout=300)
        assert done.returncode == 0, done.stderr.decode()
        logs.append(done.stderr.decode())
    batch = namespace["batch"]
    assert batch.status == "completed" and batch.request_counts.completed == 4
    assert set(namespace["answers"]) == {"doc-0", "doc-1", "doc-2", "ranking-0"}
    assert namespace["vectors"].num_rows == 3
    assert "3 of 3 already in vectors.parquet" in logs[1]  # the second run sends nothing
    answered = [json.loads(line) for line in Path("answers.jsonl").read_text().splitlines()]
    assert sorted(r["custom_id"] for r in answered) == ["doc-0", "doc-1", "doc-2", "ranking-0"]
