"""The search (`kubegpu.placement.search`): its pick must be the brute-force optimum and,
among equal scores, the lexicographically smallest set, with or without twin classes, with
or without fixed units; and on the real-machine presets with must-include devices too."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubegpu.config import parse_config
from kubegpu.devices.simulated import SimulatedBackend, parse_node
from kubegpu.placement import best_subset, link_weight, numa_term, objective, preferred_allocation
from kubegpu.resources import ResourceSpec, build_resources
from tests.unit.placement.conftest import preset_spec

Matrix = list[list[int]]


def _first_best(
    weights: Matrix, base: list[int], need: int, fixed: int = 0
) -> tuple[int, tuple[int, ...]]:
    """(score, set) of the first best set in lexicographic order."""
    best: tuple[int, tuple[int, ...]] = (-1, ())
    for combo in itertools.combinations(range(len(base)), need):  # lexicographic order
        score = fixed + sum(base[i] for i in combo)
        score += sum(weights[a][b] for a, b in itertools.combinations(combo, 2))
        if score > best[0]:
            best = (score, combo)
    return best


@st.composite
def matrices(draw: st.DrawFn) -> tuple[Matrix, list[int], int, int]:
    """Random symmetric weights from a few values (ties are common), gains and a size."""
    n = draw(st.integers(1, 10))
    weights = [[0] * n for _ in range(n)]
    for a, b in itertools.combinations(range(n), 2):
        weights[a][b] = weights[b][a] = draw(st.sampled_from([0, 10, 51, 2000, 4501]))
    base = [draw(st.sampled_from([0, 0, 3, 2000])) for _ in range(n)]
    return weights, base, draw(st.integers(1, n)), draw(st.integers(0, 5))


@given(matrices())
@settings(max_examples=300, deadline=None)
def test_search_picks_the_first_brute_force_optimum(
    case: tuple[Matrix, list[int], int, int],
) -> None:
    weights, base, need, fixed = case
    found = best_subset(weights, base, need, fixed_score=fixed)
    score, picked = _first_best(weights, base, need, fixed)
    assert (found.picked, found.score, found.optimal) == (picked, score, True)


@st.composite
def twin_matrices(draw: st.DrawFn) -> tuple[Matrix, list[int], int, list[int]]:
    """Candidates in classes of twins (a board, the slices of a GPU), the classes' members
    interleaved in candidate order, with small random weights so ties are common."""
    lengths = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    cls = draw(st.permutations([c for c, length in enumerate(lengths) for _ in range(length)]))
    k, n = len(lengths), len(cls)
    across = [[0] * k for _ in range(k)]
    for r in range(k):
        for q in range(r, k):
            across[r][q] = across[q][r] = draw(st.integers(0, 3))
    gains = [draw(st.integers(0, 3)) for _ in range(k)]
    weights = [[0 if i == j else across[cls[i]][cls[j]] for j in range(n)] for i in range(n)]
    return weights, [gains[c] for c in cls], draw(st.integers(1, n)), cls


@given(twin_matrices())
@settings(max_examples=300, deadline=None)
def test_twin_classes_keep_the_first_optimal_set(
    case: tuple[Matrix, list[int], int, list[int]],
) -> None:
    """Only prefixes of a class are tried, yet the answer is the brute-force optimum and
    the lexicographically smallest optimal set, as without classes."""
    weights, base, need, cls = case
    found = best_subset(weights, base, need, twins=cls)
    score, picked = _first_best(weights, base, need)
    assert (found.picked, found.score, found.optimal) == (picked, score, True)
    assert best_subset(weights, base, need).picked == picked


@pytest.mark.parametrize(("n", "need"), [(2, 1), (4, 2), (6, 3), (8, 8)])
def test_uniform_candidates_take_the_earliest_with_the_brute_force_score(n: int, need: int) -> None:
    weights = [[0 if i == j else 45001 for j in range(n)] for i in range(n)]
    base = [7] * n
    found = best_subset(weights, base, need, fixed_score=3)
    assert found.picked == tuple(range(need))
    assert found.score == found.bound == _first_best(weights, base, need, 3)[0]


@settings(max_examples=100, deadline=None)
@given(
    weights=st.lists(
        st.lists(st.integers(0, 50), min_size=12, max_size=12), min_size=12, max_size=12
    ),
    need=st.integers(1, 12),
    budget=st.integers(1, 30),
)
def test_budgeted_search_reports_an_honest_gap(
    weights: list[list[int]], need: int, budget: int
) -> None:
    """A search stopped by its budget still returns `need` candidates, and its bound is at
    least the true optimum, so `gap` never claims more than it knows."""
    n = len(weights)
    sym = [[0 if i == j else weights[min(i, j)][max(i, j)] for j in range(n)] for i in range(n)]
    found = best_subset(sym, [0] * n, need, budget=budget)
    best = _first_best(sym, [0] * n, need)[0]
    assert len(set(found.picked)) == need
    assert found.score == sum(sym[a][b] for a, b in itertools.combinations(found.picked, 2))
    assert found.bound >= best >= found.score
    if found.optimal:
        assert found.score == best


# Every split on a 16-GPU node against brute force: CPU-bound, seconds under coverage.
@pytest.mark.parametrize("preset", ["dgx1-v100", "hgx-h100-2x8", "a10g-4"])
def test_presets_with_must_include_get_the_first_optimal_set(preset: str) -> None:
    """Every (must-include, size) split of the node's first devices: the optimum, and the
    earliest of the optimal sets in device order."""
    spec = preset_spec(preset)
    ids = [d.id for d in spec.devices]
    units = [d.unit for d in spec.devices]
    link = [[link_weight(a, b) for b in units] for a in units]
    numa = [[numa_term(a, b) for b in units] for a in units]

    def score(chosen: tuple[int, ...]) -> tuple[int, int]:
        pairs = list(itertools.combinations(chosen, 2))
        return sum(link[a][b] for a, b in pairs), sum(numa[a][b] for a, b in pairs)

    for fixed_count in range(3):
        fixed = tuple(range(fixed_count))
        rest = range(fixed_count, len(ids))
        for need in range(1, len(rest) + 1):
            got = preferred_allocation(spec, ids, ids[:fixed_count], fixed_count + need)
            assert got[:fixed_count] == ids[:fixed_count]
            best: tuple[tuple[int, int], tuple[int, ...]] = ((-1, -1), ())
            for c in itertools.combinations(rest, need):  # lexicographic: first best kept
                if (s := score(fixed + c)) > best[0]:
                    best = (s, c)
            assert got[fixed_count:] == [ids[i] for i in best[1]]


def _boards_spec() -> ResourceSpec:
    """64 GPUs: eight NVSwitch boards, each on its own NUMA node (the bounded search)."""
    gpus = [{"numa_node": b, "nvswitch": f"board{b}"} for b in range(8) for _ in range(8)]
    inv = SimulatedBackend(parse_node({"gpus": gpus}, "boards", "test")).discover()
    return build_resources(inv, parse_config("version: v1"))[0]


BOARDS = _boards_spec()


@given(st.lists(st.integers(0, 8), min_size=8, max_size=8), st.data())
@settings(max_examples=100, deadline=None)
def test_beyond_the_exact_limit_fragmented_boards_are_still_filled_best_first(
    free_per_board: list[int], data: st.DataObject
) -> None:
    """More than 16 candidates: the bounded search. On alike boards a set's score only
    grows by taking more from fewer boards, so the optimum fills the boards with the most
    free GPUs first, and the bounded search finds it."""
    ids = [d.id for d in BOARDS.devices]
    free = [ids[8 * b + g] for b, count in enumerate(free_per_board) for g in range(count)]
    if len(free) <= 16:
        return  # the exact search's ground, tested above
    need = data.draw(st.integers(1, len(free)))
    got = preferred_allocation(BOARDS, free, [], need)
    best: list[str] = []
    for b in sorted(range(8), key=lambda b: -free_per_board[b]):
        best += [ids[8 * b + g] for g in range(free_per_board[b])][: need - len(best)]
    units = BOARDS.by_id
    assert objective([units[i].unit for i in got]) == objective([units[i].unit for i in best])
