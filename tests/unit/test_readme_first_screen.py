"""README.md for a reader who has never heard of delta sync: the first 60 lines say what deltasync is, show its
parts, give the two commands and say where each part lives; every credential the code reads is in one table."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
FIRST = "\n".join(README.splitlines()[:60])


def test_the_first_lines_say_what_it_is_in_one_sentence() -> None:
    opening = " ".join(README.split("\n\n")[1].split())  # the paragraph under the title
    assert opening.startswith("deltasync ") and opening.count(". ") == 0 and opening.endswith(".")
    for word in ("trainer", "vLLM", "delta", "bit for bit"):
        assert word in opening, word


def test_the_first_screen_shows_the_parts_and_the_two_commands() -> None:
    pictures = re.findall(r"```\n(.*?)```", FIRST, re.S)
    assert any(all(part in p for part in ("trainer", "store", "agent", "vLLM", "coordinator")) for p in pictures)
    assert re.search(r"^make demo\s+#", FIRST, re.M) and re.search(r"^make test\s+#", FIRST, re.M)


def test_the_first_screen_says_where_each_part_lives() -> None:
    for path in ("deltasync/", "services/deltasync_coordinator/", "examples/wordle/", "benchmarks/", "tests/", "docs/"):
        assert f"`{path}`" in FIRST, path
        assert (ROOT / path).is_dir(), path
    for doc in re.findall(r"\]\((docs/[A-Z]+\.md)\)", FIRST):
        assert (ROOT / doc).is_file(), doc
    assert "## Words used here" in FIRST


def test_every_credential_the_code_reads_is_in_the_credentials_table() -> None:
    names = set()
    for path in [*ROOT.glob("deltasync/**/*.py"), *ROOT.glob("services/**/*.py"), *ROOT.glob("examples/**/*.py")]:
        names |= set(re.findall(r"\b((?:DELTASYNC|WORDLE)_[A-Z_]*(?:TOKEN|SECRET)(?:_FILE)?)\b", path.read_text()))
    names -= {"DELTASYNC_TEST_POSTGRES_URL"}
    for field in ("read_token", "metrics_token", "publisher_token", "agent_secret"):  # the coordinator's settings
        names.add(f"DELTASYNC_{field.upper()}")
    table = README[README.index("## Credentials") :]
    table = table[: table.index("\n## ")]
    missing = sorted(n for n in names if f"`{n}`" not in table)
    assert not missing, f"credentials read by the code but not in README's table: {missing}"
