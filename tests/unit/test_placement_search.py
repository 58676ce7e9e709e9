"""The subset table: every subset of a topology of up to 16 units scored once, so a request
is answered by lookups instead of a search. Its pick must be the brute-force optimum and,
among equal scores, the lexicographically smallest set, as the branch and bound keeps."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubegpu import topology
from kubegpu.config import parse_config
from kubegpu.devices.simulated import SimulatedBackend
from kubegpu.resources import ResourceSpec, build_resources
from kubegpu.topology import (
    TABLE_LIMIT,
    TABLES_CACHE_SIZE,
    PairTerms,
    pair_terms,
    place,
    spec_terms,
    subset_table,
    table_place,
)

Case = tuple[PairTerms, list[int], list[int], int]


def _spec(preset: str) -> ResourceSpec:
    inv = SimulatedBackend.load(preset).discover()
    return next(
        s for s in build_resources(inv, parse_config("version: v1")) if s.name.endswith("gpu")
    )


def _terms(link: list[list[int]], numa: list[list[int]]) -> PairTerms:
    n = len(link)
    return PairTerms(
        {f"u{i}": i for i in range(n)},
        tuple(tuple(row) for row in link),
        tuple(tuple(row) for row in numa),
    )


@st.composite
def requests(draw: st.DrawFn, max_units: int = 9) -> Case:
    """Random symmetric link weights from a few values (ties are common), NUMA terms, and
    a request: some rows must be included, some offered, a size."""
    n = draw(st.integers(1, max_units))
    link = [[0] * n for _ in range(n)]
    numa = [[0] * n for _ in range(n)]
    for a, b in itertools.combinations(range(n), 2):
        link[a][b] = link[b][a] = draw(st.sampled_from([0, 10, 50, 2000, 4500]))
        numa[a][b] = numa[b][a] = draw(st.integers(0, 1))
    rows = draw(st.permutations(range(n)))
    fixed_count = draw(st.integers(0, n - 1))
    fixed = sorted(rows[:fixed_count])
    offered = sorted(rows[fixed_count:][: draw(st.integers(1, n - fixed_count))])
    return _terms(link, numa), fixed, offered, draw(st.integers(1, len(offered)))


def _brute_force(
    terms: PairTerms, fixed: list[int], offered: list[int], need: int
) -> tuple[int, tuple[int, ...]]:
    """(score, candidate positions) of the first best set in lexicographic order."""
    k = len(fixed) + need
    scale = k * (k - 1) // 2 + 1
    best: tuple[int, tuple[int, ...]] = (-1, ())
    for combo in itertools.combinations(range(len(offered)), need):
        rows = [*fixed, *(offered[i] for i in combo)]
        score = sum(
            terms.link[a][b] * scale + terms.numa[a][b] for a, b in itertools.combinations(rows, 2)
        )
        if score > best[0]:
            best = (score, combo)
    return best


@pytest.mark.parametrize("enumerate_cost", [0, 7, 10**9])
@given(case=requests())
@settings(max_examples=150, deadline=None)
def test_table_picks_the_first_brute_force_optimum(case: Case, enumerate_cost: int) -> None:
    """Both ways of reading the table (scoring every offered set; walking the ranked sets
    until one is offered), forced in turn, and the cost-based choice between them."""
    terms, fixed, offered, need = case
    table = subset_table(terms)
    found = table_place(table, fixed, offered, need, enumerate_cost=enumerate_cost)
    score, picked = _brute_force(terms, fixed, offered, need)
    assert (found.picked, found.score, found.optimal) == (picked, score, True)


@given(case=requests(max_units=10))
@settings(max_examples=150, deadline=None)
def test_table_and_branch_and_bound_agree(case: Case) -> None:
    """`place` from the table against `place` by search, on the same units."""
    terms, fixed, offered, need = case
    spec = _spec("hgx-h100-2x8")  # units only name rows; the weights are the drawn ones
    by_row = {terms.index[f"u{i}"]: spec.devices[i].unit for i in range(len(terms.index))}
    mapped = PairTerms({by_row[r].uuid: r for r in by_row}, terms.link, terms.numa)
    units_fixed = [by_row[r] for r in fixed]
    units_offered = [by_row[r] for r in offered]
    table = place(units_fixed, units_offered, need, terms=mapped)
    search = place(units_fixed, units_offered, need, terms=mapped, table=False)
    assert (table.picked, table.score) == (search.picked, search.score)


@pytest.mark.parametrize("preset", ["dgx1-v100", "hgx-h100-2x8", "a10g-4"])
def test_presets_every_request_size_from_the_table_as_by_search(preset: str) -> None:
    spec = _spec(preset)
    units = [d.unit for d in spec.devices]
    terms = spec_terms(spec)
    for fixed_count in range(3):
        fixed, candidates = units[:fixed_count], units[fixed_count:]
        for need in range(1, len(candidates) + 1):
            table = place(fixed, candidates, need, terms=terms)
            search = place(fixed, candidates, need, terms=terms, table=False)
            assert (table.picked, table.score) == (search.picked, search.score)
            assert table.optimal


def test_tables_are_shared_by_equal_topologies_and_bounded() -> None:
    """Specs are rebuilt on every health flip or reload: an equal topology finds its table
    again; distinct topologies beyond the bound push out the oldest."""
    first, again = _spec("dgx1-v100"), _spec("dgx1-v100")
    assert first is not again
    assert subset_table(spec_terms(first)) is subset_table(spec_terms(again))
    for n in range(2, 3 + TABLES_CACHE_SIZE):
        subset_table(
            _terms([[0 if i == j else n for j in range(n)] for i in range(n)], [[0] * n] * n)
        )
    # Internal state, read on purpose: a long-running plugin must not pile tables up.
    assert len(topology._tables_cache) <= TABLES_CACHE_SIZE


def test_table_refuses_more_units_than_its_limit() -> None:
    n = TABLE_LIMIT + 1
    terms = pair_terms([d.unit for d in _spec("hgx-h100-2x8").devices])
    too_big = _terms([[0] * n for _ in range(n)], [[0] * n for _ in range(n)])
    assert len(terms.index) <= TABLE_LIMIT
    with pytest.raises(ValueError, match=f"at most {TABLE_LIMIT} units"):
        subset_table(too_big)


@st.composite
def uniform_runs(draw: st.DrawFn) -> Case:
    """Runs of twins (boards) that all weigh the same to each other and at least as much
    inside, with must-include rows among them and a request over the others."""
    lengths = draw(st.lists(st.integers(1, 4), min_size=2, max_size=4))
    run_of = [r for r, length in enumerate(lengths) for _ in range(length)]
    n = len(run_of)
    across_link = draw(st.sampled_from([0, 10, 2000]))
    across_numa = draw(st.integers(0, 1))
    inside = [
        (across_link + draw(st.sampled_from([0, 0, 40, 2000])), draw(st.integers(across_numa, 1)))
        for _ in lengths
    ]
    link = [[0] * n for _ in range(n)]
    numa = [[0] * n for _ in range(n)]
    for a, b in itertools.combinations(range(n), 2):
        same = run_of[a] == run_of[b]
        link[a][b] = link[b][a] = inside[run_of[a]][0] if same else across_link
        numa[a][b] = numa[b][a] = inside[run_of[a]][1] if same else across_numa
    rows = list(range(n))
    fixed = sorted(draw(st.lists(st.sampled_from(rows), max_size=2, unique=True)))
    rest = [r for r in rows if r not in fixed]
    if not rest:
        fixed, rest = fixed[:-1], fixed[-1:]
    offered = sorted(draw(st.lists(st.sampled_from(rest), min_size=1, unique=True)))
    return _terms(link, numa), fixed, offered, draw(st.integers(1, len(offered)))


@given(case=uniform_runs())
@settings(max_examples=300, deadline=None)
def test_uniform_runs_pick_the_first_brute_force_optimum(case: Case) -> None:
    """Nodes of alike boards beyond the table (64 GPUs) are solved per run: the same set
    as brute force keeps, here on small ones where brute force can check it."""
    terms, fixed, offered, need = case
    found = topology._place_by_uniform_runs(terms, fixed, offered, need)
    score, picked = _brute_force(terms, fixed, offered, need)
    if found is None:  # declined: the offered units fall in one run
        assert len({topology.twin_runs(terms)[r] for r in offered}) == 1
        return
    assert (found.picked, found.score, found.optimal) == (picked, score, True)
