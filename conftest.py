"""pytest, run from the repository root: notebooks that pass nbval go into the book's execution cache
(tools/nbval_book_cache.py), so `make book` after `make test` does not execute them again."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "tools"))
from nbval_book_cache import pytest_configure, pytest_runtest_call, pytest_runtest_makereport, pytest_terminal_summary  # noqa: E402,F401
