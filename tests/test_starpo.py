"StarPO-S pieces: room groups, the variance filter (exactly the top groups, RAGEN's rounding, ties), and the collapse diagnostics on scripted policies."
import numpy as np
import pytest
import torch

from ragen_nb.advantages import group_ids, room_groups
from ragen_nb.starpo import (COLLAPSE_PATIENCE, collapse_metrics, collapse_warning, collapsing, filter_groups, filter_metrics,
                             first_actions, group_reward_std, kept_groups, top_p_groups)
from ragen_nb.tokens import Trajectory


def played(seed, rewards, first=1):
    "A trajectory of room `seed` that earned `rewards` (one per turn) and whose first answer parsed to `first`."
    return Trajectory(seed=seed, rewards=list(rewards), actions=[first] + [1] * (len(rewards) - 1))


def groups_of(totals):
    "Room groups, room k = seed 100 + k, one trajectory per total reward in `totals[k]`."
    return [played(100 + k, [r]) for k, group in enumerate(totals) for r in group]


# four rooms x four rollouts; stds (n - 1): 0, 5.774, 0.577, 0.5
TOTALS = [[1, 1, 1, 1], [0, 10, 0, 10], [0, 1, 0, 1], [5, 5, 5, 6]]


def test_groups_are_consecutive_rollouts_of_one_room():
    trajs = groups_of(TOTALS)
    assert [[t.seed for t in g] for g in room_groups(trajs, 4)] == [[100] * 4, [101] * 4, [102] * 4, [103] * 4]
    assert group_ids(trajs, 4).tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    with pytest.raises(ValueError, match='groups of 3'): room_groups(trajs, 3)
    with pytest.raises(ValueError, match='mixes seeds'): room_groups(trajs[1:] + trajs[:1], 4)


def test_group_std_is_the_unbiased_std_of_total_rewards():
    trajs = groups_of(TOTALS)
    expected = [torch.tensor(g, dtype=torch.float64).std().item() for g in TOTALS]   # torch's default: n - 1
    np.testing.assert_allclose(group_reward_std(trajs, 4), expected)
    trajs[4].rewards = [0, 4, 6]                                                     # the total counts, not the last turn
    assert group_reward_std(trajs, 4)[1] == pytest.approx(np.std([10, 10, 0, 10], ddof=1))
    assert group_reward_std(groups_of([[3], [5]]), 1).tolist() == [0, 0]


def test_filter_keeps_exactly_the_top_groups_in_batch_order():
    trajs = groups_of(TOTALS)
    kept, keep = filter_groups(trajs, 4, 0.5)                                        # 2 of 4: rooms 101 and 102
    assert keep == [False, True, True, False]
    assert [id(t) for t in kept] == [id(t) for t in trajs[4:12]]                     # the same objects, in order
    kept, keep = filter_groups(trajs, 4, 0.25)
    assert keep == [False, True, False, False] and kept == trajs[4:8]
    kept, keep = filter_groups(trajs, 4, 0.75)                                       # the zero-std room goes first
    assert keep == [False, True, True, True]
    kept, keep = filter_groups(trajs, 4, 1.0)
    assert keep == [True] * 4 and kept == trajs



def smallest_cover(std, value):
    "Reference for RAGEN-2's linear top-p: the smallest k whose k largest nonzero stds sum to at least value x the total."
    nonzero = sorted((x for x in std if x > 0), reverse=True)
    for k in range(len(nonzero) + 1):
        if sum(nonzero[:k]) >= value * sum(std) - 1e-9: return nonzero[:k]
    return nonzero


def test_top_p_keeps_the_fewest_largest_groups_that_cover_the_share():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 9))
        std = rng.choice([0., 0.5, 1., 2., 3.7, 5.], size=n) * rng.integers(0, 2, size=n) + rng.random(n) * 1e-3 * (rng.random() < .5)
        value = float(rng.choice([0.1, 0.5, 0.9, 0.99]))
        kept = top_p_groups(std, value)
        assert sorted((std[g] for g in kept), reverse=True) == smallest_cover(std, value) and len(kept) == len(set(kept))
        assert all(std[g] > 0 for g in kept)                                        # a zero std is never kept
        perm = rng.permutation(n)                                                    # the rule reads stds, not positions
        assert sorted(std[perm][g] for g in top_p_groups(std[perm], value)) == sorted(std[g] for g in kept)
    assert top_p_groups(np.zeros(5), 0.9) == []                                      # every room scored alike: an empty step
    trajs = groups_of(TOTALS)                                                        # stds 0, 5.774, 0.577, 0.5 (sum 6.85)
    assert filter_groups(trajs, 4, 0.9, 'top_p')[1] == [False, True, True, False]
    assert filter_groups(trajs, 4, 0.8, 'top_p')[1] == [False, True, False, False]  # 5.774 alone covers 5.48
    assert filter_groups(trajs, 4, 1.0, 'top_p')[0] == trajs                         # 1.0 keeps all, zero std too
    kept, keep = filter_groups(groups_of([[1, 1], [3, 3]]), 2, 0.9, 'top_p')
    assert (kept, keep) == ([], [False, False])
    assert np.isnan(filter_metrics(groups_of([[1, 1], [3, 3]]), 2, keep)['filter/kept_reward_std'])
    with pytest.raises(ValueError, match="'top_k', 'top_p'"): filter_groups(trajs, 4, 0.5, 'top_q')


def test_filter_rounds_down_as_ragen_and_breaks_ties_by_batch_order():
    assert [kept_groups(8, 0.25), kept_groups(7, 0.25), kept_groups(100, 0.29), kept_groups(10, 0.3), kept_groups(3, 1.0)] == \
        [2, 1, 29, 3, 3]                                                             # int(ratio * groups), float error forgiven
    tied = groups_of([[0, 1], [5, 5], [1, 0], [2, 3]])                               # rooms 100, 102, 103 tie at std 0.707
    _, keep = filter_groups(tied, 2, 0.5)
    assert keep == [True, False, True, False]                                       # of the three equal ones, the first two


def test_filter_metrics_by_hand():
    trajs = groups_of(TOTALS)
    _, keep = filter_groups(trajs, 4, 0.5)
    std = group_reward_std(trajs, 4)
    m = filter_metrics(trajs, 4, keep)
    assert m == pytest.approx({'filter/kept_ratio': 0.5, 'filter/kept_reward_std': (std[1] + std[2]) / 2,
                               'filter/all_reward_std': std.mean()})


def scripted(rooms, per_room, policy, seed=0):
    "Rollouts of a scripted first action: `policy(room, rng)` for `per_room` samples of each room, rewards random."
    rng = np.random.default_rng(seed)
    return [played(r, [float(rng.integers(0, 2))], policy(r, rng)) for r in rooms for _ in range(per_room)]


def test_mi_reads_a_room_blind_policy_as_collapsed_even_at_high_entropy():
    rooms = range(16)
    blind = scripted(rooms, 8, lambda r, rng: int(rng.integers(1, 5)))              # uniform over 4 actions: entropy log 4
    reads = scripted(rooms, 8, lambda r, rng: r % 4 + 1 if rng.random() < 0.8 else int(rng.integers(1, 5)))
    same = scripted(rooms, 8, lambda r, rng: 2)                                      # the echo trap: one answer for all
    m_blind, m_reads, m_same = (collapse_metrics(t, 8, seed=1) for t in (blind, reads, same))
    assert m_blind['collapse/first_actions'] == 4 and m_blind['collapse/detected'] == 1.0
    assert abs(m_blind['collapse/room_action_mi'] - m_blind['collapse/room_action_mi_null']) < 3 * m_blind['collapse/room_action_mi_null_std'] + 0.05
    assert m_reads['collapse/detected'] == 0.0
    assert m_reads['collapse/room_action_mi'] > m_reads['collapse/room_action_mi_null'] + 0.3   # clearly above its null
    assert (m_same['collapse/first_actions'], m_same['collapse/room_action_mi'], m_same['collapse/detected']) == (1, 0.0, 1.0)


def test_zero_std_share_and_first_actions():
    trajs = groups_of(TOTALS)
    trajs[0].actions = [None]                                                        # an unparsable first answer counts as one more
    m = collapse_metrics(trajs, 4)
    assert m['collapse/zero_std_share'] == 0.25 and m['collapse/first_actions'] == 2
    assert first_actions([Trajectory(seed=1)]) == [None]                             # no turn at all
    line = collapse_warning({**m, 'actor/entropy': 1.5})
    assert line.startswith(f"for {COLLAPSE_PATIENCE} steps in a row the policy's first move has not depended on the room (")
    assert COLLAPSE_PATIENCE == 3 and '(2 first moves, chosen without looking at the room;' in line
    assert f"information {m['collapse/room_action_mi']:.2f} nats" in line and 'in 25% of rooms every rollout' in line
    assert 'ACTOR_LR' in line and 'GROUP_SIZE' in line
    one = collapse_warning({**m, 'collapse/first_actions': 1}, patience=5)
    assert one.startswith('for 5 steps in a row') and '(one first move everywhere;' in one


def verdict(detected, first_actions=2, zero_std_share=0.5, step=1):
    "A metrics line of a step with room groups: the collapse verdict and what `collapsing` reads beside it."
    return {'step': step, 'collapse/detected': float(detected), 'collapse/first_actions': first_actions,
            'collapse/zero_std_share': zero_std_share, 'collapse/room_action_mi': 0.01, 'collapse/room_action_mi_null': 0.02,
            'collapse/room_action_mi_null_std': 0.01}


def test_collapsing_needs_three_steps_in_a_row_of_a_room_blind_first_move_and_rollouts_that_stopped_varying():
    bad, fine = verdict(1), verdict(0)
    assert not collapsing([]) and not collapsing([bad]) and not collapsing([bad, bad])      # a trend, not one step
    assert collapsing([bad] * 3) and collapsing([fine, bad, bad, bad]) and not collapsing([bad, bad, fine])
    assert not collapsing([bad, fine, bad, bad])                                             # in a row
    assert collapsing([bad, bad, {'step': 3, 'val/success_rate': 0.5}, bad])                 # lines without a verdict are passed over
    # detected, but the rollouts still vary: several first moves and under half the rooms tied
    assert not collapsing([bad, bad, verdict(1, first_actions=2, zero_std_share=0.25)])
    assert collapsing([bad, bad, verdict(1, first_actions=1, zero_std_share=0.0)])           # one first move everywhere
    assert collapsing([verdict(1, 3, 0.75)] * 3)                                             # most rooms tied
    assert collapsing([bad] * 2, patience=2) and not collapsing([bad] * 2, patience=3)


def test_the_run_log_warns_once_when_collapsing_turns_true(tmp_path, capsys):
    from ragen_nb.config import Config
    from ragen_nb.runlog import RunLog
    log = RunLog(tmp_path/'run', Config(), done=0)
    assert (tmp_path/'run'/'metrics.jsonl').exists()                                         # RunLog makes the run folder
    said = []
    for step, detected in enumerate([1, 1, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1], start=1):
        log.write(verdict(detected, step=step))
        said.append(capsys.readouterr().err)
    warned = [step for step, err in enumerate(said, start=1) if err]
    assert warned == [6, 12]                                                                 # the third step in a row, once per entry
    assert said[5] == f'warning: step 6: {collapse_warning(verdict(1, step=6))}\n'
    log.close()
    assert len((tmp_path/'run'/'metrics.jsonl').read_text().splitlines()) == 12
    quiet = RunLog(tmp_path/'other', Config(), done=0, main=False)                          # not the main process: nothing at all
    for step in range(1, 5): quiet.write(verdict(1, step=step))
    quiet.say('hello'); quiet.close()
    assert capsys.readouterr().err == '' and not (tmp_path/'other').exists()
