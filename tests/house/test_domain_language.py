"""The tree speaks of the domain only: no word of how it was built (work sessions, issue or review numbers,
tuning diaries, scratch paths). That history belongs in commit messages and CHANGELOG.md; a comment says why
the code is as it is, a test is named after the behaviour or threat it pins."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Each pattern names one way the building process leaks into the tree.
PATTERNS: dict[str, str] = {
    "an issue number": r"\bissues?\s*#?\d+",
    "a review finding id": r"\breview\s*#?\d+|\breview\d+|\breview [A-Z]\d\b",
    "a work sessio"
    "n": r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    r"thirteenth|fourteenth|fifteenth|sixteenth|this|last|next|previous|one|the)\s+session\b|"
    r"\bsession\s+\d+\b",
    "a tuning lever or probe": r"(?<![A-Za-z])(?:levers?|probes?|probing)(?![A-Za-z])",
    "a scratch path": r"(?<![\w.-])/work/|/tmp/old\d+",
}
# The checked tree: every tracked text file but the history itself and this file (which must name the
# patterns).
EXCLUDED = {"CHANGELOG.md", "tests/house/test_domain_language.py"}
SUFFIXES = {".py", ".md", ".toml", ".txt", ".json", ".yaml", ".yml", ".sh", ".cfg", ".ini", ""}


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / p for p in out.splitlines() if p not in EXCLUDED and Path(p).suffix in SUFFIXES]


def _hits(pattern: str) -> list[str]:
    rx = re.compile(pattern, re.IGNORECASE)
    found = []
    for path in _tracked():
        if not path.is_file():
            continue
        rel = path.relative_to(REPO).as_posix()
        if rx.search(rel):
            found.append(f"{rel} (file name)")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += [
            f"{rel}:{i}: {line.strip()[:120]}"
            for i, line in enumerate(text.splitlines(), 1)
            if rx.search(line)
        ]
    return found


@pytest.mark.parametrize("what", sorted(PATTERNS))
def test_no_process_words_in_the_tree(what: str) -> None:
    hits = _hits(PATTERNS[what])
    assert not hits, (
        f"{what} in the tree (history belongs in commit messages and CHANGELOG.md):\n" + "\n".join(hits[:40])
    )


@pytest.mark.parametrize(
    "line, what",
    [
        ("# measured in the fifteenth session", "a work session"),
        ("fixed for issue 15", "an issue number"),
        ("(review70 H1)", "a review finding id"),
        ("bench/auxgen_levers.py", "a tuning lever or probe"),
        ("PYTHONPATH=/work/main", "a scratch path"),
    ],
)
def test_each_pattern_catches_what_it_names(line: str, what: str) -> None:
    assert re.search(PATTERNS[what], line, re.IGNORECASE)


@pytest.mark.parametrize(
    "line",
    [
        "an onnxruntime InferenceSession of the model",
        "the sealed session reads no file",
        "a child in a new session (setsid)",
        "the release's clip bound",
    ],
)
def test_domain_words_pass(line: str) -> None:
    assert not any(re.search(p, line, re.IGNORECASE) for p in PATTERNS.values())
