"""The suite's own schedule: every file `tests/conftest.py` starts first exists (a renamed file
would silently fall back to the end of the queue)."""
from __future__ import annotations

from pathlib import Path

from tests.conftest import LONGEST_FIRST


def test_every_longest_first_file_exists() -> None:
    tests = Path(__file__).resolve().parents[1]
    missing = [name for name in LONGEST_FIRST if not (tests / name).is_file()]
    assert not missing, f"tests/conftest.py LONGEST_FIRST names missing files: {missing}"
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
