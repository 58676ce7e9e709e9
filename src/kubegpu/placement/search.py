"""Which `need` candidates maximise a sum of pair weights: exact, or bounded with its gap.

Exact by branch and bound up to `EXACT_LIMIT` candidates; beyond, a greedy pick improved by
the same search under a node budget, with an upper bound on the optimum so the pick says
how far from optimal it can be.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

#: Exact branch and bound for up to this many candidates; beyond, a bounded search.
EXACT_LIMIT = 16
#: Bounds evaluated x candidates a bounded search may spend before it stops: about 200
#: bounds at 64 candidates, a few milliseconds.
SEARCH_WORK = 12288


@dataclass(frozen=True)
class Placement:
    """The outcome of a search: candidate indices picked, their score and a bound."""

    #: Candidate indices picked, ascending.
    picked: tuple[int, ...]
    #: The score of the picked set (fixed pairs included).
    score: int
    #: An upper bound on the best achievable score; equals `score` when proven optimal.
    bound: int
    #: Search nodes (bounds evaluated).
    nodes: int

    @property
    def optimal(self) -> bool:
        return self.score >= self.bound

    @property
    def gap(self) -> float:
        """How far from optimal the pick can be, as a fraction of the bound (0: optimal)."""
        return 0.0 if self.bound <= 0 else max(0, self.bound - self.score) / self.bound


def best_subset(
    weights: Sequence[Sequence[int]],
    base: Sequence[int],
    need: int,
    *,
    fixed_score: int = 0,
    twins: Sequence[int] | None = None,
    budget: int | None = None,
) -> Placement:
    """The `need` candidates maximising fixed_score + sum(base[i]) + sum(weights[i][j]).

    `weights` is a symmetric non-negative matrix (zero diagonal), `base[i]` what candidate
    i adds with the fixed units. `twins[i]` names i's class of interchangeable candidates
    (equal weights to everyone else): of a class only a prefix is ever taken, so equivalent
    sets are scored once. Depth first, each candidate taken before it is left out, and only
    a strictly better set replaces the best: the answer is the lexicographically smallest
    optimal set. The greedy pick's score less one is the first bar, so nodes that cannot
    reach it are cut from the start while sets that tie it are still found. With `budget`,
    the search stops after that many bounds and keeps the greedy pick if it found nothing
    better; its bound is then the root's, so `gap` is honest.
    """
    n = len(base)
    if need <= 0:
        return Placement((), fixed_score, fixed_score, 0)
    if need > n:
        raise ValueError(f"need {need} exceeds the {n} candidates")
    cls = list(twins) if twins is not None else list(range(n))
    greedy = _greedy(weights, base, need)
    greedy_score = score_of(weights, base, greedy, fixed_score)
    # An exact search bounds a candidate's partners by the live ones (7x fewer nodes on
    # random 16-GPU fabrics); a budgeted one by its whole row, which costs a sort per row
    # once instead of a walk per bound, and buys more nodes with the budget.
    tight = budget is None
    order: list[list[int]] = []  # tight: each row's candidates, heaviest first
    top: list[list[int]] = []  # else: the sums of each row's heaviest entries
    for row in weights:
        if tight:
            order.append(sorted(range(n), key=row.__getitem__, reverse=True))
        else:
            top.append(list(itertools.accumulate(sorted(row, reverse=True), initial=0)))
    nodes, stopped = 0, False

    def bound2(start: int, gain: Sequence[int], closed: set[int], r: int) -> int:
        """Twice the most that r more picks from the live candidates (from `start` on, of a
        class still open) can add: each one's gain doubled plus its r - 1 heaviest
        partners (each pair among them is counted from both ends)."""
        nonlocal nodes, stopped
        nodes += 1
        if budget is not None and nodes > budget:
            stopped = True
        live = [j for j in range(start, n) if cls[j] not in closed]
        if len(live) < r:
            return -1
        if not tight:
            vals = [2 * gain[j] + top[j][r - 1] for j in live]
        else:
            vals = []
            for j in live:
                row, total, left = weights[j], 2 * gain[j], r - 1
                for x in order[j]:
                    if left == 0:
                        break
                    if x >= start and x != j and cls[x] not in closed:
                        total += row[x]
                        left -= 1
                vals.append(total)
        vals.sort(reverse=True)
        return sum(vals[:r])

    root2 = 2 * fixed_score + bound2(0, base, set(), need)
    # Even a greedy pick proven optimal by the root bound is searched past: another optimal
    # set may come first in index order, and ties go to the lowest indices everywhere.
    best_score, best = greedy_score - 1, greedy
    nodes = 0
    picked: list[int] = []

    def search(start: int, gain: list[int], score: int, r: int, closed: set[int]) -> None:
        nonlocal best_score, best
        if r == 0:
            if score > best_score:
                best_score, best = score, tuple(picked)
            return
        if r == 1:  # a leaf's best is the first live candidate of the largest gain
            live = [j for j in range(start, n) if cls[j] not in closed]
            if live:
                top = max(live, key=lambda j: (gain[j], -j))
                if score + gain[top] > best_score:
                    best_score, best = score + gain[top], (*picked, top)
            return
        closed = set(closed)  # classes left out at this level stay shut below it only
        for i in range(start, n):
            if cls[i] in closed:
                continue
            if 2 * score + bound2(i, gain, closed, r) <= 2 * best_score or stopped:
                return
            picked.append(i)
            row = weights[i]
            search(
                i + 1,
                [g + w for g, w in zip(gain, row, strict=True)],
                score + gain[i],
                r - 1,
                closed,
            )
            picked.pop()
            if stopped:
                return
            closed.add(cls[i])  # i left out: its later twins would only repeat sets

    search(0, list(base), fixed_score, need, set())
    if best_score < greedy_score:  # stopped before it even tied the greedy pick
        best_score, best = greedy_score, greedy
    bound = max(best_score, root2 // 2) if stopped else best_score
    return Placement(best, best_score, bound, nodes)


def bounded(
    weights: Sequence[Sequence[int]],
    base: Sequence[int],
    need: int,
    *,
    fixed_score: int = 0,
    twins: Sequence[int] | None = None,
    work: int = SEARCH_WORK,
) -> Placement:
    """`best_subset`, exact up to `EXACT_LIMIT` candidates and budgeted beyond."""
    n = len(base)
    budget = None if n <= EXACT_LIMIT else max(16, work // n)
    return best_subset(weights, base, need, fixed_score=fixed_score, twins=twins, budget=budget)


def score_of(
    weights: Sequence[Sequence[int]], base: Sequence[int], picked: Sequence[int], fixed: int = 0
) -> int:
    pairs = sum(weights[a][b] for a, b in itertools.combinations(picked, 2))
    return fixed + sum(base[i] for i in picked) + pairs


def _greedy(weights: Sequence[Sequence[int]], base: Sequence[int], need: int) -> tuple[int, ...]:
    """A quick incumbent: start from the candidate with the best neighbourhood, then add
    the one that gains most with what is picked; among equal gains, the one with most
    weight to the candidates still left (on a fragmented node: the board with the most
    free GPUs, not the lowest-numbered one), then the lowest index."""
    n = len(base)
    rest = [sum(row) for row in weights]  # weight to the candidates not picked
    seed = max(range(n), key=lambda j: (2 * base[j] + rest[j], -j))
    picked, gain = [seed], list(base)
    left = set(range(n))
    while True:
        nxt = picked[-1]
        left.remove(nxt)
        row = weights[nxt]
        gain = [g + w for g, w in zip(gain, row, strict=True)]
        rest = [r - w for r, w in zip(rest, row, strict=True)]
        if len(picked) == need:
            return tuple(sorted(picked))
        picked.append(max(left, key=lambda j: (gain[j], rest[j], -j)))
