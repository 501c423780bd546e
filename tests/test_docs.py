"""Every example of README.md and docs/*.md runs, as it is written, against `pergola serve` (what
`make serve` runs) serving the models the pages name; the site builds with `mkdocs build --strict`.

How examples are found and run: tests/doc_examples.py. The server: the default model (real
weights) and seeded stand-ins in the published shapes of the other models the pages serve
(STAND_INS), with the prompts the pages' e5 line sets; a page's blocks run in a folder of their own
where `model_repository` is that server's repository. A page whose examples leave something to
check beyond "it ran" registers a check in CHECKS by its file name.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from doc_examples import NOT_RUN, PAGES, ROOT, RUN, Ports, Ran, examples, run_examples

# A Hub id that a page's `make serve` line serves -> the test server's model that stands in for it:
# the same architecture and task, so each example gets the answer's shape it would get there.
STAND_INS = {
    "sentence-transformers/all-MiniLM-L6-v2": "all-MiniLM-L6-v2",  # the default model, real weights
    "BAAI/bge-small-en-v1.5": "all-MiniLM-L6-v2",  # BERT embedders
    "intfloat/e5-small-v2": "all-MiniLM-L6-v2",
    "cross-encoder/ms-marco-MiniLM-L6-v2": "ms-marco-MiniLM-L6-v2",  # a BERT cross-encoder
    "SamLowe/roberta-base-go_emotions": "roberta-base-go_emotions",  # a sequence classifier, several labels
    "BAAI/bge-m3": "bge-m3",  # XLM-RoBERTa with bge-m3's sparse and ColBERT heads
}
SERVE_LINE = re.compile(r"make serve ARGS=\"((?:[^\"\\]|\\.)*)\"")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, minilm_folder: Path, rerank_folders: dict[str, Path]):
    from conftest import start_serve
    from pergola_testing import make_bge_m3_folder, make_classifier_folder

    root = tmp_path_factory.mktemp("docs-serve")
    folders = {"ms-marco-MiniLM-L6-v2": rerank_folders["cross-encoder"],
               "roberta-base-go_emotions": make_classifier_folder(root / "classifier", "bert", seed=3),
               "bge-m3": make_bge_m3_folder(root / "bge-m3", "tiny")}
    more = [arg for name, folder in folders.items() for arg in ("--model", f"{name}={folder}")]
    process = start_serve(root, f"all-MiniLM-L6-v2={minilm_folder}", *more,
                          "--query-prompt", "query: ", "--document-prompt", "passage: ",  # the pages' e5 line
                          "--tokenizer-instances", "1", "--batch-data", str(root / "batch"))
    try:
        gateway = process.wait_gateway()
        yield process, Ports(gateway, f"127.0.0.1:{process.http}", f"127.0.0.1:{process.grpc}",
                             f"127.0.0.1:{process.metrics}")
    finally:
        process.stop()


def check_batch_page(page: Path, ran: Ran, folder: Path) -> None:
    """docs/batch.md: the Batch API job answered every line; `pergola batch` wrote the vectors, and
    its second run found them all written and sent nothing."""
    assert [e.lang for e in examples(page)] == ["python", "python", "python", "sh", "python", "sh", "sh"]
    batch = ran.namespace["batch"]
    assert batch.status == "completed" and batch.request_counts.completed == 4
    assert set(ran.namespace["answers"]) == {"doc-0", "doc-1", "doc-2", "ranking-0"}
    assert ran.namespace["vectors"].num_rows == 3
    assert "3 of 3 already in vectors.parquet" in ran.stderr[1]  # the second run sends nothing
    answered = [json.loads(line) for line in (folder / "answers.jsonl").read_text().splitlines()]
    assert sorted(r["custom_id"] for r in answered) == ["doc-0", "doc-1", "doc-2", "ranking-0"]


def check_api_page(page: Path, ran: Ran, folder: Path) -> None:
    """docs/api.md: every curl of its shell blocks answered JSON, one answer a line; its error
    transcripts (console blocks, compared as they run) are there."""
    assert "console" in {e.lang for e in examples(page)}
    curls = 0
    for example, out in zip(ran.shell, ran.stdout):
        if "curl " not in example.code:
            continue
        answers = [line for line in out.splitlines() if line.strip()]
        assert len(answers) == example.code.count("curl "), f"{example.where}: {out[-2000:]}"
        for line in answers:
            json.loads(line)
        curls += len(answers)
    assert curls >= 20, curls


def check_long_documents_page(page: Path, ran: Ran, folder: Path) -> None:
    """docs/long-documents.md: `each` answered windows that cover the document, `late` as many,
    `mean` one vector per input counting its windows."""
    assert [e.lang for e in examples(page)] == ["json", "python", "python", "python"]
    windows, document = ran.namespace["windows"], ran.namespace["document"]
    assert len(windows) > 5 and windows[0].chunk == 0 and windows[-1].text_span[1] == len(document)
    assert len(ran.namespace["late"]) == len(windows)
    assert [item.chunks for item in ran.namespace["pooled"].data] == [len(windows), 1]


CHECKS: dict[str, Callable[[Path, Ran, Path], None]] = {
    "batch.md": check_batch_page, "api.md": check_api_page, "long-documents.md": check_long_documents_page}
RUNNABLE = [page for page in PAGES if any(e.runs for e in examples(page))]


@pytest.mark.parametrize("page", RUNNABLE, ids=[str(p.relative_to(ROOT)) for p in RUNNABLE])
def test_the_examples_of_each_page_run(page: Path, served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    process, ports = served
    (tmp_path / "model_repository").symlink_to(process.repo)  # the admin token's place, as under `make serve`
    monkeypatch.chdir(tmp_path)
    ran = run_examples(page, ports, tmp_path)
    if page.name in CHECKS:
        CHECKS[page.name](page, ran, tmp_path)


def test_every_block_that_does_not_run_says_why():
    """Each `not-run` marker stands right before a block of a language that would run, with a
    reason; every fenced block names its language (an unnamed one would hide an example)."""
    counts = {"run": 0, "not run": 0, "shown": 0}
    reasons: dict[str, int] = {}
    for page in PAGES:
        found = examples(page)
        marked = [e for e in found if e.not_run is not None]
        assert len(NOT_RUN.findall(page.read_text())) == len(marked), \
            f"{page.name}: a not-run marker that is not on the line right before a fenced block"
        for e in found:
            assert e.lang, f"{e.where}: a fenced block without a language"
            if e.not_run is not None:
                assert e.lang in RUN, f"{e.where}: a not-run marker on a {e.lang} block, which never runs"
                assert len(e.not_run.split()) >= 2, f"{e.where}: say why the block does not run"
                reasons[e.not_run] = reasons.get(e.not_run, 0) + 1
            counts["run" if e.runs else "not run" if e.lang in RUN else "shown"] += 1
    print(f"\nexamples: {counts}")
    for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        print(f"  {n} x not run: {reason}")
    assert counts["run"] > counts["not run"]


def test_the_models_the_pages_serve_have_stand_ins():
    """Every Hub id a page's `make serve ARGS=...` line serves is served by the test server as a
    stand-in (or the page's examples would meet a model the test never served)."""
    named = set()
    for page in PAGES:
        for e in examples(page):
            for args in SERVE_LINE.findall(e.code.replace("\\\n", " ")):
                words = shlex.split(args)
                for flag, value in zip(words, words[1:]):
                    model = value.split("=", 1)[-1].split("@", 1)[0]
                    if flag == "--model" and not model.startswith(("/", ".")):
                        named.add(model)
    assert named, "no `make serve ARGS=\"--model ...\"` line found"
    missing = named - set(STAND_INS)
    assert not missing, f"pages serve {sorted(missing)}: add a stand-in to STAND_INS (and the server)"


def mkdocs_build(project: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=project,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))  # (material's notice about mkdocs 2)


def test_the_site_builds_strictly(tmp_path: Path):
    """mkdocs.yml with --strict: a broken link or anchor, in a page or into the repository, fails."""
    done = mkdocs_build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_a_link_to_a_missing_repository_file_fails_the_build(tmp_path: Path):
    """The hook checks links that leave docs/ (GitHub follows them, mkdocs cannot): a file that is
    there is carried into the site, one that is not fails --strict."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "present.py").write_text("x = 1\n")
    (tmp_path / "docs" / "index.md").write_text("# t\n\n[there](../present.py), [gone](../missing.py)\n")
    (tmp_path / "mkdocs.yml").write_text(f"site_name: t\nhooks:\n  - {ROOT / 'scripts' / 'mkdocs_hooks.py'}\n")
    done = mkdocs_build(tmp_path, tmp_path / "site")
    assert done.returncode != 0 and "'../missing.py'" in done.stderr, done.stderr
    assert "present.py'" not in done.stderr
    (tmp_path / "docs" / "index.md").write_text("# t\n\n[there](../present.py)\n")
    done = mkdocs_build(tmp_path, tmp_path / "site")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "site" / "_repository" / "present.py").read_text() == "x = 1\n"
