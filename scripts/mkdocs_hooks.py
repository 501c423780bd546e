"""mkdocs hooks (mkdocs.yml): pages that show a Markdown file from elsewhere in the repository, and
links from the pages to the repository's other files, checked and carried into the site.

Why: the pages are read on GitHub as well as in the site. On GitHub a link such as
`../perf/README.md` opens the file; in the site it would point outside it, and mkdocs cannot check
it. So:
- a page that begins with `<!-- site: ../PATH.md -->` is, in the site, that file (docs/index.md is
  the README, docs/benchmarks.md is perf/README.md), its links rebased from its own folder;
- a link to a file outside docs/ must name a file that exists (else a warning, which --strict makes
  an error), and is pointed at the page that shows it, or at a copy of it in the site
  (`_repository/PATH`, served as it is).
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

log = logging.getLogger("mkdocs.hooks.repository")
SITE_SOURCE = re.compile(r"\A<!-- site: (\S+) -->\n")
LINK = re.compile(r"(!?\[[^\]\n]*\]\()([^)\s]+)((?:\s+\"[^\"\n]*\")?\))")
FENCE = re.compile(r"^```.*?^```$", re.M | re.S)
COPIES = "_repository"


class RepositoryFile(File):
    """A repository file outside docs/ copied into the site as it is (a Markdown file too)."""

    def is_documentation_page(self) -> bool:
        return False


def _root(config: MkDocsConfig) -> Path:
    return Path(config.config_file_path).resolve().parent


def _docs(config: MkDocsConfig) -> str:
    return Path(config.docs_dir).resolve().relative_to(_root(config)).as_posix()


def source_of(markdown: str, src_uri: str, config: MkDocsConfig) -> tuple[str, str]:
    """(the Markdown a page shows, the repository path of the file it comes from)."""
    own = posixpath.join(_docs(config), src_uri)
    marker = SITE_SOURCE.match(markdown)
    if not marker:
        return markdown, own
    path = posixpath.normpath(posixpath.join(posixpath.dirname(own), marker[1]))
    return (_root(config) / path).read_text(encoding="utf-8"), path


def _shown_by(config: MkDocsConfig) -> dict[str, str]:
    """Repository path of a file shown by a page -> that page's src_uri."""
    shown = {}
    for page in sorted(Path(config.docs_dir).glob("*.md")):
        marker = SITE_SOURCE.match(page.read_text(encoding="utf-8"))
        if marker:
            shown[posixpath.normpath(posixpath.join(_docs(config), marker[1]))] = page.name
    return shown


def _targets(markdown: str, source: str) -> list[tuple[re.Match, str, str]]:
    """Each relative link outside code blocks: (match, repository path, #anchor or '')."""
    found = []
    code = [m.span() for m in FENCE.finditer(markdown)]
    for m in LINK.finditer(markdown):
        target = m[2]
        if re.match(r"[a-z][a-z0-9+.-]*:|#", target) or any(a <= m.start() < b for a, b in code):
            continue
        path, _, anchor = target.partition("#")
        found.append((m, posixpath.normpath(posixpath.join(posixpath.dirname(source), path)),
                      f"#{anchor}" if anchor else ""))
    return found


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add a site copy of every repository file outside docs/ that a page links to."""
    docs, root, shown = _docs(config), _root(config), _shown_by(config)
    wanted = set()
    for page in list(files.documentation_pages()):
        markdown, source = source_of(Path(page.abs_src_path).read_text(encoding="utf-8"), page.src_uri, config)
        for _, path, _ in _targets(markdown, source):
            if not path.startswith(f"{docs}/") and path not in shown and (root / path).is_file():
                wanted.add(path)
    for path in sorted(wanted):
        files.append(RepositoryFile.generated(config, f"{COPIES}/{path}", abs_src_path=str(root / path)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """The page's Markdown (or the file it shows), its links made relative to its place in docs/."""
    docs, root, shown = _docs(config), _root(config), _shown_by(config)
    markdown, source = source_of(markdown, page.file.src_uri, config)
    here = posixpath.dirname(page.file.src_uri)
    pieces, last = [], 0
    for m, path, anchor in _targets(markdown, source):
        if path.startswith(f"{docs}/"):
            target = path[len(docs) + 1:]
        elif path in shown:
            target = shown[path]
        elif path.startswith("../") or not (root / path).is_file():
            log.warning("%s (from %s) links to %r, which is not a file of the repository (link a file, "
                        "not a folder)", page.file.src_uri, source, m[2])
            continue
        else:
            target = f"{COPIES}/{path}"
        pieces += [markdown[last:m.start()], m[1], posixpath.relpath(target, here or ".") + anchor, m[3]]
        last = m.end()
    return "".join(pieces) + markdown[last:]
