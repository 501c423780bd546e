"""docs/api.md's examples, run as they are written against `pergola serve`
(conftest.served_gateway): its ```python blocks each in a namespace of its own, its ```sh blocks in
bash (every curl answer must be 2xx and JSON), and its ```text blocks, a `$ curl` command and the
answer shown, compared with the answer given. The page's localhost:8080 is replaced by the
server's address, and its key added (`api_key="none"`, and a header on every curl)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from test_batch_docs import code_blocks

pytestmark = pytest.mark.server
PAGE = Path(__file__).resolve().parents[1] / "docs" / "api.md"
# every curl of a ```sh block with the key, failing on an error status, its answer on a line of its own
CURL = 'curl() { command curl --fail-with-body -H "Authorization: Bearer $KEY" "$@"; echo; }\n'


def for_server(code: str, url: str, key: str) -> str:
    return (code.replace("http://localhost:8080", url).replace("localhost:8080", url.removeprefix("http://"))
            .replace('api_key="none"', f'api_key="{key}"'))


@pytest.fixture(scope="module")
def blocks() -> list[tuple[str, str]]:
    found = code_blocks(PAGE.read_text())
    assert {lang for lang, _ in found} == {"python", "sh", "text"}
    return found


def test_the_python_examples_run(served_gateway, blocks):
    for lang, code in blocks:
        if lang == "python":
            exec(compile(for_server(code, served_gateway.url, served_gateway.key), str(PAGE), "exec"), {})  # noqa: S102


def test_the_curl_examples_answer_json(served_gateway, blocks):
    env = dict(os.environ, KEY=served_gateway.key)
    for lang, code in blocks:
        if lang != "sh":
            continue
        done = subprocess.run(["bash", "-ec", CURL + for_server(code, served_gateway.url, served_gateway.key)],
                              env=env, capture_output=True, timeout=300)
        assert done.returncode == 0, (code, done.stdout.decode()[-2000:], done.stderr.decode())
        answers = [line for line in done.stdout.decode().splitlines() if line.strip()]
        assert len(answers) == code.count("curl "), code
        for line in answers:
            json.loads(line)


def test_the_error_examples_are_the_answers(served_gateway, blocks):
    shown = [code for lang, code in blocks if lang == "text"]
    assert shown
    for code in shown:
        command, *answer = code.splitlines()
        command = re.sub(r"^\$ curl", f'curl -H "Authorization: Bearer {served_gateway.key}"', command)
        done = subprocess.run(["bash", "-ec", for_server(command, served_gateway.url, served_gateway.key)],
                              capture_output=True, timeout=120)
        assert json.loads(done.stdout) == json.loads("".join(answer)), done.stdout
