"""Every reference in the docs leads somewhere a reader can follow, and the docs say what holds, not how it came to.

A test a doc cites (``tests/unit/test_x.py::test_name``, ``test_x.py::test_name``, or ``::test_name`` after a file
on the same line) exists under that name; every repository path a doc cites (``deltasync/...``, ``benchmarks/...``,
in prose, tables or commands; relative links) exists in the repository; and no doc tells history: no issue or round
numbers, no "adversarial review", no "DESIGN section" (a document that is not there), no commit hash cited as the
code's past (``observed on 0374e40``). History lives in git.
"""

from __future__ import annotations

import ast
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted(
    p.relative_to(ROOT).as_posix()
    for p in [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("examples/**/README.md")]
)
TOP = ("deltasync", "services", "tests", "benchmarks", "examples", "docs", "scripts")

_SPAN = re.compile(r"`([^`\n]+)`")
_TEST_FILE = re.compile(r"(?P<file>(?:[\w.-]+/)*test_\w+\.py)(?:::(?P<name>\w+)(?P<cut>\.\.\.)?)?")
_NAME_ONLY = re.compile(r"^::(?P<name>test\w*)(?P<cut>\.\.\.)?")
_PATH = re.compile(r"(?<![\w./-])(?:\./)?((?:" + "|".join(TOP) + r")/[\w./-]*[\w/])")
_SECTION = re.compile(r"\b(?P<doc>README(?:\.md)?|(?:docs/)?[A-Z]+\.md)[,:]? (?:section )?\"(?P<title>[^\"]+)\"")
_NUMBERED = re.compile(r"\b(?:(?:[A-Z]+\.md|README)[,:]? (?:section |§)?\d+[a-z]?|[Ss]ection \d+[a-z]?)\b")
_ANCHOR = re.compile(r"\]\(#([^)\s]+)\)")
_ITEM = re.compile(r"^\s*(?:[-*]|\d+\.) ")
_LINK = re.compile(r"\]\((?!https?://|#|mailto:)([^)\s#]+)(?:#[^)]*)?\)")
_HISTORY = [
    (re.compile(r"\bissues? #?\d+", re.I), "an issue number"),
    (re.compile(r"(?<!--)\brounds? \d+", re.I), "a round number"),
    (
        re.compile(
            r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
            r"fourteenth|fifteenth|sixteenth|scale)(?:'s)?\W+(?:\w+\W+)?round\b",
            re.I,
        ),
        "a numbered round",
    ),
    (re.compile(r"\badversarial review\b", re.I), "a review as history"),
    (re.compile(r"\bDESIGN\b"), "DESIGN (no such document)"),
    (
        re.compile(
            r"\b(?:commit|at|on|of|before|since|main|than)\s+`?(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"
        ),
        "a commit hash as history",
    ),
]


@cache
def _tracked() -> frozenset[str]:
    """Every path git tracks here, with every directory above one (what a fresh clone has); outside a git checkout,
    none (the files on disk are what there is)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return frozenset()
    files = {f for f in out.decode().split("\0") if f}
    dirs = {p.as_posix() for f in files for p in Path(f).parents if p.as_posix() != "."}
    return frozenset(files | dirs)


def _exists(path: str) -> bool:
    path = path.rstrip("/").removeprefix("./")
    return path in _tracked() or (ROOT / path).exists()


@cache
def _tests_named(basename: str) -> tuple[str, ...]:
    return tuple(sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob(basename)))


@cache
def _test_names(path: str) -> frozenset[str]:
    tree = ast.parse((ROOT / path).read_text())
    return frozenset(
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test")
    )


@cache
def _headings(doc: str) -> tuple[str, ...]:
    """The headings of a doc, lower case, outside fenced code."""
    found, fenced = [], False
    for line in (ROOT / doc).read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            found.append(line.lstrip("#").strip().lower())
    return tuple(found)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _section_problems(where: str, line: str) -> list[str]:
    """A section cited by its title (``PROTOCOL.md, "Several coordinators"``) is a heading of that doc; none is
    cited by a number (the docs' headings have none)."""
    problems = [
        f"{where}: {m.group(0)!r} cites a section by number: name its heading" for m in _NUMBERED.finditer(line)
    ]
    for m in _SECTION.finditer(line):
        name = m.group("doc")
        doc = "README.md" if name.startswith("README") else "docs/" + name.removeprefix("docs/")
        title = m.group("title").lower()
        if not (ROOT / doc).exists():
            problems.append(f"{where}: {doc} does not exist")
        elif not any(h.startswith(title) for h in _headings(doc)):
            problems.append(f"{where}: {doc} has no section {m.group('title')!r}")
    return problems


def _resolve(file: str) -> tuple[str | None, str]:
    """The repository path of a cited test file, or None and why."""
    if "/" in file:
        return (file, "") if _exists(file) else (None, f"{file} does not exist")
    found = _tests_named(file)
    if len(found) == 1:
        return found[0], ""
    return None, f"{file} is {'not under tests/' if not found else 'ambiguous: ' + ', '.join(found)}"


def _logical_lines(text: str) -> list[tuple[int, bool, str]]:
    """(first line number, in fenced code, text) of each paragraph line, list item, table row or heading, its
    wrapped lines joined, so that a span or a name wrapped over two lines reads whole."""
    out: list[tuple[int, bool, str]] = []
    fenced, joinable = False, False
    for number, line in enumerate(text.splitlines(), 1):
        fence = line.lstrip().startswith("```")
        starts = not line.strip() or fence or fenced or line.startswith(("|", "#")) or bool(_ITEM.match(line))
        if joinable and not starts:
            first, _, joined = out[-1]
            out[-1] = (first, False, joined + " " + line.strip())
        else:
            out.append((number, fenced and not fence, line))
        if fence:
            fenced = not fenced
        joinable = bool(line.strip()) and not fenced and not fence and not line.startswith(("|", "#"))
    return out


def _problems(doc: str) -> list[str]:
    problems: list[str] = []
    for number, fenced, line in _logical_lines((ROOT / doc).read_text()):
        where = f"{doc}:{number}"
        for pattern, what in _HISTORY:
            for m in pattern.finditer(line):
                problems.append(f"{where}: {what}: {m.group(0)!r} (say what holds; history lives in git)")
        problems += _section_problems(where, line)
        last_file: str | None = None  # a ``::test`` continues the file cited before it in its paragraph or row
        for span in [line] if fenced else _SPAN.findall(line):
            for m in _PATH.finditer(span):
                if not any(c in m.group(1) for c in "*<>{}") and not _exists(m.group(1)):
                    problems.append(f"{where}: {m.group(1)} is not in the repository")
            cited = None if fenced else _TEST_FILE.search(span)
            only = _NAME_ONLY.match(span.strip())
            if cited:
                path, why = _resolve(cited.group("file"))
                if path is None:
                    problems.append(f"{where}: {why}")
                    continue
                last_file, name, cut = path, cited.group("name"), cited.group("cut")
            elif only:
                if last_file is None:
                    problems.append(f"{where}: {span!r} names a test but no file before it in its paragraph")
                    continue
                name, cut = only.group("name"), only.group("cut")
            else:
                continue
            if cut:
                problems.append(f"{where}: {span!r} cuts the test's name short: write it whole")
            elif name and name not in _test_names(last_file):
                problems.append(f"{where}: {last_file} has no test {name}")
        for anchor in _ANCHOR.findall(line):
            if anchor not in {_slug(h) for h in _headings(doc)}:
                problems.append(f"{where}: the link #{anchor} leads to no heading of {doc}")
        for link in _LINK.findall(line):
            target = (Path(doc).parent / link).as_posix()
            if not _exists(str(Path(target))):
                problems.append(f"{where}: the link {link} leads nowhere")
    return problems


@pytest.mark.parametrize("doc", DOCS)
def test_every_reference_in_a_doc_exists_and_no_doc_tells_history(doc: str) -> None:
    problems = _problems(doc)
    assert not problems, "\n".join(problems)


def test_the_checker_finds_what_it_is_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A doc citing a test that is not there, a path that is not there, a cut name, an issue, a round and a
    commit as history is told of each, and a doc citing only what exists is not."""
    docs = ROOT / "docs"
    bad = docs / "_test_docs_references_probe.md"
    good = docs / "_test_docs_references_probe_ok.md"
    try:
        bad.write_text(
            "| a | `tests/unit/test_docs_references.py::test_no_such_test` | `deltasync/no_such.py` |\n"
            "`test_docs_references.py::test_every_reference...`; `::test_gone`; fixed in issue 12, round 7,\n"
            "the twelfth round's review, DESIGN section 7, observed on `0374e40`; [x](NOWHERE.md); [y](#nowhere)\n"
            'docs/SCALING.md 5b; README, "How the engine writes"; PROTOCOL.md, "Several coordinators"\n'
        )
        good.write_text(
            "`tests/unit/test_docs_references.py::test_the_checker_finds_what_it_is_for`, "
            "`::test_every_reference_in_a_doc_exists_and_no_doc_tells_history[README.md]`; "
            "`python benchmarks/bench_map.py --help`; [the format](FORMAT.md); lease `6c8be70e...`\n"
            'PROTOCOL.md, "Several coordinators"; `--rounds 1`\n'
            "\n## The probe's heading: kept, and linked\n[here](#the-probes-heading-kept-and-linked)\n"
        )
        found = "\n".join(_problems("docs/_test_docs_references_probe.md"))
        for expected in [
            "has no test test_no_such_test",
            "deltasync/no_such.py is not in the repository",
            "cuts the test's name short",
            "has no test test_gone",
            "an issue number: 'issue 12'",
            "a round number: 'round 7'",
            "a numbered round: 'twelfth round'",
            "DESIGN (no such document)",
            "a commit hash as history: 'on `0374e40'",
            "the link NOWHERE.md leads nowhere",
            "'SCALING.md 5b' cites a section by number",
            "the link #nowhere leads to no heading",
            "README.md has no section 'How the engine writes'",
        ]:
            assert expected in found, (expected, found)
        assert _problems("docs/_test_docs_references_probe_ok.md") == []
    finally:
        bad.unlink(missing_ok=True)
        good.unlink(missing_ok=True)
