"""The docs stay honest: the mkdocs site builds with --strict (no broken link, anchor or nav page), README.md stays a
short front page that starts with the two commands, and every test and GPU case the docs cite exists."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 200
# tests/unit/test_x.py or tests/unit/test_x.py::test_name (a [param] suffix allowed)
NODE_ID = re.compile(r"\b(tests/[\w/]+\.py)(?:::(\w+)(?:\[[^\]`\s]*\])?)?")
# a repository file named in the text (placeholders such as <name>.py do not match)
REPO_FILE = re.compile(r"\b((?:tests|wanexp|conf|sweeps|benchmarks)/[\w/.-]*?\.(?:py|sh|yaml|md))\b")
GPU_CASE = re.compile(r"python -m tests\.gpu\.run (\w+)")
README_LINK = re.compile(r"\]\((docs/[\w-]+\.md)(?:#([\w-]+))?\)")


def cited_texts() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in [README, *DOCS]}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built once with --strict: mkdocs exits non-zero on a warning (a broken link or anchor, a page left
    out of the nav, a nav entry without its page)."""
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                        "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    return out


def test_the_docs_site_builds_strictly(site):
    assert (site / "index.html").is_file()
    for page in DOCS:
        if page.stem != "index":
            assert (site / page.stem / "index.html").is_file(), f"{page.name} was not built"


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; keep it to {MAX_README_LINES}"
    assert lines[0].startswith("# ")
    # the title, one paragraph, then the first code block: exactly make demo and make test
    first_block = next(i for i, line in enumerate(lines) if line.startswith("```"))
    intro = lines[1:first_block]
    paragraphs = [p for p in "\n".join(intro).split("\n\n") if p.strip()]
    assert len(paragraphs) == 1, f"one paragraph before the commands, found {len(paragraphs)}"
    end = next(i for i in range(first_block + 1, len(lines)) if lines[i].startswith("```"))
    commands = [line.split("#")[0].strip() for line in lines[first_block + 1:end]]
    assert commands == ["make demo", "make test"]


def test_every_cited_test_exists():
    missing = []
    for doc, text in cited_texts().items():
        for path, name in set(NODE_ID.findall(text)):
            file = ROOT / path
            if not file.is_file():
                missing.append(f"{doc}: {path} (no such file)")
            elif name and not re.search(rf"^\s*(async )?def {name}\(", file.read_text(), re.M):
                missing.append(f"{doc}: {path}::{name} (no such test)")
    assert not missing, "docs cite tests that do not exist:\n" + "\n".join(sorted(missing))


def test_every_cited_repository_file_exists():
    missing = sorted({f"{doc}: {path}" for doc, text in cited_texts().items() for path in REPO_FILE.findall(text)
                      if not (ROOT / path).exists()})
    assert not missing, "docs name files that are not in the repository:\n" + "\n".join(missing)


def test_every_cited_gpu_case_is_in_the_registry():
    from tests.gpu.registry import CASES
    cited = {(doc, name) for doc, text in cited_texts().items() for name in GPU_CASE.findall(text)}
    assert cited, "the docs name no GPU case; the pattern is stale"
    unknown = sorted(f"{doc}: {name}" for doc, name in cited if name not in CASES)
    assert not unknown, "docs cite GPU cases missing from tests/gpu/registry.py:\n" + "\n".join(unknown)


def test_readme_links_point_at_built_pages_and_anchors(site):
    links = README_LINK.findall(README.read_text())
    assert links, "README.md links to no docs page"
    bad = []
    for page, anchor in links:
        html = site / Path(page).stem / "index.html"
        if not html.is_file():
            bad.append(page)
        elif anchor and f'id="{anchor}"' not in html.read_text():
            bad.append(f"{page}#{anchor}")
    assert not bad, "README.md links to missing docs pages or anchors: " + ", ".join(bad)


def test_model_folders_are_spelled_one_way():
    """A folder the docs write (convert --dst) is the folder later commands read: paths that differ only in case
    would send a user on a case-sensitive file system to a folder that does not exist."""
    spellings: dict[str, set[str]] = {}
    for text in cited_texts().values():
        for path in re.findall(r"/models/[\w.-]+", text):
            spellings.setdefault(path.lower(), set()).add(path)
    mixed = {k: sorted(v) for k, v in spellings.items() if len(v) > 1}
    assert not mixed, f"one folder, several spellings: {mixed}"


# The elements mkdocs-material builds a page of; anything else in a built page came from the markdown's text
SITE_TAGS = {"a", "article", "body", "button", "code", "div", "em", "footer", "form", "h1", "h2", "h3", "h4", "head",
             "header", "html", "img", "input", "label", "li", "link", "main", "meta", "nav", "ol", "p", "path", "pre",
             "script", "span", "strong", "style", "svg", "table", "tbody", "td", "th", "thead", "title", "tr", "ul"}


def test_no_placeholder_in_the_text_becomes_an_html_element(site):
    """A placeholder such as <metric> outside a code span is parsed as an HTML element and vanishes from the page:
    every element of the built pages is one the site builds itself."""
    from html.parser import HTMLParser

    found: dict[str, set[str]] = {}

    class Tags(HTMLParser):
        def handle_starttag(self, tag, attrs):
            found.setdefault(tag, set()).add(page)

    for html in sorted(site.rglob("*.html")):
        page = html.relative_to(site).as_posix()
        Tags().feed(html.read_text())
    stray = {tag: sorted(pages) for tag, pages in found.items() if tag not in SITE_TAGS}
    assert not stray, f"text parsed as HTML elements (put placeholders in `code`): {stray}"
