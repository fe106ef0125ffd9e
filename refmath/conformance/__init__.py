"""refmath as the oracle for attention kernels: anyone's attention function run through a sweep of
cases against a float64 reference, each judged by a derived bound (catalogue C1).

``python -m refmath conformance attention MODULE:FUNCTION --adapter NAME`` runs the sweep from the
command line; in Python::

    import torch.nn.functional as F
    from refmath import conformance

    results = conformance.check_attention(F.scaled_dot_product_attention, adapter="sdpa",
                                          dtypes=("float32", "bfloat16"))
    print(conformance.table(results))

The parts, one file each: :mod:`~refmath.conformance.case` (what is asked, and the inputs),
:mod:`~refmath.conformance.oracle` (the float64 reference and the plain low-precision
implementation), :mod:`~refmath.conformance.bounds` (the tolerance and its derivation),
:mod:`~refmath.conformance.adapters` (calling conventions) over
:mod:`~refmath.conformance.arrays` (DLPack), :mod:`~refmath.conformance.run` (the verdicts),
:mod:`~refmath.conformance.conventions` (what a kernel may declare: empty rows, NaN rules),
:mod:`~refmath.conformance.locate` (where a failing case fails, and the question it raises),
:mod:`~refmath.conformance.report` (terminal, Markdown, JSON, figure),
:mod:`~refmath.conformance.bugs` (planted kernel bugs the sweep must catch) and
:mod:`~refmath.conformance.pytest_support` (the sweep inside a kernel's own pytest suite:
:func:`cases` for ``pytest.mark.parametrize``, :func:`assert_conforms`).
"""
# The functions a kernel's test needs, by their short names; the classes (AttentionCase, CaseResult,
# Adapter) stay in their modules, so that each is documented, and cross-referenced, once.
from refmath.conformance.adapters import ADAPTERS, get_adapter
from refmath.conformance.case import sweep
from refmath.conformance.conventions import Conventions
from refmath.conformance.pytest_support import assert_conforms, cases
from refmath.conformance.report import table
from refmath.conformance.run import check_attention, check_case

__all__ = ["ADAPTERS", "Conventions", "assert_conforms", "cases", "check_attention", "check_case", "get_adapter",
           "sweep", "table"]
