"""The planted-bug catalogue (refmath.conformance.bugs): every bug is caught by the default sweep.
The sweep stops at a bug's first catch, so this stays fast; tests/test_conformance.py shows that
the kernels they are planted in pass, and `python -m refmath conformance attention
refmath.conformance.bugs:NAME --adapter ADAPTER` shows every case that catches one."""
import pytest

from refmath import kernels
from refmath.conformance.bugs import BUGS
from refmath.conformance.run import check_attention

pytestmark = pytest.mark.skipif(not kernels.cpu_available(), reason="refmath._C is not built")

def test_the_catalogue_holds_at_least_24_distinct_bugs():
    assert len(BUGS) >= 24
    assert len({b.name for b in BUGS}) == len(BUGS) and len({b.fn for b in BUGS}) == len(BUGS)
    assert all(b.fn.__doc__ for b in BUGS)


@pytest.mark.parametrize("bug", BUGS, ids=[b.name for b in BUGS])
def test_every_planted_bug_is_caught_by_the_default_sweep(bug):
    results = check_attention(bug.fn, bug.adapter, dtypes=bug.dtypes, fail_fast=True)
    caught = [r for r in results if r.status == "fail"]
    assert caught, f"{bug.name} passed all {len(results)} cases"
    print(f"{bug.name}: caught by {caught[0].case.id}: {caught[0].reason}")


@pytest.mark.parametrize("bug", BUGS, ids=[b.name for b in BUGS])
def test_every_planted_bug_is_caught_by_the_quick_sweep_in_each_of_its_dtypes(bug):
    for dtype in bug.dtypes:  # the low-precision accumulators: in bfloat16 and in float16
        results = check_attention(bug.fn, bug.adapter, dtypes=(dtype,), quick=True, fail_fast=True)
        assert any(r.status == "fail" for r in results), f"{bug.name} passed the quick sweep in {dtype}"
