"""docs/batch.md's examples, run as they are written against a test gateway (doc_examples.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import RunningServer
from doc_examples import DOCS, code_blocks, run_examples
from test_gateway import port_of, start_gateway

PAGE = DOCS / "batch.md"


@pytest.fixture(scope="module")
def gateway(server: RunningServer, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("batch-docs-gateway")  # (no API key: the page's examples send none)
    gw = start_gateway(tmp, server.grpc_url, "--batch-data", str(tmp / "data"), "--triton-repository",
                       str(server.repo), http=port_of(server.http_url))
    yield gw
    gw.stop()


def test_the_batch_page_examples_run(gateway, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = code_blocks(PAGE.read_text())
    assert [lang for lang, _ in blocks] == ["python", "python", "python", "sh", "python", "sh", "sh"]
    namespace, logs = run_examples(PAGE, gateway.url)
    batch = namespace["batch"]
    assert batch.status == "completed" and batch.request_counts.completed == 4
    assert set(namespace["answers"]) == {"doc-0", "doc-1", "doc-2", "ranking-0"}
    assert namespace["vectors"].num_rows == 3
    assert "3 of 3 already in vectors.parquet" in logs[1]  # the second run sends nothing
    answered = [json.loads(line) for line in Path("answers.jsonl").read_text().splitlines()]
    assert sorted(r["custom_id"] for r in answered) == ["doc-0", "doc-1", "doc-2", "ranking-0"]
