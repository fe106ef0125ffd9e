"""The sweep inside a kernel's own test suite: one pytest test per case.

::

    import pytest
    import torch.nn.functional as F
    from refmath import conformance

    @pytest.mark.parametrize("case", conformance.cases("sdpa", dtypes=("bfloat16",)))
    def test_my_kernel(case):
        conformance.assert_conforms(F.scaled_dot_product_attention, "sdpa", case)

A case that does not apply to the adapter is skipped with the reason; a failure's message is the
case, its verdict, and each output's error against its tolerance. pytest is imported only by these
functions.
"""
from __future__ import annotations

from refmath.conformance.adapters import get_adapter
from refmath.conformance.case import sweep
from refmath.conformance.run import CaseResult, check_case

__all__ = ["cases", "assert_conforms"]


def cases(adapter: str = "sdpa", quick: bool = False, dtypes=("float32",), contracts=None) -> list:
    """The sweep's cases for ``adapter`` as ``pytest.param``s with readable ids, for
    ``pytest.mark.parametrize("case", ...)``; ``contracts`` defaults to the adapter's."""
    import pytest

    contracts = get_adapter(adapter).contracts if contracts is None else tuple(contracts)
    return [pytest.param(c, id=c.id) for c in sweep(contracts, tuple(dtypes), quick)]


def assert_conforms(fn, adapter, case, **options) -> CaseResult:
    """Run ``fn`` through ``case`` (:func:`refmath.conformance.run.check_case`, with ``options``);
    skip when the case does not apply, fail with the verdict when it does not pass."""
    import pytest

    result = check_case(fn, adapter, case, **options)
    if result.status == "skip":
        pytest.skip(result.reason)
    if result.status == "fail":
        lines = [f"{case.id} ({case.describe()}): {result.reason}"]
        lines += [f"  {c.name}: error {c.error:.3g}, tolerance {c.tolerance:.3g} ({c.ratio:.2f})"
                  for c in result.checks]
        pytest.fail("\n".join(lines), pytrace=False)
    return result
