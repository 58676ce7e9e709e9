"""`GetPreferredAllocation`: which of the available devices a container should get.

Whole GPUs and MIG slices are chosen to maximise one objective (docs/placement.md): the
sum over chosen pairs of a bandwidth-proportional pair weight (NVLink: links x per-link
GB/s of its version; else a PCIe level far below one NVLink; two units of one GPU above
any fabric), with same-NUMA pairs as a tie-break that can never outweigh a link. Resources
of up to `TABLE_LIMIT` units are answered from a table of every subset's score (built once
per topology); beyond, runs of alike boards are solved by counts per run, and otherwise up
to `EXACT_LIMIT` candidates the optimum is exact by branch and bound; beyond that, a
budgeted search reports how far from optimal it may be. Replicas of
shared GPUs follow `sharedDevicesAllocationPolicy` (`distributed` spreads a request over
the least-used GPUs, `packed` fills one GPU before the next); the objective breaks ties.

AMD GPUs are weighed as ROCm's best-effort allocator weighs them (see `amd_pair_weight`), so
`amd.com/gpu` gets the devices ROCm's plugin would pick: partitions of one GPU together, on
the GPU with the fewest free partitions (so whole GPUs stay whole), xGMI peers before PCIe.

The answer is a hint to the kubelet, but it must be a valid one: only IDs it offered,
every `must_include` ID, exactly `allocation_size` of them.
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
from collections.abc import Callable, Iterable, Iterator, KeysView, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Protocol, TypeVar, cast

from kubegpu.config import AllocationPolicy
from kubegpu.devices import DeviceID, Gpu, Health, LinkKind, Vendor
from kubegpu.errors import AllocationError
from kubegpu.resources import AdvertisedDevice, ResourceSpec, SharingKind, Unit

#: The compiled ID reader's table type (`kubegpu._idscan`), or None where the package was
#: installed without a C compiler: `kubegpu.plugin.wire` then reads in Python, same answers.
compiled_table: Callable[[tuple[bytes, ...], tuple[str, ...]], IdReader] | None
try:
    from kubegpu._idscan import IdTable

    compiled_table = IdTable
except ImportError:
    compiled_table = None

log = logging.getLogger(__name__)


class AllBut(AbstractSet[str]):
    """Every ID `spec` advertises except `missing` (which must be some of them).

    How an offer of most of a large pool is held: by the few IDs it lacks rather than the
    thousands it has (a kubelet offers every free replica, 3,072 at 64 GPUs x 48), so that
    counting free replicas per GPU touches the missing IDs only (`preferred_allocation`).
    """

    __slots__ = ("_all", "missing")

    def __init__(self, spec: ResourceSpec, missing: AbstractSet[str]) -> None:
        self._all = spec.by_id.keys()
        self.missing = missing

    def __contains__(self, item: object) -> bool:
        return item in self._all and item not in self.missing

    def __len__(self) -> int:
        return len(self._all) - len(self.missing)

    def __iter__(self) -> Iterator[str]:
        missing = self.missing
        return (i for i in self._all if i not in missing)


def preferred_allocation(
    spec: ResourceSpec,
    available: Iterable[str],
    must_include: Iterable[str],
    size: int,
    policy: AllocationPolicy = AllocationPolicy.DISTRIBUTED,
) -> list[DeviceID]:
    """The preferred `size` IDs out of `available` ∪ `must_include`."""
    required = list(dict.fromkeys(must_include))
    # The pool as a set: a set or dict of the offered IDs is taken as is (the server builds
    # one), so a request over thousands of IDs is hashed once, not once per layer.
    pool_ids: AbstractSet[str]
    if required or not isinstance(available, set | frozenset | dict | AllBut):
        pool_ids = dict.fromkeys(itertools.chain(required, available)).keys()
    elif isinstance(available, dict):
        pool_ids = available.keys()
    else:
        pool_ids = available
    by_id = spec.by_id
    shared = spec.sharing is not SharingKind.NONE
    # Replicas: the pool's IDs per unit, counted by intersecting each unit's (spec-owned,
    # hash-cached) ID set with the pool. The units partition the spec's IDs, so the counts
    # add up to the pool exactly when every pooled ID is known: the check costs nothing more.
    free_per_row: list[int] = []
    if shared:
        index = replica_index(spec)
        id_sets = index.id_sets
        if isinstance(pool_ids, AllBut):
            # Held by what it lacks: per unit, its IDs less the missing among them, counted
            # one by one while they are fewer than the units.
            missing = pool_ids.missing
            if len(missing) <= len(id_sets):
                free_per_row = list(index.sizes)
                for i in missing:
                    free_per_row[index.row_of[i]] -= 1
            else:
                free_per_row = [len(ids) - len(ids & missing) for ids in id_sets]
        elif isinstance(pool_ids, set | frozenset) and 2 * len(pool_ids) > len(by_id):
            # Mostly free: count what is missing instead. A set holds each entry's hash, so
            # a miss touches no ID object, while every match that an intersection keeps is
            # an ID string written to (its reference count), and those are cold in a server
            # that waits on the socket between calls.
            free_per_row = [len(ids) - len(ids - pool_ids) for ids in id_sets]
        else:
            free_per_row = [len(pool_ids & ids) for ids in id_sets]
        all_known = sum(free_per_row) == len(pool_ids)
    else:
        all_known = isinstance(pool_ids, AllBut) or pool_ids <= by_id.keys()
    if not all_known:
        unknown = [i for i in pool_ids if i not in by_id]
        if not isinstance(pool_ids, KeysView):
            unknown.sort()  # a set has no order of its own; the message must not vary
        raise AllocationError(
            f"{spec.name}: unknown device ID(s) {', '.join(map(repr, unknown[:5]))} in the "
            f"preferred-allocation request"
        )
    if size <= 0:
        raise AllocationError(f"{spec.name}: allocation_size must be at least 1, got {size}")
    if len(required) > size:
        raise AllocationError(
            f"{spec.name}: {len(required)} must-include devices exceed allocation_size {size}"
        )
    if size > len(pool_ids):
        raise AllocationError(
            f"{spec.name}: allocation_size {size} exceeds the {len(pool_ids)} devices offered"
        )
    chosen = [by_id[i] for i in required]
    need = size - len(chosen)
    if not need:
        return [d.id for d in chosen]
    if shared:
        # Replicas: counted per unit in C-level passes, no sort of the (possibly huge) pool.
        chosen += _replicas(spec, chosen, pool_ids, free_per_row, need, policy)
        return [d.id for d in chosen]
    taken = set(required)
    # Healthy devices first, then by (GPU, GPU instance, compute instance): the kubelet
    # offers only healthy ones, but be safe. The order is the spec's, computed once.
    rank = device_rank(spec)
    pool = [by_id[i] for i in sorted(pool_ids, key=rank.__getitem__) if i not in taken]
    if spec.vendor is Vendor.AMD:
        chosen += _best_amd(chosen, pool, need)
    else:
        chosen += _best_units(chosen, pool, need, spec_terms(spec))
    return [d.id for d in chosen]


K = TypeVar("K")
V = TypeVar("V")


def per_object(cache: dict[int, tuple[K, V]], obj: K, build: Callable[[K], V]) -> V:
    """`build(obj)`, cached per object: keyed by `id`, the entry holds `obj` itself so the
    id cannot be reused while cached; at most `TERMS_CACHE_SIZE` entries, oldest evicted
    first (a reload or health flip makes new specs, and the old ones must be let go)."""
    hit = cache.get(id(obj))
    if hit is not None and hit[0] is obj:
        return hit[1]
    value = build(obj)
    if len(cache) >= TERMS_CACHE_SIZE:
        del cache[next(iter(cache))]  # dicts keep insertion order
    cache[id(obj)] = (obj, value)
    return value


def advertised(spec: ResourceSpec, ids: Iterable[str]) -> set[str]:
    """The IDs among `ids` that `spec` advertises, as a set of the spec's own ID strings.

    One C-level pass over `ids` (a request's protobuf field can carry thousands): each ID
    is hashed and looked up once, and what lands in the set is the spec's string, whose
    hash is cached and which later set operations against the spec's own sets (the replica
    index) match by identity instead of by comparing characters.
    """
    canonical = per_object(_canonical_cache, spec, lambda s: {d.id: d.id for d in s.devices})
    found: set[str | None] = set(map(canonical.get, ids))
    found.discard(None)  # the unknown ones
    return cast(set[str], found)


_canonical_cache: dict[int, tuple[ResourceSpec, dict[str, str]]] = {}


def encoded_ids(spec: ResourceSpec) -> dict[bytes, str]:
    """Each ID of `spec` as a request's bytes carry it in a repeated string field (its
    one-byte length, then its UTF-8), mapped to the spec's own string; built once per spec.

    `kubegpu.plugin.wire` splits a run of such fields on their tag byte (0x0a) and looks
    the pieces up here, so only IDs whose form holds no 0x0a byte and whose length fits
    one byte are keys; any other ID is read the slow way.
    """
    return per_object(_encoded_cache, spec, _encoded_ids)


def _encoded_ids(spec: ResourceSpec) -> dict[bytes, str]:
    table: dict[bytes, str] = {}
    for d in spec.devices:
        try:
            raw = d.id.encode()
        except UnicodeEncodeError:  # a lone surrogate: no request can name it anyway
            continue
        key = bytes([len(raw)]) + raw if len(raw) < 0x80 else b"\n"
        if b"\n" not in key:
            table[key] = d.id
    return table


_encoded_cache: dict[int, tuple[ResourceSpec, dict[bytes, str]]] = {}


def encoded_whole(spec: ResourceSpec) -> frozenset[bytes] | None:
    """The keys of `encoded_ids(spec)` when they are every ID the spec advertises (a
    request offering most of them is then read as the few it lacks); else None."""
    return per_object(_whole_cache, spec, _encoded_whole)


def _encoded_whole(spec: ResourceSpec) -> frozenset[bytes] | None:
    table = encoded_ids(spec)
    return frozenset(table) if len(table) == len(spec.by_id) else None


_whole_cache: dict[int, tuple[ResourceSpec, frozenset[bytes] | None]] = {}


def id_table(spec: ResourceSpec) -> IdReader | None:
    """The compiled reader of `encoded_ids(spec)` (`kubegpu._idscan`), built once per spec,
    when the extension was built and the table holds every ID the spec advertises (so
    "lacking" is what the spec has beyond the request); else None, and
    `kubegpu.plugin.wire` reads the same bytes in Python."""
    return per_object(_table_cache, spec, _id_table)


class IdReader(Protocol):
    """What `kubegpu.plugin.wire` asks of a compiled table (`_idscan.pyi`)."""

    def read(self, data: bytes, start: int, end: int, /) -> tuple[int, bool, set[str]] | None: ...


def _id_table(spec: ResourceSpec) -> IdReader | None:
    if compiled_table is None or encoded_whole(spec) is None:
        return None
    table = encoded_ids(spec)
    return compiled_table(tuple(table), tuple(table.values()))


_table_cache: dict[int, tuple[ResourceSpec, IdReader | None]] = {}


def device_rank(spec: ResourceSpec) -> Mapping[str, int]:
    """Each device ID's place in (unhealthy last, `_order`) order: one integer sort key per
    ID, computed once per spec (cached beside its pair terms, same bound)."""
    return per_object(_rank_cache, spec, _device_rank)


def _device_rank(spec: ResourceSpec) -> dict[str, int]:
    ordered = sorted(spec.devices, key=lambda d: (d.health is not Health.HEALTHY, _order(d)))
    return {d.id: k for k, d in enumerate(ordered)}


_rank_cache: dict[int, tuple[ResourceSpec, dict[str, int]]] = {}


def _order(d: AdvertisedDevice) -> tuple[int, int, int, int]:
    mig = d.unit.mig
    return (
        d.unit.gpu.index,
        mig.gi_id if mig else -1,
        mig.ci_id if mig else -1,
        d.replica if d.replica is not None else -1,
    )


#: The AMD (ROCm-weights) search is exhaustive up to this many candidate sets, else greedy.
EXHAUSTIVE_LIMIT = 2000
#: Exact branch and bound for up to this many candidate units; beyond, a bounded search.
EXACT_LIMIT = 16
#: Work (search nodes x candidates) a bounded search may spend before it stops and reports
#: its gap: about 1,000 nodes at 64 candidates, some milliseconds.
SEARCH_WORK = 65536
#: Candidates in runs of twins (see `best_subset`) are chosen by counts per run when there
#: are at most this many count vectors (runs of lengths l_i: the product of l_i + 1).
RUN_VECTORS_LIMIT = 100
#: Offered runs that all weigh the same to each other are solved by a dynamic programme
#: over groups of alike runs when groups x units needed is at most this (a few ms at most).
RUN_DP_LIMIT = 4096

#: Per-link, per-direction NVLink bandwidth in GB/s by NVLink version (1: P100 ... 5: B200).
NVLINK_GBPS = {1: 20, 2: 25, 3: 25, 4: 25, 5: 50}
#: Per-link bandwidth when the version is unknown (NVLink 2 to 4 all carry 25 GB/s a link).
DEFAULT_NVLINK_GBPS = 25
#: Two units on one GPU (MIG slices, replicas) talk through its own memory: above any fabric.
SAME_GPU_GBPS = 2000
#: Pair weights are GB/s x 100, so that the PCIe levels below fit under one NVLink (2,000).
WEIGHT_PER_GBPS = 100
#: PCIe relations, closest first; the largest (50) is 1/40 of the slowest single NVLink.
PCIE_WEIGHT = {
    LinkKind.SINGLE_SWITCH: 50,
    LinkKind.MULTI_SWITCH: 40,
    LinkKind.HOST_BRIDGE: 30,
    LinkKind.SAME_NUMA: 20,
    LinkKind.CROSS_NUMA: 10,
}


def link_weight(a: Unit, b: Unit) -> int:
    """The bandwidth term of the objective for one pair (see docs/placement.md)."""
    if a.gpu.uuid == b.gpu.uuid:
        return SAME_GPU_GBPS * WEIGHT_PER_GBPS
    link = a.gpu.link_to(b.gpu.uuid) or b.gpu.link_to(a.gpu.uuid)
    if link is None:
        return 0
    if link.kind is LinkKind.NVLINK:
        gbps = NVLINK_GBPS.get(link.nvlink_version, DEFAULT_NVLINK_GBPS)
        return link.count * gbps * WEIGHT_PER_GBPS
    return PCIE_WEIGHT[link.kind]


def numa_term(a: Unit, b: Unit) -> int:
    """1 when both units sit on one known NUMA node: a tie-break below any link difference."""
    na, nb = a.gpu.numa_node, b.gpu.numa_node
    return 1 if na is not None and na == nb else 0


def objective(units: Sequence[Unit]) -> tuple[int, int]:
    """(summed link weight, same-NUMA pairs) of a set; compared as a tuple, so NUMA only
    decides between sets of equal bandwidth."""
    link = numa = 0
    for a, b in itertools.combinations(units, 2):
        link += link_weight(a, b)
        numa += numa_term(a, b)
    return link, numa


def pair_score(a: Unit, b: Unit, pairs: int = 1) -> int:
    """One integer per pair that orders sets as `objective` does for sets of up to `pairs`
    pairs: the NUMA term (at most `pairs` in total) never outweighs one unit of link weight."""
    return link_weight(a, b) * (pairs + 1) + numa_term(a, b)


@dataclass(frozen=True)
class Placement:
    """The outcome of a search over a weight matrix."""

    #: Candidate indices picked, ascending.
    picked: tuple[int, ...]
    #: Objective of the picked set (fixed pairs included).
    score: int
    #: An upper bound on the best achievable score; equals `score` when proven optimal.
    bound: int
    #: Search nodes visited.
    nodes: int

    @property
    def optimal(self) -> bool:
        return self.score >= self.bound

    @property
    def gap(self) -> float:
        """How far from optimal the pick can be, as a fraction of the bound (0 = optimal)."""
        return 0.0 if self.bound <= 0 else max(0, self.bound - self.score) / self.bound


def best_subset(
    weights: Sequence[Sequence[int]],
    base: Sequence[int],
    need: int,
    *,
    fixed_score: int = 0,
    budget: int | None = None,
) -> Placement:
    """The `need` candidates maximising fixed_score + sum(base[i]) + sum(weights[i][j]).

    `weights` is a symmetric non-negative matrix over the candidates, `base[i]` what
    candidate i adds with the must-include units. Depth-first branch and bound, taking each
    candidate before leaving it out, so the first optimum found (and kept) is the
    lexicographically smallest: ties go to the earliest candidates. The bound of a node is
    the score so far plus, for the `r` slots left, the `r` largest values of
    `2 * gain[j] + top_{r-1}(row j)`, halved: each pair among the new picks is counted once
    from each end, and no row gives more than its `r-1` heaviest entries. With `budget`, the
    search stops after that many nodes and reports the root bound, so `gap` is honest.
    """
    n = len(base)
    if need <= 0:
        return Placement((), fixed_score, fixed_score, 0)
    if need > n:
        raise ValueError(f"need {need} exceeds the {n} candidates")
    # same[i]: candidate i is interchangeable with i - 1 (equal weights to everyone else,
    # equal base), as GPUs of one NVSwitch board are. Of such a run only prefixes are
    # tried: taking i while leaving i - 1 would just repeat a set already scored.
    same = [False] + [
        base[i] == base[i - 1]
        and weights[i][: i - 1] == weights[i - 1][: i - 1]
        and weights[i][i + 1 :] == weights[i - 1][i + 1 :]
        for i in range(1, n)
    ]

    # Runs of twins: with few enough of them, choosing a set is choosing how many to take
    # from each run (always a prefix of it), a handful of count vectors to score.
    runs: list[list[int]] = []
    for i in range(n):
        if same[i]:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    if math.prod(length + 1 for _, length in runs) <= RUN_VECTORS_LIMIT:
        return _best_by_runs(weights, base, need, fixed_score, [(a, k) for a, k in runs])

    # order[j]: row j's other candidates, heaviest first (ties: lowest index), for bounds
    # over what is left; top[j][m]: the sum of the m heaviest entries of row j.
    order: list[list[int]] = []
    top: list[list[int]] = []
    for j in range(n):
        row = weights[j]
        others = sorted(range(n), key=row.__getitem__, reverse=True)
        others.remove(j)
        order.append(others)
        top.append(list(itertools.accumulate([row[x] for x in others], initial=0)))

    # Bounds over what is left use `order` on small searches (7x fewer nodes on random
    # 16-GPU fabrics); on large ones the budget buys more nodes with the global rows.
    tight = n <= EXACT_LIMIT

    def rest_top(j: int, start: int, m: int) -> int:
        """The m heaviest entries of row j among candidates from `start` on."""
        if m <= 0:
            return 0
        total = 0
        row = weights[j]
        for x in order[j]:
            if x >= start and x != j:
                total += row[x]
                m -= 1
                if m == 0:
                    break
        return total

    def bound2(start: int, gain: Sequence[int], r: int) -> int:
        if tight and start:
            vals = [2 * gain[j] + rest_top(j, start, r - 1) for j in range(start, n)]
        else:
            vals = [2 * gain[j] + top[j][r - 1] for j in range(start, n)]
        vals.sort(reverse=True)
        return sum(vals[:r])

    best_score = -1
    best: tuple[int, ...] = ()
    if budget is None and need > 1:
        # A greedy set first: the search then cuts every node that cannot reach its score,
        # yet still finds the first (lexicographically smallest) set that does, since the
        # bar is one below it: equal scores are not cut.
        greedy = _greedy(weights, base, need)
        best_score = fixed_score + sum(base[i] for i in greedy)
        best_score += sum(weights[a][b] for a, b in itertools.combinations(greedy, 2)) - 1
    nodes = 0
    root2 = 2 * fixed_score + bound2(0, base, need)
    stopped = False
    stack_pick: list[int] = []

    def search(start: int, gain: list[int], score: int, r: int) -> None:
        nonlocal best_score, best, nodes, stopped
        if r == 0:
            if score > best_score:
                best_score, best = score, tuple(stack_pick)
            return
        if stopped:
            return
        nodes += 1
        if budget is not None and nodes > budget and best_score >= 0:
            stopped = True
            return
        if n - start < r or 2 * score + bound2(start, gain, r) <= 2 * best_score:
            return
        for i in range(start, n - r + 1):
            if i > start and same[i]:
                continue  # i - 1 was left out at this level; its twin i adds nothing new
            stack_pick.append(i)
            if r == 1:
                search(i + 1, gain, score + gain[i], 0)
            else:
                row = weights[i]
                search(i + 1, [g + row[x] for x, g in enumerate(gain)], score + gain[i], r - 1)
            stack_pick.pop()
            if stopped:
                return
            # Leaving i out: prune the rest of this level when it cannot beat the best.
            if 2 * score + bound2(i + 1, gain, r) <= 2 * best_score:
                return

    search(0, list(base), fixed_score, need)
    bound = best_score if not stopped else max(best_score, root2 // 2)
    return Placement(best, best_score, bound, nodes)


def _best_by_runs(
    weights: Sequence[Sequence[int]],
    base: Sequence[int],
    need: int,
    fixed_score: int,
    runs: Sequence[tuple[int, int]],
) -> Placement:
    """`best_subset` when the candidates are few runs of twins, given as (first, length).

    Twins weigh the same to everyone outside their run and every pair inside a run weighs
    the same, so a set's score depends only on how many it takes from each run. Counts are
    tried largest first, run by run, and only a strictly better score replaces the best:
    the kept vector is the lexicographically largest optimal one, whose prefixes make the
    lexicographically smallest optimal set, the one the search keeps.
    """
    k = len(runs)
    inside = [weights[a][a + 1] if length > 1 else 0 for a, length in runs]
    across = [[weights[runs[r][0]][runs[q][0]] for q in range(k)] for r in range(k)]
    gain = [base[a] for a, _ in runs]
    room = list(itertools.accumulate((length for _, length in reversed(runs)), initial=0))
    room.reverse()  # room[r]: how many the runs from r on can give
    best_score = -1
    best: list[int] = []
    counts: list[int] = []
    tried = 0

    def choose(r: int, left: int, score: int) -> None:
        nonlocal best_score, best, tried
        if r == k:
            tried += 1
            if left == 0 and score > best_score:
                best_score, best = score, list(counts)
            return
        for c in range(min(runs[r][1], left), max(0, left - room[r + 1]) - 1, -1):
            add = c * gain[r] + c * (c - 1) // 2 * inside[r]
            add += c * sum(counts[q] * across[q][r] for q in range(r))
            counts.append(c)
            choose(r + 1, left - c, score + add)
            counts.pop()

    choose(0, need, fixed_score)
    picked = tuple(a + x for (a, _), c in zip(runs, best, strict=True) for x in range(c))
    return Placement(picked, best_score, best_score, tried)


def _greedy(weights: Sequence[Sequence[int]], base: Sequence[int], need: int) -> tuple[int, ...]:
    """A quick incumbent: start from the candidate with the best neighbourhood, then add
    the candidate that gains most with what is picked (ties: lowest index)."""
    n = len(base)
    gain = list(base)
    seed = max(range(n), key=lambda j: (2 * base[j] + sum(weights[j]), -j))
    picked = [seed]
    taken = [False] * n
    taken[seed] = True
    gain = [g + weights[seed][x] for x, g in enumerate(gain)]
    while len(picked) < need:
        nxt = max((j for j in range(n) if not taken[j]), key=lambda j: (gain[j], -j))
        picked.append(nxt)
        taken[nxt] = True
        gain = [g + weights[nxt][x] for x, g in enumerate(gain)]
    return tuple(sorted(picked))


@dataclass(frozen=True)
class PairTerms:
    """`link_weight` and `numa_term` of every pair of a device set, computed once.

    Both are independent of the request (`pair_score` only scales the link term by the
    number of pairs), so one matrix serves every `GetPreferredAllocation` on that set.
    """

    #: Unit UUID -> row and column in the matrices.
    index: Mapping[str, int]
    link: tuple[tuple[int, ...], ...]
    numa: tuple[tuple[int, ...], ...]


def pair_terms(units: Sequence[Unit]) -> PairTerms:
    """The pair terms of `units` (one row per distinct UUID; the first of a UUID wins)."""
    distinct = list({u.uuid: u for u in reversed(units)}.values())[::-1]
    index = {u.uuid: k for k, u in enumerate(distinct)}
    link = tuple(tuple(link_weight(a, b) for b in distinct) for a in distinct)
    numa = tuple(tuple(numa_term(a, b) for b in distinct) for a in distinct)
    return PairTerms(index, link, numa)


#: Specs whose pair terms are cached. Specs are rebuilt on every inventory or config change
#: and the old ones dropped; a handful (one per resource name, plus a reload's overlap) is
#: all that is ever asked for, and the bound keeps replaced ones from piling up.
TERMS_CACHE_SIZE = 8
_terms_cache: dict[int, tuple[ResourceSpec, PairTerms]] = {}


def spec_terms(spec: ResourceSpec) -> PairTerms:
    """The pair terms of `spec`'s units, cached per spec object (the entry holds the spec,
    so its `id` cannot be reused while cached)."""
    return per_object(_terms_cache, spec, lambda s: pair_terms([d.unit for d in s.devices]))


#: Device sets of up to this many units are placed from a table of every subset's score
#: (2^16 entries at most, built once per topology): exact, in time bounded by the table.
TABLE_LIMIT = 16
#: Topologies whose subset tables are kept (about 5 MB each at 16 units). One per resource
#: name of at most `TABLE_LIMIT` units is all a node asks for; health flips and reloads
#: that keep the topology find theirs again (the cache is keyed by the pair terms).
TABLES_CACHE_SIZE = 4
#: Cost of scoring one offered set by enumeration against skipping one ranked set that is
#: not allowed (measured: ~140 vs ~20 ns); the cheaper way is taken for each request.
ENUMERATE_COST = 7


@dataclass(frozen=True)
class SubsetTable:
    """Every subset of a set of at most `TABLE_LIMIT` units, scored once.

    Subsets are bit masks over the rows of a `PairTerms`. `score[mask]` is the objective
    folded into one integer as `pair_score` folds it (link x (pairs + 1) + NUMA, pairs of
    the mask's own size: every set a request compares has that size). `ranked[k]` lists
    the masks of k units best first, equal scores in lexicographic order of their rows,
    so the first one a request allows is the set the branch and bound would keep.
    """

    units: int
    score: tuple[int, ...]
    ranked: tuple[tuple[int, ...], ...]


def subset_table(terms: PairTerms) -> SubsetTable:
    """The subset table of `terms` (at most `TABLE_LIMIT` units), cached per topology."""
    key = (terms.link, terms.numa)
    hit = _tables_cache.get(key)
    if hit is not None:
        return hit
    n = len(terms.index)
    if n > TABLE_LIMIT:
        raise ValueError(f"a subset table covers at most {TABLE_LIMIT} units, not {n}")
    # Built bit by bit: the masks with top bit b are those below 2^b plus b, and each adds
    # b's pair terms with the bits it holds, themselves built by doubling (no per-set loop).
    link, numa, size, rev = [0], [0], [0], [0]
    for b in range(n):
        link_row, numa_row = terms.link[b], terms.numa[b]
        with_link, with_numa = [0], [0]
        for j in range(b):
            w, v = link_row[j], numa_row[j]
            with_link += [x + w for x in with_link]
            with_numa += [x + v for x in with_numa]
        link += [x + y for x, y in zip(link, with_link, strict=True)]
        numa += [x + y for x, y in zip(numa, with_numa, strict=True)]
        size += [s + 1 for s in size]
        top = 1 << (n - 1 - b)
        rev += [r | top for r in rev]  # rev[m]: m's bits reversed
    score = [x * (s * (s - 1) // 2 + 1) + y for x, y, s in zip(link, numa, size, strict=True)]
    # Lexicographic order of row sets is descending order of their reversed masks (the set
    # holding the lowest differing row comes first); `rev` is its own inverse. The sort by
    # score is stable, so equal scores keep that order.
    ranked: list[list[int]] = [[] for _ in range(n + 1)]
    for r in range(len(rev) - 1, -1, -1):
        ranked[size[rev[r]]].append(rev[r])
    for masks in ranked:
        masks.sort(key=score.__getitem__, reverse=True)
    table = SubsetTable(n, tuple(score), tuple(tuple(m) for m in ranked))
    if len(_tables_cache) >= TABLES_CACHE_SIZE:
        del _tables_cache[next(iter(_tables_cache))]  # oldest first
    _tables_cache[key] = table
    return table


_tables_cache: dict[
    tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]], SubsetTable
] = {}


def _subsets(bits: Sequence[int], need: int, fixed: int) -> list[int]:
    """`fixed` plus every `need` of `bits` (ascending single-bit masks), lexicographic.

    Bits are added highest first and sets holding the new bit are put in front, so the
    sets holding the lowest bit come first: lexicographic order, built by doubling.
    """
    groups: list[list[int]] = [[fixed]] + [[] for _ in range(need)]
    left = len(bits)
    for b in reversed(bits):
        left -= 1
        # Only sizes that can still reach `need` with the `left` bits not added yet.
        for s in range(min(need - 1, len(bits) - left - 1), max(0, need - 1 - left) - 1, -1):
            if groups[s]:
                groups[s + 1] = [m | b for m in groups[s]] + groups[s + 1]
    return groups[need]


def table_place(
    table: SubsetTable,
    fixed: Sequence[int],
    rows: Sequence[int],
    need: int,
    *,
    enumerate_cost: int = ENUMERATE_COST,
) -> Placement:
    """The best `need` of the table rows `rows` (ascending) to join rows `fixed`: exact.

    Either every allowed set is scored by lookup (few of them), or the ranked sets of the
    request's size are read best first until one is allowed (most of them allowed),
    whichever costs less: at 16 units at most ~12,870 x 20 ns x 7/8, about 0.25 ms.
    """
    fixed_mask = sum(1 << f for f in fixed)
    bits = [1 << r for r in rows]
    k = need + len(fixed)
    ranked = table.ranked[k]
    offered = math.comb(len(rows), need)
    if offered * enumerate_cost <= len(ranked) - offered:
        masks = _subsets(bits, need, fixed_mask)
        scores = list(map(table.score.__getitem__, masks))
        mask = masks[scores.index(max(scores))]  # first of equal scores: lexicographic
        nodes = len(masks)
    else:
        check = ((1 << table.units) - 1) & ~(fixed_mask | sum(bits)) | fixed_mask
        nodes = 0
        for nodes, mask in enumerate(ranked, 1):  # noqa: B007 - the last one is the pick
            if mask & check == fixed_mask:
                break
    picked = tuple(i for i, r in enumerate(rows) if mask >> r & 1)
    score = table.score[mask]
    return Placement(picked, score, score, nodes)


def twin_runs(terms: PairTerms) -> tuple[int, ...]:
    """Per row of `terms`, the run of twins it belongs to (cached per terms object).

    Rows i - 1 and i are twins when they weigh the same to every other row (both terms),
    as the GPUs of one NVSwitch board on one NUMA node do; a chain of twins weighs the
    same inside too, so a run is interchangeable units.
    """
    return per_object(_runs_cache, terms, _twin_runs)


def _twin_runs(terms: PairTerms) -> tuple[int, ...]:
    run_of = [0]
    for i in range(1, len(terms.index)):
        twin = all(
            m[i][: i - 1] == m[i - 1][: i - 1] and m[i][i + 1 :] == m[i - 1][i + 1 :]
            for m in (terms.link, terms.numa)
        )
        run_of.append(run_of[-1] if twin else run_of[-1] + 1)
    return tuple(run_of)


_runs_cache: dict[int, tuple[PairTerms, tuple[int, ...]]] = {}


def _place_by_uniform_runs(
    terms: PairTerms, fixed: Sequence[int], rows: Sequence[int], need: int
) -> Placement | None:
    """The exact optimum when the offered rows (ascending) fall in runs of twins that all
    weigh the same to each other (boards of one node, each on its own NUMA node), and
    each run weighs at least that much inside; else None.

    Then a set's score depends only on how many it takes from each run, and the pairs
    across runs add `a x (N^2 - sum c_r^2) / 2` for N = sum c_r: what each run adds is its
    own function of c_r, convex when the run is at least as close inside as across. Of
    consecutive alike runs (same length, gain and inside weight), filling the first ones
    whole is then best (a convex sum is largest at the extremes); alike runs are solved at
    once and the few groups by a small dynamic programme over how many each takes. Ties go
    to the most from earlier runs, each taking a prefix: the lexicographically smallest
    optimal set, as the search keeps. No matrix over the offered units is built.
    """
    run_of = twin_runs(terms)
    link, numa = terms.link, terms.numa
    k = len(fixed) + need
    scale = k * (k - 1) // 2 + 1
    # Offered runs: (first row, how many offered), in row order.
    runs: list[list[int]] = []
    last = -1
    for r in rows:
        if run_of[r] == last:
            runs[-1][1] += 1
        else:
            runs.append([r, 1])
            last = run_of[r]
    if len(runs) < 2:
        return None  # one run: the search's own twin shortcut answers at once
    first = runs[0][0]
    across = link[first][runs[1][0]] * scale + numa[first][runs[1][0]]
    for (a, _), (b, _) in itertools.combinations(runs, 2):
        if link[a][b] * scale + numa[a][b] != across:
            return None
    # Per run: gain (what each unit adds with the fixed ones) and inside weight.
    gain = [sum(link[f][a] * scale + numa[f][a] for f in fixed) for a, _ in runs]
    # Inside weight of each run (a run of one offered unit never pairs inside).
    inside = [link[a][a + 1] * scale + numa[a][a + 1] if n > 1 else 0 for a, n in runs]
    if any(w < across for (_, length), w in zip(runs, inside, strict=True) if length > 1):
        return None  # not convex: leave it to the search
    # Groups of consecutive alike runs: [first run, how many runs].
    groups: list[list[int]] = []
    for i, (_, length) in enumerate(runs):
        if (
            groups
            and i > 0
            and (length, gain[i], inside[i]) == (runs[i - 1][1], gain[i - 1], inside[i - 1])
        ):
            groups[-1][1] += 1
        else:
            groups.append([i, 1])
    if len(groups) * need > RUN_DP_LIMIT:
        return None

    def h(i: int, c: int) -> int:
        """Twice what c units of run i add, without the across pairs' shared term."""
        return 2 * c * gain[i] + c * (c - 1) * inside[i] - across * c * c

    def value(g: int, x: int) -> int:
        i = groups[g][0]
        length = runs[i][1]
        return (x // length) * h(i, length) + h(i, x % length)

    cap = [count * runs[i][1] for i, count in groups]
    room = list(itertools.accumulate(reversed(cap), initial=0))[::-1]  # room[g]: groups g..
    # best[g][m]: the most groups g.. can add taking m units (None: cannot take m).
    best: list[list[int | None]] = [[None] * (need + 1) for _ in range(len(groups) + 1)]
    best[len(groups)][0] = 0
    for g in range(len(groups) - 1, -1, -1):
        nxt = best[g + 1]
        # The first group is only ever asked for all `need`; the others for every count.
        for m in [need] if g == 0 else range(min(need, room[g]) + 1):
            top: int | None = None
            for x in range(max(0, m - room[g + 1]), min(cap[g], m) + 1):
                rest = nxt[m - x]
                if rest is not None:
                    v = value(g, x) + rest
                    if top is None or v > top:
                        top = v
            best[g][m] = top
    total = best[0][need]
    if total is None:
        return None
    # Forward, each group takes the most it can while staying optimal; inside a group
    # whole runs first, then a prefix of the next.
    picked: list[int] = []
    offset = list(itertools.accumulate((length for _, length in runs), initial=0))
    m = need
    for g, (i, count) in enumerate(groups):
        nxt = best[g + 1]
        x = next(
            x
            for x in range(min(cap[g], m), -1, -1)
            if (rest := nxt[m - x]) is not None and value(g, x) + rest == best[g][m]
        )
        m -= x
        length = runs[i][1]
        for j in range(i, i + count):
            take = min(length, x)
            picked += range(offset[j], offset[j] + take)
            x -= take
    double = 2 * sum(link[a][b] * scale + numa[a][b] for a, b in itertools.combinations(fixed, 2))
    score = (double + total + across * need * need) // 2
    return Placement(tuple(picked), score, score, len(groups))


def place(
    fixed: Sequence[Unit],
    candidates: Sequence[Unit],
    need: int,
    *,
    exact_limit: int = EXACT_LIMIT,
    work: int = SEARCH_WORK,
    terms: PairTerms | None = None,
    table: bool = True,
) -> Placement:
    """The best `need` of `candidates` to join `fixed` under `objective`.

    When `terms` cover at most `TABLE_LIMIT` units (and `table` is left on), exact from
    their subset table. Else exact by branch and bound for up to `exact_limit` candidates;
    beyond, greedy then a budgeted branch and bound from the better of the two, with the
    gap it could not close. `terms` (which must cover every unit given) saves recomputing
    the pair terms; without, they are computed.
    """
    if terms is None:
        terms = pair_terms([*fixed, *candidates])
    rows = [terms.index[c.uuid] for c in candidates]
    frows = [terms.index[f.uuid] for f in fixed]
    # Both shortcuts read sets in the terms' row order: ties go to the earliest rows, as
    # the search gives them to the earliest candidates, only when the two orders agree.
    in_row_order = (
        all(a < b for a, b in itertools.pairwise(rows))
        and len(set(frows)) == len(frows)
        and not set(frows).intersection(rows)
    )
    if in_row_order and table and len(terms.index) <= TABLE_LIMIT:
        return table_place(subset_table(terms), frows, rows, need)
    if in_row_order:
        by_runs = _place_by_uniform_runs(terms, frows, rows, need)
        if by_runs is not None:
            return by_runs
    pairs = (len(fixed) + need) * (len(fixed) + need - 1) // 2
    scale = pairs + 1  # as `pair_score`: the NUMA term never outweighs one unit of link
    link, numa = terms.link, terms.numa
    n = len(candidates)
    w = []
    for i, ri in enumerate(rows):
        li, ni = link[ri], numa[ri]
        row = [li[rj] * scale + ni[rj] for rj in rows]
        row[i] = 0
        w.append(row)
    base = [sum(link[r][f] * scale + numa[r][f] for f in frows) for r in rows]
    fixed_score = sum(link[a][b] * scale + numa[a][b] for a, b in itertools.combinations(frows, 2))
    if n <= exact_limit:
        return best_subset(w, base, need, fixed_score=fixed_score)
    budget = max(64, work // n)
    found = best_subset(w, base, need, fixed_score=fixed_score, budget=budget)
    if found.optimal:
        return found
    greedy = _greedy(w, base, need)
    g_score = fixed_score + sum(base[i] for i in greedy)
    g_score += sum(w[a][b] for a, b in itertools.combinations(greedy, 2))
    if g_score > found.score:
        return Placement(greedy, g_score, max(found.bound, g_score), found.nodes)
    return found


def _best_units(
    chosen: list[AdvertisedDevice], pool: list[AdvertisedDevice], need: int, terms: PairTerms
) -> list[AdvertisedDevice]:
    # Unhealthy devices only when the healthy ones are too few (the kubelet offers healthy).
    healthy = [d for d in pool if d.health is Health.HEALTHY]
    candidates = healthy if len(healthy) >= need else pool
    found = place([d.unit for d in chosen], [d.unit for d in candidates], need, terms=terms)
    if not found.optimal:
        log.debug(
            "placement of %d from %d: within %.1f%% of optimal (search budget reached)",
            need,
            len(candidates),
            100 * found.gap,
        )
    return [candidates[i] for i in found.picked]


# ROCm's best-effort weights (lower is closer); a pair's weight is one term of each kind.
_AMD_SAME_GPU, _AMD_OTHER_GPU = 10, 20
_AMD_XGMI, _AMD_PCIE, _AMD_OTHER_LINK = 10, 40, 50
_AMD_SAME_NUMA, _AMD_OTHER_NUMA = 10, 20
#: KFD io_link types.
_IOLINK_XGMI, _IOLINK_PCIE = 11, 2


def amd_pair_weight(a: Gpu, b: Gpu) -> int:
    """How far apart two AMD devices (GPUs or partitions) are; lower is better.

    Same physical GPU, the KFD link type between them (xGMI, PCIe, other) and the NUMA
    node each add a term, with ROCm's values. Where KFD lists no link ROCm's allocator
    counts nothing for the pair; we count an "other" link instead, so an unlisted pair is
    never preferred over a listed one (real KFD trees list every GPU pair).
    """
    same_gpu = a.amd is not None and b.amd is not None and a.amd.pci_group == b.amd.pci_group
    link = a.link_to(b.uuid)
    kind = link.iolink_type if link is not None else None
    return (
        (_AMD_SAME_GPU if same_gpu else _AMD_OTHER_GPU)
        + {_IOLINK_XGMI: _AMD_XGMI, _IOLINK_PCIE: _AMD_PCIE}.get(kind or -1, _AMD_OTHER_LINK)
        + (_AMD_SAME_NUMA if a.numa_node == b.numa_node else _AMD_OTHER_NUMA)
    )


def _best_amd(
    chosen: list[AdvertisedDevice], pool: list[AdvertisedDevice], need: int
) -> list[AdvertisedDevice]:
    """The `need` devices that, with `chosen`, have the lowest total ROCm weight.

    Devices are tried GPU by GPU, the GPU with the fewest free devices first: among equal
    totals that keeps whole GPUs free for bigger requests, the tie-break ROCm uses. Small
    searches are exhaustive; larger ones start once from each GPU (take its free devices,
    then add the closest device until full) and keep the lowest total.
    """
    groups: dict[str, list[AdvertisedDevice]] = {}
    for d in pool:
        key = d.unit.gpu.amd.pci_group if d.unit.gpu.amd is not None else d.unit.uuid
        groups.setdefault(key, []).append(d)
    ordered = sorted(groups.values(), key=lambda g: (len(g), _order(g[0])))
    pool = [d for group in ordered for d in group]
    every = [d.unit.gpu for d in chosen + pool]
    weight = {
        (a.uuid, b.uuid): amd_pair_weight(a, b) for a in every for b in every if a.uuid != b.uuid
    }
    fixed = [d.unit.gpu.uuid for d in chosen]

    def total(devices: Sequence[AdvertisedDevice]) -> int:
        uuids = fixed + [d.unit.gpu.uuid for d in devices]
        return sum(weight[a, b] for a, b in itertools.combinations(uuids, 2))

    best: list[AdvertisedDevice] = []
    best_total: float = math.inf
    if math.comb(len(pool), need) <= EXHAUSTIVE_LIMIT:
        for combo in itertools.combinations(pool, need):  # first of equal totals wins
            score = total(combo)
            if score < best_total:
                best, best_total = list(combo), score
        return best
    for group in ordered:
        picked = group[:need]
        taken = {d.id for d in picked}
        rest = [d for d in pool if d.id not in taken]
        members = fixed + [d.unit.gpu.uuid for d in picked]
        cost = {d.id: sum(weight[d.unit.gpu.uuid, m] for m in members) for d in rest}
        while len(picked) < need:
            nxt = min(rest, key=lambda d: cost[d.id])  # min() keeps the first of ties
            rest.remove(nxt)
            picked.append(nxt)
            for d in rest:
                cost[d.id] += weight[d.unit.gpu.uuid, nxt.unit.gpu.uuid]
        score = total(picked)
        if score < best_total:
            best, best_total = picked, score
    return best


@dataclass(frozen=True)
class ReplicaIndex:
    """A shared spec's replica IDs by unit, built once per spec, so that a request over
    thousands of IDs costs a few C-level passes (counting, lookups), not Python per ID.

    Units are the rows of the spec's `PairTerms`.
    """

    #: Replica ID -> its unit's row.
    row_of: Mapping[str, int]
    #: Per row, its replica IDs by replica number (the order replicas are handed out in).
    ids: tuple[tuple[str, ...], ...]
    #: Per row, the same IDs as a set (free replicas are counted by intersection).
    id_sets: tuple[frozenset[str], ...]
    #: Per row, how many IDs it has.
    sizes: tuple[int, ...]
    #: Per row, its pair weight with every row in choice-key units (`_RANK` apiece): what
    #: each unit's key drops by when that row joins a request.
    gain_steps: tuple[tuple[int, ...], ...]
    #: Per row, the low fields of its choice key before any gain: 1 when the unit is
    #: unhealthy (taken only after every healthy unit), the gain field at 0, and its place
    #: in (GPU index, GPU instance, compute instance) order.
    tails: tuple[int, ...]


def replica_index(spec: ResourceSpec) -> ReplicaIndex:
    """The replica index of a shared `spec`, cached with its pair terms (same bound)."""
    return per_object(_replica_cache, spec, _replica_index)


def _replica_index(spec: ResourceSpec) -> ReplicaIndex:
    terms = spec_terms(spec)
    rows = len(terms.index)
    by_row: list[list[AdvertisedDevice]] = [[] for _ in range(rows)]
    for d in spec.devices:
        by_row[terms.index[d.unit.uuid]].append(d)
    for devices in by_row:
        devices.sort(key=lambda d: d.replica if d.replica is not None else -1)
    first = [devices[0] for devices in by_row]
    ranked = sorted(range(rows), key=lambda r: _order(first[r])[:3])
    rank = [0] * rows
    for place_, r in enumerate(ranked):
        rank[r] = place_
    return ReplicaIndex(
        row_of={d.id: terms.index[d.unit.uuid] for d in spec.devices},
        ids=tuple(tuple(d.id for d in devices) for devices in by_row),
        id_sets=tuple(frozenset(d.id for d in devices) for devices in by_row),
        sizes=tuple(len(devices) for devices in by_row),
        gain_steps=tuple(tuple(w * _RANK for w in row) for row in terms.link),
        tails=tuple(
            (int(d.health is not Health.HEALTHY) * _GAIN + _GAIN - 1) * _RANK + rank[r]
            for r, d in enumerate(first)
        ),
    )


_replica_cache: dict[int, tuple[ResourceSpec, ReplicaIndex]] = {}

# Replica choice keys, packed into one integer per unit so that each step is one C-level
# `min` (fields, most significant first; each fits its width with room to spare):
# distributed: replicas in this request, used, unhealthy, -gain, rank;
# packed: -used, unhealthy, -gain, rank.
_RANK = 1 << 20
_GAIN = 1 << 50
_TAIL = 2 * _GAIN * _RANK  # one unit of "used"
_USED = 1 << 40
_GONE = 1 << 400  # a unit with no free replica left


def _replicas(
    spec: ResourceSpec,
    chosen: list[AdvertisedDevice],
    free: AbstractSet[str],
    count: list[int],
    need: int,
    policy: AllocationPolicy,
) -> list[AdvertisedDevice]:
    """Replicas by `policy`; among equally used units, the one that talks best (under
    `objective`) with the units already in the request, then the lowest index.

    `free` holds the offered IDs (it may hold `chosen` ones too; they are skipped) and
    `count` how many of them each unit has (row order; counted by the caller in C-level
    set intersections, and consumed here). Replicas are handed out by replica number from
    the spec's index, so a request costs no sort and no Python loop over the pool.
    """
    index = replica_index(spec)
    link = spec_terms(spec).link
    taken = {d.id for d in chosen}
    in_request: dict[int, int] = {}
    for d in chosen:
        r = index.row_of[d.id]
        in_request[r] = in_request.get(r, 0) + 1
        if d.id in free:
            count[r] -= 1
    rows = len(index.ids)
    gain = [0] * rows
    for d in chosen:  # per chosen replica, as each one adds its pair weight
        gain = [g + w for g, w in zip(gain, link[index.row_of[d.id]], strict=True)]
    packed = policy is AllocationPolicy.PACKED
    replicas = spec.replicas
    if not chosen:
        # Nothing in the request yet (no must-include IDs): no gains and nothing in it, so
        # each key is its row's precomputed tail plus how used the unit is.
        if packed:
            key = [
                (_USED - replicas + left) * _TAIL + tail if left > 0 else _GONE
                for left, tail in zip(count, index.tails, strict=True)
            ]
        else:
            key = [
                (replicas - left) * _TAIL + tail if left > 0 else _GONE
                for left, tail in zip(count, index.tails, strict=True)
            ]
    else:
        key = [_GONE] * rows
        for r, left in enumerate(count):
            if left <= 0:
                continue
            used = replicas - left + in_request.get(r, 0)
            tail = index.tails[r] - gain[r] * _RANK
            if packed:
                key[r] = (_USED - used) * _TAIL + tail
            else:
                key[r] = ((in_request.get(r, 0) << 32) + used) * _TAIL + tail
    # Replicas are handed out by replica number: next[r] is where r's scan resumes.
    next_ = [0] * rows
    picked: list[AdvertisedDevice] = []
    by_id = spec.by_id
    # What a unit's scan skips: one set lookup where the pool is held by what it lacks.
    skip = (free.missing | taken) if isinstance(free, AllBut) else None
    for _ in range(need):
        target = key.index(min(key))
        ids = index.ids[target]
        j = next_[target]
        if skip is not None:
            while ids[j] in skip:
                j += 1
        else:
            while ids[j] not in free or ids[j] in taken:
                j += 1
        next_[target] = j + 1
        picked.append(by_id[ids[j]])
        # Picking one replica: one fewer free and one more in the request, both count as used.
        count[target] -= 1
        if count[target] == 0:
            key[target] = _GONE
        elif packed:
            key[target] -= 2 * _TAIL
        else:
            key[target] += (1 << 32) * _TAIL + 2 * _TAIL
        if not in_request.get(target):
            # A new unit in the request: every unit gains its pair weight with it once, in
            # one C-level pass. A gone unit's key drops too, harmlessly: `_GONE` is so far
            # above every live key that a request's gains never bring it near one.
            key = list(map(operator.sub, key, index.gain_steps[target]))
        in_request[target] = in_request.get(target, 0) + 1
    return picked
