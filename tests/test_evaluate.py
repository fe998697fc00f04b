"""Tests of ragen_nb.evaluate: Wilson intervals, the room/action MI and its null, the baselines and the metrics."""
import math

import numpy as np
import pytest

from ragen_nb.evaluate import mi_from_counts, room_action_mi, wilson_interval


# --- Wilson interval ---------------------------------------------------------------------------------------------

def test_wilson_hand_computed():
    # 5/10: centre 0.5, half-width 1.96/1.38416*sqrt(0.025+0.009604) = 0.26341
    lo, hi = wilson_interval(5, 10)
    assert lo == pytest.approx(0.23659, abs=1e-5) and hi == pytest.approx(0.76341, abs=1e-5)
    # 0/10: [0, (z²/n)/(1+z²/n)] = [0, 0.27754]; n/n mirrors it
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.27754), abs=1e-5)
    assert wilson_interval(10, 10) == pytest.approx((0.72246, 1.0), abs=1e-5)
    assert wilson_interval(0, 0) == (0.0, 1.0)


@pytest.mark.parametrize('k,n,z', [(1, 7, 1.96), (43, 100, 1.96), (86, 200, 2.576), (3, 512, 1.0)])
def test_wilson_bounds_solve_the_score_equation(k, n, z):
    "Each bound p satisfies (k/n − p)² = z² p(1−p)/n, the definition of the Wilson interval."
    lo, hi = wilson_interval(k, n, z)
    assert lo < k / n < hi
    for p in (lo, hi): assert (k / n - p) ** 2 == pytest.approx(z * z * p * (1 - p) / n, abs=1e-12)


def test_wilson_rejects_impossible_counts():
    with pytest.raises(ValueError, match='successes <= n'): wilson_interval(11, 10)
    with pytest.raises(ValueError, match='0 <= successes'): wilson_interval(-1, 10)


# --- room/action mutual information ------------------------------------------------------------------------------

def test_plugin_mi_hand_computed():
    assert mi_from_counts([[3, 0], [0, 3]], miller_madow=False) == pytest.approx(math.log(2))
    assert mi_from_counts([[3, 0], [0, 3]]) == pytest.approx(math.log(2) + 1 / 12)  # (m−1)/2N on H(A) only
    h_a = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert mi_from_counts([[2, 0], [1, 1]], miller_madow=False) == pytest.approx(h_a - 0.5 * math.log(2))


def test_plugin_mi_matches_the_joint_formula():
    counts = np.random.default_rng(3).integers(0, 6, (9, 5))
    N, ref = counts.sum(), 0.0
    for r in range(9):
        for a in range(5):
            if counts[r, a]: ref += counts[r, a] / N * math.log(counts[r, a] * N / (counts[r].sum() * counts[:, a].sum()))
    assert mi_from_counts(counts, miller_madow=False) == pytest.approx(ref, abs=1e-12)


def _policy_samples(kind, rooms_n=200, per_room=4, seed=0):
    rng = np.random.default_rng(seed)
    rooms = np.repeat(np.arange(10_000, 10_000 + rooms_n), per_room)
    names = np.array(['Up', 'Down', 'Left', 'Right', None], dtype=object)
    if kind == 'ignores': actions = rng.choice(names, len(rooms), p=[0.4, 0.3, 0.15, 0.1, 0.05])
    else: actions = names[rooms % 4]
    return list(rooms), list(actions)


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_mi_of_a_policy_that_ignores_the_room_is_on_its_null(seed):
    rooms, actions = _policy_samples('ignores', seed=seed)
    s = room_action_mi(rooms, actions, shuffles=30, seed=seed)
    assert abs(s['mi'] - s['mi_null']) < 3 * s['mi_null_std']
    assert s['mi'] > 0.1  # still positive: the null, not zero, is the reference


def test_mi_of_a_policy_that_reads_the_room_is_far_above_its_null():
    s = room_action_mi(*_policy_samples('reads'))
    assert s['mi'] > s['mi_null'] + 3 * s['mi_null_std']
    assert s['mi'] == pytest.approx(math.log(4), abs=0.05)


def test_mi_null_keeps_group_sizes_and_is_reproducible():
    rooms, actions = _policy_samples('ignores', rooms_n=30)
    assert room_action_mi(rooms, actions, seed=5) == room_action_mi(rooms, actions, seed=5)
    # one sample per room: every permutation gives the same table margins, hence the same MI, with zero spread
    s = room_action_mi(list(range(6)), ['Up', 'Up', 'Down', None, 'Up', 'Left'])
    h = -sum(c / 6 * math.log(c / 6) for c in (3, 1, 1, 1)) + 3 / 12
    assert s['mi'] == pytest.approx(h) and s['mi_null'] == pytest.approx(h) and s['mi_null_std'] == pytest.approx(0)


def test_mi_nan_and_errors():
    for rooms, actions in [([], []), ([7, 7], ['Up', 'Down'])]:
        assert all(math.isnan(v) for v in room_action_mi(rooms, actions).values())
    with pytest.raises(ValueError, match='one room per action'): room_action_mi([1, 2], ['Up'])
    # None is a category: rooms split by None vs Up carry ln 2 nats (plug-in)
    s = room_action_mi([0, 0, 1, 1], [None, None, 'Up', 'Up'], shuffles=0)
    assert s['mi'] == pytest.approx(math.log(2) + 1 / 8) and math.isnan(s['mi_null'])
