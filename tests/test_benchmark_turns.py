"""benchmarks/_common.rotated_times: the order of the peers' turns.

A timed call can leave something behind for the call after it (a thread still spinning, its lines
in the cache), so no peer may always come after the same neighbour, nor always first after the
untimed call before every turn. Plain rotation (a b c, b c a, c a b) kept the cyclic order: b came
after a in every round but one."""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
pytestmark = pytest.mark.skipif(not (BENCHMARKS / "_common.py").exists(),
                                reason="no benchmarks/ beside the tests")


def _turns(n_peers: int, rounds: int) -> list[list[str]]:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from _common import rotated_times
    finally:
        sys.path.remove(str(BENCHMARKS))
    calls: list[str] = []
    peers = {chr(ord("a") + i): (lambda i=i: calls.append(chr(ord("a") + i)))
             for i in range(n_peers)}
    rotated_times(peers, repeats=rounds, warmup=0)
    return [calls[r * n_peers:(r + 1) * n_peers] for r in range(rounds)]


@pytest.mark.parametrize("n_peers", [2, 3, 6, 8])
def test_every_peer_is_first_equally_often_and_runs_once_a_round(n_peers):
    rounds = 2 * n_peers
    turns = _turns(n_peers, rounds)
    assert all(sorted(order) == sorted(turns[0]) for order in turns)
    assert Counter(order[0] for order in turns) == {p: 2 for p in turns[0]}


@pytest.mark.parametrize("n_peers", [3, 6, 8])
def test_no_peer_always_follows_the_same_neighbour(n_peers):
    rounds = 2 * n_peers
    turns = _turns(n_peers, rounds)
    calls = [peer for order in turns for peer in order]
    before: dict[str, Counter] = {p: Counter() for p in turns[0]}
    for previous, peer in zip(calls, calls[1:]):
        before[peer][previous] += 1
    for peer, counts in before.items():
        # Each neighbour of the cyclic order comes just before the peer in about half the rounds.
        assert max(counts.values()) <= rounds // 2 + 1, (peer, counts)
