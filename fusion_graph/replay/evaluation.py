"""Measuring a calibration on trajectories it was not fitted on: held-out halves and rank statistics.

``bench/calibration.py`` and the quickstart notebook fit on one half of the
traces and measure on the other; ``rank_auc`` and ``permutation_p`` say whether
the score separates two groups of steps (e.g. of failed and solved tasks).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from fusion_graph.errors import UsageError


def split_halves(count: int, seed: int) -> tuple[list[int], list[int]]:
    """Shuffle ``0..count-1`` with ``seed`` and cut it into two halves (the first may be smaller)."""
    order = list(range(count))
    random.Random(seed).shuffle(order)
    middle = count // 2
    return sorted(order[:middle]), sorted(order[middle:])


def rank_auc(positives: Sequence[float], negatives: Sequence[float]) -> float:
    """Probability that a random positive outranks a random negative (ties count half).

    The Mann-Whitney U statistic over ``len(positives) × len(negatives)``; 0.5 is no separation.

    Raises:
        ValueError: Either group is empty.
    """
    if not positives or not negatives:
        raise UsageError("rank_auc needs at least one value in each group")
    wins = 0.0
    for p in positives:
        for n in negatives:
            wins += 1.0 if p > n else 0.5 if p == n else 0.0
    return wins / (len(positives) * len(negatives))


def permutation_p(
    positives: Sequence[float], negatives: Sequence[float], *, rounds: int = 2000, seed: int = 0
) -> float:
    """Two-sided permutation p-value of ``|rank_auc - 0.5|`` (labels shuffled ``rounds`` times)."""
    observed = abs(rank_auc(positives, negatives) - 0.5)
    pooled = list(positives) + list(negatives)
    rng = random.Random(seed)
    hits = 0
    for _ in range(rounds):
        rng.shuffle(pooled)
        shuffled = abs(rank_auc(pooled[: len(positives)], pooled[len(positives) :]) - 0.5)
        hits += shuffled >= observed - 1e-12
    return (hits + 1) / (rounds + 1)
