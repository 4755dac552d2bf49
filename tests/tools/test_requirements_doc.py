"""docs/requirements.md resolves every requirement id the repository cites, and names real files.

Citations look like "(S7)", "S18:", "S6 violated", "(S5, S18)", "S1/S9", "S11-S14", "S1–S19", "G3".
A section number such as "S5.3" or "§5" is not a requirement id. No model is loaded.
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

# An id: S or G, then digits, not glued to a word, a '§' or a '.' before it, nor followed by more
# word characters or by ".digit" (a section number such as "S5.3").
CITATION = re.compile(r"(?<![\w§.])([SG])(\d{1,2})(?![\w]|\.\d)")
HEADING = re.compile(r"^###\s+([SG]\d{1,2})\b", re.MULTILINE)
# Notes the project does not ship: a reader cannot follow a pointer to them.
MISSING_SOURCES = re.compile(r"BRIEF\.md|\bBRIEF S\d|FIELD_NOTES|field notes|shared/(?:seed|notes)/", re.I)


def repo_text_files() -> list[Path]:
    files = [ROOT / name for name in SCANNED_FILES if (ROOT / name).is_file()]
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            rel = path.relative_to(ROOT).parts
            if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel):
                continue
            if path.is_file() and path.suffix in SUFFIXES:
                files.append(path)
    return files


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def cited_ids(files: list[Path]) -> dict[str, list[str]]:
    """Requirement id -> 'file:line' of every citation."""
    found: dict[str, list[str]] = {}
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            for kind, num in CITATION.findall(line):
                where = f"{_rel(path)}:{lineno}"
                found.setdefault(f"{kind}{int(num)}", []).append(where)
    return found


def defined_ids() -> set[str]:
    return set(HEADING.findall(DOC.read_text(encoding="utf-8")))


def undefined_citations(files: list[Path]) -> dict[str, list[str]]:
    defined = defined_ids()
    return {rid: where for rid, where in cited_ids(files).items() if rid not in defined}


def test_every_requirement_s1_to_s19_and_goal_g1_to_g3_has_an_entry():
    expected = {f"S{i}" for i in range(1, 20)} | {"G1", "G2", "G3"}
    assert defined_ids() == expected


def test_every_cited_requirement_id_is_defined():
    files = repo_text_files()
    assert DOC in files and len(files) > 50  # the scan really covers the tree
    assert cited_ids(files).keys() >= {"S6", "S7", "S18"}  # and really finds citations
    assert undefined_citations(files) == {}


def test_no_file_points_at_notes_outside_the_repository():
    offenders = []
    for path in repo_text_files():
        if path == Path(__file__).resolve():
            continue
        for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if MISSING_SOURCES.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert offenders == []


def test_the_check_fails_on_a_bogus_citation(tmp_path):
    bogus_id = "S" + "99"  # spelt in two halves so this file itself cites nothing undefined
    bogus = tmp_path / "bogus.py"
    bogus.write_text(f"x = 1  # the fence makes this safe ({bogus_id}), see S5.3 and §5\n")
    assert undefined_citations([*repo_text_files(), bogus]) == {bogus_id: [f"{bogus}:1"]}


def test_citation_pattern_matches_real_forms_only():
    text = "(S7) S18: S6 violated (S5, S18) S1/S9 S11-S14 S1–S19 S1…S19 [S6, host] G3 S9's"
    assert [k + n for k, n in CITATION.findall(text)] == [
        "S7",
        "S18",
        "S6",
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
