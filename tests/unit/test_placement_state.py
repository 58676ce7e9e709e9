"""Pair terms computed once per device set: same picks as computing them per request, and a
cache that cannot grow with the specs a long-running plugin goes through."""

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
    TERMS_CACHE_SIZE,
    best_subset,
    link_weight,
    numa_term,
    pair_terms,
    place,
    spec_terms,
)


def _spec(preset: str) -> ResourceSpec:
    inv = SimulatedBackend.load(preset).discover()
    return next(
        s for s in build_resources(inv, parse_config("version: v1")) if s.name.endswith("gpu")
    )


@pytest.mark.parametrize("preset", ["dgx1-v100", "hgx-h100-2x8", "a10g-4"])
def test_terms_are_the_pair_functions(preset: str) -> None:
    units = [d.unit for d in _spec(preset).devices]
    terms = pair_terms(units)
    for a, b in itertools.combinations(units, 2):
        i, j = terms.index[a.uuid], terms.index[b.uuid]
        assert terms.link[i][j] == terms.link[j][i] == link_weight(a, b)
        assert terms.numa[i][j] == terms.numa[j][i] == numa_term(a, b)


@pytest.mark.parametrize("preset", ["dgx1-v100", "hgx-h100-2x8"])
def test_cached_terms_place_as_fresh_ones(preset: str) -> None:
    """Every (must-include, size) split of the node's first GPUs: the same pick and score
    with the spec's cached terms as with terms computed for the request alone."""
    spec = _spec(preset)
    units = [d.unit for d in spec.devices]
    for fixed_count in range(3):
        fixed, candidates = units[:fixed_count], units[fixed_count:]
        for need in range(1, len(candidates) + 1):
            cached = place(fixed, candidates, need, terms=spec_terms(spec))
            fresh = place(fixed, candidates, need)
            assert (cached.picked, cached.score) == (fresh.picked, fresh.score)


def test_terms_cache_is_bounded_and_per_spec_object() -> None:
    specs = [_spec("a10g-4") for _ in range(TERMS_CACHE_SIZE + 3)]  # equal, distinct objects
    terms = [spec_terms(s) for s in specs]
    # Internal state, read on purpose: a reload rebuilds specs; old ones must be let go.
    assert len(topology._terms_cache) <= TERMS_CACHE_SIZE
    assert all(s is not specs[0] for s, _ in topology._terms_cache.values())
    assert spec_terms(specs[-1]) is terms[-1]  # a hit: not recomputed
    assert spec_terms(specs[0]) is not terms[0]  # evicted, then computed again


@pytest.mark.parametrize(("n", "need"), [(2, 1), (4, 2), (6, 3), (8, 8)])
def test_uniform_candidates_take_the_earliest_with_the_brute_force_score(n: int, need: int) -> None:
    weights = [[0 if i == j else 45001 for j in range(n)] for i in range(n)]
    base = [7] * n
    found = best_subset(weights, base, need, fixed_score=3)
    best = max(
        3 + sum(base[i] for i in c) + sum(weights[a][b] for a, b in itertools.combinations(c, 2))
        for c in itertools.combinations(range(n), need)
    )
    assert found.picked == tuple(range(need))
    assert found.score == found.bound == best


@st.composite
def run_matrices(draw: st.DrawFn) -> tuple[list[list[int]], list[int], int]:
    """Candidates in runs of twins (one NUMA half of an NVSwitch board is a run) with
    small random weights, so that ties between sets are common."""
    lengths = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    run_of = [r for r, length in enumerate(lengths) for _ in range(length)]
    k, n = len(lengths), len(run_of)
    across = [[0] * k for _ in range(k)]
    for r in range(k):
        for q in range(r, k):
            across[r][q] = across[q][r] = draw(st.integers(0, 3))
    gains = [draw(st.integers(0, 3)) for _ in range(k)]
    weights = [[0 if i == j else across[run_of[i]][run_of[j]] for j in range(n)] for i in range(n)]
    return weights, [gains[r] for r in run_of], draw(st.integers(1, n))


@given(run_matrices())
@settings(max_examples=300, deadline=None)
def test_runs_of_twins_pick_the_earliest_optimal_set(
    case: tuple[list[list[int]], list[int], int],
) -> None:
    """Whether the count-vector path or the search answers: the brute-force optimum, and
    among equal scores the lexicographically smallest set."""
    weights, base, need = case
    best_score = -1
    best: tuple[int, ...] = ()
    for combo in itertools.combinations(range(len(base)), need):  # lexicographic order
        score = sum(base[i] for i in combo)
        score += sum(weights[a][b] for a, b in itertools.combinations(combo, 2))
        if score > best_score:
            best_score, best = score, combo
    found = best_subset(weights, base, need)
    assert (found.picked, found.score, found.optimal) == (best, best_score, True)


def test_every_per_spec_cache_is_bounded() -> None:
    """Rank, offered-ID, replica and twin-run caches share `per_object`'s bound: specs
    rebuilt on every reload or health flip never pile up."""
    config = parse_config(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - {name: nvidia.com/gpu, replicas: 2}\n"
    )
    inv = SimulatedBackend.load("a10g-4").discover()
    for _ in range(TERMS_CACHE_SIZE + 3):
        (spec,) = build_resources(inv, config)
        topology.device_rank(spec)
        topology.advertised(spec, [d.id for d in spec.devices])
        topology.encoded_ids(spec)
        topology.replica_index(spec)
        topology.twin_runs(spec_terms(spec))
    for cache in (
        topology._rank_cache,
        topology._canonical_cache,
        topology._encoded_cache,
        topology._replica_cache,
        topology._runs_cache,
        topology._terms_cache,
    ):
        assert 0 < len(cache) <= TERMS_CACHE_SIZE
