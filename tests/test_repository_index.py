"""The README's "What is proven where" table names every test file of tests/, and only files that exist."""

from __future__ import annotations

import re

from tests.conftest import REPO

HEADING = "### What is proven where"


def index_files(readme: str) -> list[str]:
    """The `tests/test_*.py` names in the table under HEADING (up to the next heading)."""
    assert readme.count(HEADING) == 1, f"README.md needs one section {HEADING!r}"
    section = readme.split(HEADING, 1)[1]
    section = re.split(r"^#{1,3} ", section, maxsplit=1, flags=re.M)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    return [name for row in rows[1:] for name in re.findall(r"`(tests/test_\w+\.py)`", row)]


def test_every_test_file_is_in_the_index_and_every_indexed_file_exists() -> None:
    named = set(index_files((REPO / "README.md").read_text()))
    on_disk = {str(path.relative_to(REPO)) for path in (REPO / "tests").glob("test_*.py")}
    assert sorted(on_disk - named) == [], "test files missing from the README's index (add a row that names them)"
    assert sorted(named - on_disk) == [], "the README's index names test files that do not exist"


def test_the_index_is_read_from_its_table_only() -> None:
    # The table as the check reads it: a row per feature, names in backticks; any other heading ends it.
    readme = f"{HEADING}\n\n| what | where |\n| --- | --- |\n| a | `tests/test_a.py`, `tests/test_b.py` |\n\n## next\n"
    readme += "| c | `tests/test_c.py` |\n"
    assert index_files(readme) == ["tests/test_a.py", "tests/test_b.py"]
