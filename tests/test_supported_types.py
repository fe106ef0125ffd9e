"""The lists of supported Hugging Face model types in the docs agree with the registry: each
model's ``HF_MODEL_TYPES`` (what :mod:`refmath.hf` really loads) is the source, and a type added
to or dropped from a model shows up here until the README table, the table of ``refmath.hf``'s
docstring and ``docs/hf.md`` say so."""
import re
from pathlib import Path

import refmath.hf
from refmath.models import MODELS, model_module

ROOT = Path(__file__).resolve().parents[1]
TYPES = {name: model_module(name).HF_MODEL_TYPES for name in MODELS
         if model_module(name).HF_MODEL_TYPES}
ALL_TYPES = {kind for kinds in TYPES.values() for kind in kinds}


def readme_table() -> str:
    """The README's rows of the table of model types, as the registry gives them."""
    return "".join(f"| `{name}` | {', '.join(f'`{kind}`' for kind in kinds)} |\n"
                   for name, kinds in TYPES.items())


def test_registry_types_are_what_hf_loads():
    assert set(refmath.hf.SUPPORTED_MODEL_TYPES) == ALL_TYPES
    assert "cohere" in TYPES and TYPES["cohere"] == ("cohere",)


def test_readme_table_is_the_registrys():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    header = "| refmath model | Hugging Face `model_type` |\n|---|---|\n"
    assert header in text, "README.md has lost its table of Hugging Face model types"
    rows = text.split(header, 1)[1].split("\n\n", 1)[0] + "\n"
    assert rows == readme_table(), (
        f"README.md's table of model types differs from refmath.models.MODELS; it should read\n"
        f"{header}{readme_table()}")


def test_hf_docstring_table_lists_every_type_under_its_model():
    """The reStructuredText table of :mod:`refmath.hf`: a row starts with its types (````a````,
    ````b````) and names the refmath model in the next column; continuation lines start blank."""
    lines = refmath.hf.__doc__.splitlines()
    borders = [i for i, line in enumerate(lines) if line.startswith("=====")]
    assert len(borders) == 3, "refmath.hf's docstring has lost its table of model types"
    listed = {}
    for line in lines[borders[1] + 1:borders[2]]:
        if not line.startswith("``"):
            continue
        kinds = re.findall(r"``([\w-]+)``", line[:36])
        model = re.match(r'\s*``"(\w+)"``', line[36:])
        assert kinds and model, f"refmath.hf's table: cannot read the row {line!r}"
        for kind in kinds:
            assert kind not in listed, f"refmath.hf's table lists {kind!r} twice"
            listed[kind] = model.group(1)
    expected = {kind: name for name, kinds in TYPES.items() for kind in kinds}
    assert listed == expected


def test_hf_page_names_every_type():
    text = (ROOT / "docs" / "hf.md").read_text(encoding="utf-8")
    intro = text.split("\n\n", 2)[1]  # the paragraph that says what it reads
    named = set(re.findall(r"`([\w-]+)`", intro))
    assert ALL_TYPES <= named, f"docs/hf.md does not name {sorted(ALL_TYPES - named)}"
