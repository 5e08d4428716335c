"""The docs quote measured figures from one place: a sentence of decisions.md or http-api.md that cites
benchmarks.md names the script whose section it quotes, and every number in it is in that section."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
QUOTING = ("decisions.md", "http-api.md")
SCRIPT = re.compile(r"`([a-z_]+)(?:\.py)?`")
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?!\w)")
SENTENCE_END = re.compile(r"(?<=[.;:])\s+(?=[A-Z(])")


def benchmark_sections() -> dict[str, str]:
    """Each script's section of benchmarks.md (its heading names the script), numbers without commas."""
    sections: dict[str, str] = {}
    for part in re.split(r"^## ", (DOCS / "benchmarks.md").read_text(), flags=re.M)[1:]:
        heading, _, body = part.partition("\n")
        for script in SCRIPT.findall(heading):
            sections[script] = sections.get(script, "") + body.replace(",", "")
    return sections


def quoting_sentences(text: str) -> list[str]:
    """The sentences that cite benchmarks.md for their figures (the page's link to it aside)."""
    sentences = []
    for paragraph in re.split(r"\n\s*\n", text):
        flat = " ".join(paragraph.split())
        sentences += [s for s in SENTENCE_END.split(flat) if "benchmarks.md" in s and "](benchmarks.md)" not in s]
    return sentences


def problems_in(name: str, text: str, sections: dict[str, str]) -> list[str]:
    problems = []
    for sentence in quoting_sentences(text):
        scripts = [s for s in SCRIPT.findall(sentence) if s in sections]
        if not scripts:
            problems.append(f"{name}: names no benchmark section: {sentence[:120]}")
            continue
        body = "".join(sections[s] for s in scripts)
        missing = [n for n in NUMBER.findall(sentence) if n.replace(",", "") not in body]
        if missing:
            problems.append(f"{name}: {missing} not in benchmarks.md's {scripts}: {sentence[:120]}")
    return problems


def test_every_figure_quoted_from_benchmarks_md_is_there():
    sections = benchmark_sections()
    problems = [p for name in QUOTING for p in problems_in(name, (DOCS / name).read_text(), sections)]
    assert not problems, "\n".join(problems)


def test_the_check_finds_a_figure_that_is_not_there_or_no_section():
    sections = {"soak": "grew 4.7% in 10 minutes; 1024 cells"}
    assert problems_in("d", "The soak grew 4.7% over 1,024 cells (benchmarks.md, `soak.py`).", sections) == []
    wrong = problems_in("d", "The soak grew 5.1% (benchmarks.md, `soak.py`). Other 9.9%.", sections)
    assert len(wrong) == 1 and "['5.1']" in wrong[0]
    assert "names no benchmark section" in problems_in("d", "It grew 4.7% (benchmarks.md).", sections)[0]
