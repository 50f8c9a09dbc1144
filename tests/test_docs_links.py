"""Every reference a reader may follow leads somewhere: links, source paths, seed documents.

Files move (memory/ was split into parts); a doc that still names the old place sends its reader
nowhere. Links are resolved from the document's folder, as a Markdown viewer does; a path in
backticks (`memory/core/ids.py`) from the repository root or from durable_memory/. The design
documents the project started from (../shared/seeds/) are several: a text that relies on one
names its file.
"""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SOURCE_PATH = re.compile(r"`(([A-Za-z0-9_.-]+)/[A-Za-z0-9_./-]+\.(?:py|md|png|svg|dot|toml|json))`")
BASES = (REPO, REPO / "durable_memory")
OUR_FOLDERS = {p.name for base in BASES for p in base.iterdir() if p.is_dir()}
"""A path counts as ours when its first folder is one of these; `blocks/student.toml` (inside a
user's memory repository) or a bare `agent.toml` is an example, not a reference."""


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(document: Path) -> None:
    text = document.read_text(encoding="utf-8")
    broken = []
    for match in LINK.finditer(text):
        target = match.group(1).split("#", 1)[0]
        if not target or re.match(r"[a-z]+:", target):  # an anchor, or http:, mailto:
            continue
        if not (document.parent / target).exists():
            broken.append(f"{document.name}:{_line(text, match.start())}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_named_source_paths_exist(document: Path) -> None:
    text = document.read_text(encoding="utf-8")
    missing = [
        f"{document.name}:{_line(text, match.start())}: {match.group(1)}"
        for match in SOURCE_PATH.finditer(text)
        if match.group(2) in OUR_FOLDERS
        and not any((base / match.group(1)).exists() for base in (document.parent, *BASES))
    ]
    assert not missing, "paths to files that do not exist:\n" + "\n".join(missing)


SEED_MENTION = re.compile(r"\b[Tt]he seed\b|\bseed[']s\b")
SEED_FILE = re.compile(r"\b\d{3}_[0-9a-f]{16}\.txt\b")
SEED_CITATION_REACH = 120
"""How far after the mention (in characters) the document's file name must appear."""
SOURCES = [
    *DOCUMENTS,
    *(p for folder in ("durable_memory", "tests", "bench") for p in (REPO / folder).rglob("*.py")),
]


def test_seeds_are_cited_by_file_name() -> None:
    vague = []
    for source in SOURCES:
        text = source.read_text(encoding="utf-8")
        for match in SEED_MENTION.finditer(text):
            if not SEED_FILE.search(text, match.start(), match.end() + SEED_CITATION_REACH):
                line = _line(text, match.start())
                vague.append(f"{source.relative_to(REPO)}:{line}: {match.group(0)!r}")
    assert not vague, "name the seed document (e.g. 000_d8598551964ab573.txt):\n" + "\n".join(vague)
