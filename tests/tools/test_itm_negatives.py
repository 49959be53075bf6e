"""benchmarks/itm_negatives.py's bound: the best ITM accuracy when a same-class negative looks like a
positive to any head (1 positive : 2 negatives a batch row, as CLIP + MLM's ITM draws them)."""

from __future__ import annotations

import random

import pytest

from benchmarks.itm_negatives import best_itm_accuracy


@pytest.mark.parametrize("share, best", [(0.0, 1.0), (0.25, 1 / 3 + 2 / 3 * 0.75), (0.5, 2 / 3), (0.7367, 2 / 3),
                                         (1.0, 2 / 3)])
def test_the_bound_is_the_better_of_all_no_match_and_match_by_class(share, best):
    assert best_itm_accuracy(share) == pytest.approx(best)


def test_the_bound_is_what_the_best_class_only_rule_scores_on_simulated_pairs():
    # Pairs as ITM makes them: each positive with a negative caption and a negative image, each of
    # the positive's class with probability `share`; a head seeing only (same class?) answers by rule.
    rng, share = random.Random(0), 0.3
    pairs = []
    for _ in range(20000):
        pairs.append((True, True))  # (same class, match)
        pairs += [(rng.random() < share, False) for _ in range(2)]
    for rule in (lambda same: False, lambda same: same):
        score = sum(rule(same) == match for same, match in pairs) / len(pairs)
        assert score <= best_itm_accuracy(share) + 0.01
    assert max(sum(r(s) == m for s, m in pairs) / len(pairs) for r in (lambda s: False, lambda s: s)) == \
        pytest.approx(best_itm_accuracy(share), abs=0.01)


def test_a_share_outside_zero_and_one_is_refused():
    with pytest.raises(ValueError, match="same_class_share"):
        best_itm_accuracy(1.2)
