"""Puts tests/ on ``sys.path``, so that test files in its subfolders (models/, inference/) import
the shared helpers as ``import _support`` too, whatever the import mode and wherever the tests run
(a checkout or an unpacked sdist)."""
import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
