"""The front door and the docs stay true: the README's two commands are CI's, its links and the code's
`docs/architecture.md §N` citations resolve, and no product file cites a document outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("parallelisms", "models", "trainer", "checkpoint")


def _product_files() -> list[Path]:
    files = [p for package in PRODUCT for p in (REPO / package).rglob("*.py")]
    assert len(files) > 100, len(files)  # the scan found the packages
    return files


def test_the_readme_opens_with_the_two_commands_ci_runs() -> None:
    first = (REPO / "README.md").read_text().splitlines()[:4]
    ci = (REPO / ".ci" / "run").read_text()
    assert first[0] == "```bash" and first[3] == "```", first
    assert first[1].startswith("pip install torch==2.13.0 -e . && ./run_train.sh"), first[1]
    install, test = first[2].split("#")[0].strip().split(" && ")
    assert install in ci and test in ci, (install, test)


def test_the_readme_is_a_front_door() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert not re.search(r"\bstop \d+|\bissue \d+", text), "no work-item numbers or benchmark history here"


def test_every_relative_link_of_the_docs_resolves() -> None:
    pages = [REPO / "README.md", *(REPO / "docs").glob("*.md")]
    assert len(pages) >= 7, pages
    for page in pages:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_every_architecture_citation_names_a_section_of_it() -> None:
    sections = set(re.findall(r"^## (\d+)\. ", (REPO / "docs" / "architecture.md").read_text(), flags=re.M))
    assert {"1", "5", "7"} <= sections, sections
    cited = 0
    for path in _product_files():
        text = path.read_text()
        assert "DESIGN.md" not in text, f"{path.relative_to(REPO)} cites a file outside the repository"
        for number in re.findall(r"docs/architecture\.md §(\d+)", text):
            assert number in sections, f"{path.relative_to(REPO)} cites docs/architecture.md §{number}"
            cited += 1
    assert cited >= 5, cited
