"StarPO-S pieces: room groups, the variance filter (exactly the top groups, RAGEN's rounding, ties), the collapse diagnostics on scripted policies, and the echo-trap rule on real runs and in the curves."
import numpy as np
import pytest
import torch

from ragen_nb.advantages import group_ids, room_groups
import json
from pathlib import Path
from PIL import Image
from ragen_nb.starpo import (STUCK_AT, STUCK_STEPS, collapse_metrics, collapse_warning, collapsing, echo_trap, filter_groups,
                             filter_metrics, first_actions, group_reward_std, kept_groups, stuck_share, top_p_groups)
from ragen_nb.curves import PANELS, plot_run, read_metrics, series, synthetic_metrics

RUNS = Path(__file__).resolve().parents[1]/'data'/'runs'
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


def line(step, stuck, success=0.05):
    "A metrics line of a step with room groups whose estimated stuck share is `stuck` (at training success `success`)."
    return {'step': step, 'train/success_rate': success, 'collapse/zero_std_share': stuck / (1 - success), 'collapse/first_actions': 2}


def test_stuck_share_is_tied_groups_times_failures():
    assert stuck_share({'step': 1, 'collapse/zero_std_share': 0.5, 'train/success_rate': 0.25}) == 0.375
    assert stuck_share({'step': 1, 'val/success_rate': 0.5}) is None and stuck_share({'step': 0}) is None


def test_echo_trap_is_a_trend_of_stuck_rooms_and_starts_at_its_first_stuck_step():
    assert STUCK_AT == 0.4 and STUCK_STEPS == 3
    calm = [line(s, 0.1) for s in range(1, 6)]
    assert echo_trap(calm) == [] and not collapsing(calm)
    assert echo_trap(calm + [line(6, 0.9), line(7, 0.9)]) == [(6, 7)]                  # (0.1 + 0.9 + 0.9) / 3 ≥ 0.4 at step 7; stuck from 6
    assert echo_trap(calm + [line(6, 0.9)]) == []                                       # (0.1 + 0.1 + 0.9) / 3 < 0.4: one step is no trend
    trap = calm + [line(6, 0.9), line(7, 0.9), line(8, 0.9), line(9, 0.0), line(10, 0.0), line(11, 0.0), line(12, 0.7), line(13, 0.7)]
    assert echo_trap(trap) == [(6, 9), (12, 13)] and collapsing(trap) and not collapsing(trap[:-2])
    assert echo_trap([line(1, 0.9), {'step': 2, 'val/success_rate': 0.1}, line(3, 0.9), line(4, 0.9)]) == [(1, 4)]   # val lines skipped
    back = [line(1, 0.9), line(2, 0.3), line(3, 0.5), line(4, 0.1), line(5, 0.9)]   # crosses at 3 (from 1), not at 4, again at 5 (from 3)
    assert echo_trap(back) == [(1, 5)]                                                  # one range: no two ranges share step 3
    text = collapse_warning(trap[:8])
    assert text.startswith('the echo trap since step 6: over the last 3 steps, in 90% of rooms every rollout failed alike')
    assert 'training success 0.05, against 0.05 at its best' in text and '2 distinct first moves' in text and 'KEEP_BEST=True' in text


def test_the_rule_flags_the_kept_run_that_collapsed_where_it_began_and_none_that_did_not():
    "The main job's first recipe, kept four times: SEED=0 on two CPUs (the Xeon one collapsed late), SEED=1, and SEED=2."
    runs = {name: read_metrics(RUNS/name) for name in ('first-recipe-seed0', 'first-recipe-seed1', 'first-recipe-seed0-xeon', 'first-recipe-seed2-xeon')}
    assert {name: echo_trap(r) for name, r in runs.items()} == {'first-recipe-seed0': [], 'first-recipe-seed1': [],
                                                                'first-recipe-seed0-xeon': [(27, 30)], 'first-recipe-seed2-xeon': []}
    for records in runs.values():   # the untrained model at step 1 is room-blind (collapse/detected) but not stuck
        first = next(r for r in records if r['step'] == 1)
        assert first["collapse/detected"] == 1.0 and stuck_share(first) < STUCK_AT
        assert not any(collapsing(records[:k]) for k in range(1, 20))   # nothing before step 20 in any of them


def test_the_run_log_warns_once_when_the_echo_trap_begins(tmp_path, capsys):
    from ragen_nb.config import Config
    from ragen_nb.runlog import RunLog
    log = RunLog(tmp_path/'run', Config(), done=0)
    assert (tmp_path/'run'/'metrics.jsonl').exists()                                         # RunLog makes the run folder
    said, records = [], []
    for step, stuck in enumerate([0.1, 0.9, 0.9, 0.9, 0.0, 0.0, 0.0, 0.9, 0.9, 0.9], start=1):
        records.append(line(step, stuck)); log.write(records[-1])
        said.append(capsys.readouterr().err)
    warned = [step for step, err in enumerate(said, start=1) if err]
    assert warned == [3, 9]                                                                  # once per entry into the trap
    assert said[2] == f'warning: step 3: {collapse_warning(records[:3])}\n'
    log.close()
    assert len((tmp_path/'run'/'metrics.jsonl').read_text().splitlines()) == 10
    quiet = RunLog(tmp_path/'other', Config(), done=0, main=False)                          # not the main process: nothing at all
    for step in range(1, 5): quiet.write(line(step, 0.9))
    quiet.say('hello'); quiet.close()
    assert capsys.readouterr().err == '' and not (tmp_path/'other').exists()


def test_plot_run_shades_the_synthetic_echo_trap_and_not_a_calm_run(tmp_path):
    run = tmp_path/'run'; run.mkdir()
    (run/'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in synthetic_metrics(collapse_at=70)))
    fig = plot_run(run, tmp_path/'curves.png')
    (start, end), = fig.echo_trap
    assert 70 <= start <= 80 and end == 120
    assert 'WARNING: the echo trap at steps' in fig._suptitle.get_text() and Image.open(tmp_path/'curves.png').format == 'PNG'
    calm = plot_run(synthetic_metrics(collapse_at=None))
    assert calm.echo_trap == [] and 'WARNING' not in calm._suptitle.get_text()
    kept = plot_run(RUNS/'first-recipe-seed0')   # low entropy at the end, every room solved: no warning
    assert kept.echo_trap == [] and 'WARNING' not in kept._suptitle.get_text()


def test_plot_run_nulls_and_missing_keys():
    records = [{'step': 1, 'score/mean': 1.0, 'actor/entropy': None}, {'step': 2, 'score/mean': None}, {'step': 3, 'score/mean': 3.0}]
    steps, values = series(records, 'score/mean')
    assert steps.tolist() == [1, 3] and values.tolist() == [1.0, 3.0]
    fig = plot_run(records)
    no_data = [ax.get_title() for ax in fig.axes if any(t.get_text() == 'no data' for t in ax.texts)]
    assert no_data == [title for title, keys in PANELS if 'score/mean' not in keys]


def test_read_metrics_lines(tmp_path):
    path = tmp_path/'metrics.jsonl'
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "score/me')
    with pytest.warns(UserWarning, match='line 3: unfinished last line'): assert read_metrics(tmp_path) == [{'step': 1}, {'step': 2}]
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r'metrics\.jsonl, line 2, is not a JSON record'): read_metrics(path)
    (tmp_path/'empty').mkdir()
    with pytest.raises(FileNotFoundError, match=r'empty/metrics\.jsonl does not exist'): read_metrics(tmp_path/'empty')
