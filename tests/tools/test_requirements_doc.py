"""docs/requirements.md stands alone: the repository cites no requirement ids of an outside
document and no "seed" article, and every requirement on the page points into real code and tests.

A citation looked like "(S7)", "S18:", "(S5, S18)", "S1/S9", "S11-S14", "S1–S19" or "G3"; a section
number such as "S5.3" or "§5" is not one. No model is loaded.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "requirements.md"
SCANNED = ["minisgl_backend", "adapters", "tests", "scripts", "csrc", "docs", "configs", "examples", ".ci"]
SCANNED_FILES = ["README.md", "setup.py", "pyproject.toml", "Makefile", "mkdocs.yml"]
SUFFIXES = {".py", ".md", ".cpp", ".h", ".sh", ".yaml", ".yml", ".toml", ".txt", ".cfg", ""}  # not task data
SKIP_DIRS = {".venv", "build", "dist", "__pycache__", ".git", ".pytest_cache", ".ruff_cache"}
CODE = ["minisgl_backend", "adapters", "csrc", "scripts", "tests"]

# An id: S or G, then digits, not glued to a word, a '§' or a '.' before it, nor followed by more
# word characters or by ".digit" (a section number such as "S5.3").
CITATION = re.compile(r"(?<![\w§.])([SG])(\d{1,2})(?![\w]|\.\d)")
# The outside article the ids came from, as the code used to name it ("the seed's table"); the RNG
# seed is always "seed" alone, `seed`, "its seed" or "the seed value".
ARTICLE = re.compile(r"\bthe seed\b(?! value)|\bseed's\b|\bseed table\b", re.I)
# Notes the project does not ship: a reader cannot follow a pointer to them.
MISSING_SOURCES = re.compile(r"BRIEF\.md|\bBRIEF S\d|FIELD_NOTES|field notes|shared/(?:seed|notes)/", re.I)


def repo_text_files(tops: list[str] = SCANNED, names: list[str] = SCANNED_FILES) -> list[Path]:
    files = [ROOT / name for name in names if (ROOT / name).is_file()]
    for top in tops:
        for path in sorted((ROOT / top).rglob("*")):
            rel = path.relative_to(ROOT).parts
            if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel):
                continue
            if path.is_file() and path.suffix in SUFFIXES and path != Path(__file__).resolve():
                files.append(path)
    return files


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def matches(files: list[Path], pattern: re.Pattern[str]) -> list[str]:
    """'file:line: text' of every line of `files` that `pattern` matches."""
    found = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            if pattern.search(line):
                found.append(f"{_rel(path)}:{lineno}: {line.strip()}")
    return found


def test_no_requirement_id_is_cited():
    files = repo_text_files()
    assert DOC in files and len(files) > 50  # the scan really covers the tree
    assert matches(files, CITATION) == []


def test_code_names_no_outside_article():
    files = repo_text_files(CODE, ["setup.py", "Makefile"])
    assert len(files) > 50
    assert matches(files, ARTICLE) == []


def test_the_checks_see_a_citation_and_an_article(tmp_path):
    bogus = tmp_path / "bogus.py"
    bogus_id = "S" + "18"  # spelt in two halves so this file itself cites nothing
    bogus.write_text(f"x = 1  # safe ({bogus_id}), see S5.3 and §5\ny = 2  # as the {'seed'}'s table says\n")
    assert matches([bogus], CITATION) == [f"{bogus}:1: x = 1  # safe ({bogus_id}), see S5.3 and §5"]
    assert len(matches([bogus], ARTICLE)) == 1
    ok = tmp_path / "ok.py"
    ok.write_text("z = 3  # keyed by `seed` and i; the seed value a request gets; --scenario seed-table\n")
    assert matches([ok], ARTICLE) == []


def test_no_file_points_at_notes_outside_the_repository():
    offenders = []
    for path in repo_text_files():
        for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if MISSING_SOURCES.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert offenders == []


def test_citation_pattern_matches_real_forms_only():
    text = "(S7) S18: (S5, S18) S1/S9 S11-S14 S1–S19 S1…S19 [S6, host] G3 S9's"
    assert [k + n for k, n in CITATION.findall(text)] == [
        "S7",
        "S18",
        "S5",
        "S18",
        "S1",
        "S9",
        "S11",
        "S14",
        "S1",
        "S19",
        "S1",
        "S19",
        "S6",
        "G3",
        "S9",
    ]
    assert CITATION.findall("S5.3 table, §S5, PS1, S100, GS1, S1x, aS2") == []


def test_every_requirement_points_into_the_code():
    sections = re.split(r"^### ", DOC.read_text(encoding="utf-8"), flags=re.MULTILINE)[1:]
    assert len(sections) >= 15
    bare = [s.splitlines()[0] for s in sections if not re.search(r"`[\w./-]+\.(?:py|cpp)\b", s)]
    assert bare == []


def test_paths_and_test_names_in_the_doc_exist():
    text = DOC.read_text(encoding="utf-8")
    missing = []
    for ref in re.findall(r"`([\w./-]+\.(?:py|cpp|sh|yaml)(?:::\w+)?)`", text):
        rel, _, test = ref.partition("::")
        candidates = [ROOT / rel, ROOT / "minisgl_backend" / rel]
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            missing.append(ref)
        elif test and not re.search(rf"^\s*(?:async\s+)?def {test}\(", path.read_text(), re.MULTILINE):
            missing.append(ref)
    assert missing == []
