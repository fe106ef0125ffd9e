"""The source tree holds no unresolved merge: a line that starts a conflict block (``<<<<<<<``,
``>>>>>>>``) in a text file the project ships is an error that Python, Markdown and C++ would each
report differently or not at all (Markdown renders it)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = {".py", ".md", ".txt", ".cpp", ".cu", ".cuh", ".h", ".toml", ".cfg", ".sh", ".yml", ".yaml"}
SKIP = {".venv", ".git", "_build", "_generated", "build", "dist", "node_modules", "__pycache__"}


def _text_files():
    for path in ROOT.rglob("*"):
        if path.suffix in TEXT and path.is_file() and not SKIP & set(path.relative_to(ROOT).parts):
            yield path


def test_no_merge_conflict_lines():
    found = []
    for path in _text_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if line.startswith(("<<<<<<< ", ">>>>>>> ")):
                found.append(f"{path.relative_to(ROOT)}:{number}")
    assert not found, "unresolved merge lines: " + ", ".join(found)
