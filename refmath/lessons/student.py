"""The student copies of the lessons: each lesson with its solution regions stripped, shipped
inside the package so that an installed refmath writes them with no checkout (and so no answer)
nearby; ``python -m refmath lessons student --out DIR`` writes every one."""
from __future__ import annotations

import os
from pathlib import Path

from refmath import solutions
from refmath.lessons.leaks import leaked_lines

__all__ = ["lesson_paths", "student_copy", "packaged_copies", "refresh_packaged_copies",
           "write_student_copies"]


NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


# The student copies shipped inside the package, so that an installed refmath (a wheel, with no
# checkout and so no answers nearby) can write them: NN_name.py.txt (.txt: data, not a module
# of refmath), refreshed from notebooks/ by refresh_packaged_copies() and kept equal to it by
# the tests.
PACKAGED = Path(__file__).resolve().parents[1] / "student_lessons"


PACKAGED_SUFFIX = ".txt"


def lesson_paths(root: str | os.PathLike | None = None) -> list[Path]:
    """The lessons (``NN_name.py`` py:percent scripts) of ``root`` (default: the checkout's
    ``notebooks/``), in order. Raises ``ValueError`` when ``root`` holds none."""
    folder = Path(root) if root is not None else NOTEBOOKS
    paths = sorted(folder.glob("[0-9][0-9]_*.py"))
    if not paths:
        raise ValueError(f"no lesson (NN_name.py) in {folder}")
    return paths


def student_copy(text: str, where: str = "<lesson>") -> str:
    """The answer-free version of a lesson: every ``# BEGIN SOLUTION`` region of an exercise cell
    replaced by ``# your code here`` (the ``answer = ...`` lines before it stay, so its check says
    "no answer yet"), and every Markdown answer by a prompt line (:func:`refmath.solutions.strip_notebook`)."""
    return solutions.strip_notebook(text, where)


def packaged_copies() -> dict[str, str]:
    """The student copies shipped with the package, by lesson file name (``01_attention.py``):
    empty when this copy of refmath has none."""
    if not PACKAGED.is_dir():
        return {}
    return {path.name[:-len(PACKAGED_SUFFIX)]: path.read_text(encoding="utf-8")
            for path in sorted(PACKAGED.glob(f"[0-9][0-9]_*.py{PACKAGED_SUFFIX}"))}


def refresh_packaged_copies(lessons: list[Path] | None = None) -> list[Path]:
    """Rewrite the packaged student copies from the instructor lessons (default: the checkout's
    ``notebooks/``), after the leak scan; a packaged copy of a lesson that is gone is removed.
    Run after editing a lesson: ``python -c "import refmath.lessons as l;
    l.refresh_packaged_copies()"``."""
    sources = lessons if lessons is not None else lesson_paths()
    copies = _student_copies(sources)
    PACKAGED.mkdir(exist_ok=True)
    for stale in PACKAGED.glob(f"*{PACKAGED_SUFFIX}"):
        if stale.name[:-len(PACKAGED_SUFFIX)] not in copies:
            stale.unlink()
    written = []
    for name, copy in copies.items():
        target = PACKAGED / (name + PACKAGED_SUFFIX)
        target.write_text(copy, encoding="utf-8")
        written.append(target)
    return written


def _student_copies(sources: list[Path]) -> dict[str, str]:
    """Each lesson's student copy by file name, after the leak scan (``ValueError`` listing the
    leaked lines when any would reach a copy)."""
    copies, leaks = {}, []
    for path in sources:
        text = path.read_text(encoding="utf-8")
        copies[path.name] = copy = student_copy(text, str(path))
        leaks += leaked_lines(text, copy, path.name)
    if leaks:
        raise ValueError(f"{len(leaks)} solution line(s) would reach the student copies; nothing "
                         "was written:\n  " + "\n  ".join(leaks[:20]))
    return copies


def write_student_copies(out: str | os.PathLike, lessons: list[Path] | None = None, *,
                         force: bool = False) -> list[Path]:
    """Write the student copy of each lesson into ``out`` under the same name. With ``lessons``
    (instructor lessons, answers inside), the copies are made from them after the leak scan: if
    any solution line would reach a copy, raise ``ValueError`` listing them and write nothing.
    Without, the copies are the ones shipped in the package (:func:`packaged_copies`): an
    installed refmath needs no checkout, and no answer is anywhere near the student. ``out`` is created if needed; a file there, or the lessons' own folder,
    is refused with ``ValueError``, and so is a folder that holds anything already unless ``force``
    (a student's edited lessons would be overwritten)."""
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--out {str(folder)!r} is a file, not a folder")
    sources = lessons if lessons is not None else []
    instructors = {path.parent.resolve() for path in sources} | (
        {NOTEBOOKS.resolve()} if NOTEBOOKS.is_dir() else set())
    if folder.exists() and folder.resolve() in instructors:
        # The copies would replace the lessons they are made from, answers and all.
        raise ValueError(f"--out {str(folder)!r} is the folder of the instructor lessons; "
                         "write the student copies elsewhere")
    if folder.is_dir() and not force and any(folder.iterdir()):
        raise ValueError(f"--out {str(folder)!r} is not empty: the copies would overwrite what is "
                         "there (a student's answers among it); give an empty or new folder, or "
                         "--force to overwrite")
    if lessons is not None:
        copies = _student_copies(sources)
    else:
        copies = packaged_copies()
        if not copies:
            raise ValueError("this copy of refmath ships no student lessons; give the instructor "
                             "lessons with --from DIR")
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, copy in copies.items():
        (folder / name).write_text(copy, encoding="utf-8")
        written.append(folder / name)
    return written
