"""Every lesson runs top to bottom, headless.

Lessons are stored as py:percent scripts (see README); jupytext turns each into a notebook and
nbclient executes it in a fresh kernel with the Agg backend, so a cell that raises fails the test.
"""
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext", reason="lessons need the 'dev' extra (jupytext)")
nbclient = pytest.importorskip("nbclient", reason="lessons need the 'dev' extra (nbclient)")

LESSONS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9]*.py"))


def test_there_are_lessons():
    assert LESSONS, "no lesson found in notebooks/"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_lesson_executes(path, monkeypatch, tmp_path):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = jupytext.read(path)
    client = nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
