"""Tests of ragen_nb.evaluate: Wilson intervals, the room/action MI and its null, the baselines and the metrics."""
import json, math

import numpy as np
import pytest

from ragen_nb.stats import mi_from_counts, room_action_mi, wilson_interval


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


# --- baselines -----------------------------------------------------------------------------------------------------

from ragen_nb.evaluate import (action_sequences, baseline_rows, baselines, cached_room, format_table, heldout_seeds, play,
                               solve_steps, solve_steps_loop, trajectory_metrics, turn_budget, model_rows)
from ragen_nb.sokoban import ACTIONS, EnvSettings, room_from_text, solve
from ragen_nb.tokens import Trajectory

# Hand-counted with T = 2 (16 sequences): A is solved by the 4 sequences starting with Right (step 1) and by Up, Right
# (Up bumps into the wall, step 2); B only by Up, Right (step 2); C needs three moves.
A = room_from_text('#######\n#_PXO_#\n#_____#\n#######')
B = room_from_text('######\n#__XO#\n#_P__#\n######')
C = room_from_text('#######\n#P__XO#\n#_____#\n#######')
UP, DOWN, LEFT, RIGHT = 1, 2, 3, 4


def _solved(steps, turns): return {seq: int(s) for seq, s in zip(action_sequences(turns), steps) if s}


@pytest.mark.parametrize('steps', [solve_steps, solve_steps_loop])
def test_enumeration_matches_hand_counts(steps):
    assert _solved(steps(*A, 2), 2) == {(UP, RIGHT): 2, (RIGHT, UP): 1, (RIGHT, DOWN): 1, (RIGHT, LEFT): 1, (RIGHT, RIGHT): 1}
    assert _solved(steps(*B, 2), 2) == {(UP, RIGHT): 2}
    assert _solved(steps(*C, 2), 2) == {}
    assert _solved(steps(*C, 3), 3) == {(RIGHT, RIGHT, RIGHT): 3}
    assert len(steps(*A, 3)) == 64 and list(steps(*A, 0)) == [0]


def test_array_enumeration_equals_the_env_loop_on_generated_rooms():
    for settings, turns in [(EnvSettings(search_depth=4), 2), (EnvSettings(), 4),
                            (EnvSettings(dim_x=7, dim_y=7, num_boxes=2, search_depth=10), 3)]:
        for seed in range(20000, 20004):
            room = cached_room(settings, seed)
            assert (solve_steps(*room, turns) == solve_steps_loop(*room, turns)).all()


def test_enumeration_agrees_with_bfs():
    for seed in range(20000, 20030):
        room = cached_room(EnvSettings(), seed)
        steps, plan = solve_steps(*room, 5), solve(*room, max_depth=5)
        assert (plan is not None) == bool(steps.any())
        if plan is not None: assert len(plan) == steps[steps > 0].min()


def test_baseline_rows_on_hand_rooms():
    rows = {r['policy']: r for r in baseline_rows([A, B, C], [A, B], 2)}
    assert rows['uniform random']['success_rate'] == pytest.approx((5 + 1 + 0) / 48)
    assert rows['uniform random']['mean_turns'] == pytest.approx(((4 * 1 + 12 * 2) / 16 + 2 + 2) / 3)
    fixed = rows['best fixed sequence']
    assert fixed['note'].startswith('Up, Right (1.000 on 2 training rooms)') and fixed['success_rate'] == pytest.approx(2 / 3)
    bfs = rows['BFS optimum']
    assert bfs['success_rate'] == pytest.approx(2 / 3) and bfs['mean_turns'] == pytest.approx((1 + 2 + 2) / 3)
    assert bfs['distinct_first_actions'] == 3 and bfs['first_action_entropy'] == pytest.approx(math.log(3))
    lo, hi = wilson_interval(2, 3)
    assert (bfs['success_low'], bfs['success_high']) == pytest.approx((lo, hi))


def test_success_by_solution_length_on_hand_rooms():
    "A needs 1 move, B 2 (Up, Right), C 3 (Right x3): by_length splits each baseline's hand-counted successes by that length."
    assert [len(solve(*r, max_depth=3)) for r in (A, B, C)] == [1, 2, 3]
    rows = {r['policy']: r['by_length'] for r in baseline_rows([A, B, C], [A, B], 3)}
    for room, key in ((A, '1'), (B, '2'), (C, '3')):
        solved = (solve_steps_loop(*room, 3) > 0).mean()      # the plain env loop, not the array version by_length used
        assert rows['uniform random'][key] == dict(rooms=1, success_rate=pytest.approx(solved))
    assert rows['uniform random']['3']['success_rate'] == pytest.approx(1 / 64)   # only Right, Right, Right solves C
    assert {k: v['success_rate'] for k, v in rows['BFS optimum'].items()} == {'1': 1.0, '2': 1.0, '3': 1.0}
    # the fixed sequence chosen on A and B is Up, Right, then a first-in-order third move: it solves A and B, not C
    assert {k: v['success_rate'] for k, v in rows['best fixed sequence'].items()} == {'1': 1.0, '2': 1.0, '3': 0.0}
    two = {r['policy']: r['by_length'] for r in baseline_rows([A, B, C], [A, B], 2)}
    assert set(two['BFS optimum']) == {'1', '2', 'none'} and two['BFS optimum']['none'] == dict(rooms=1, success_rate=0.0)


def test_best_fixed_sequence_is_chosen_on_training_rooms_only():
    # trained on C's three-move plan, the fixed sequence is Right, Right, Right, which solves A and C but not B
    rows = baseline_rows([A, B, C], [C], 3)
    assert rows[1]['note'].startswith('Right, Right, Right') and rows[1]['success_rate'] == pytest.approx(2 / 3)
    # trained on B alone, many sequences tie at 1.0; the first in product order wins: Up, Up (a wall: no move), Right
    rows = baseline_rows([A, B, C], [B], 3)
    assert rows[1]['note'].startswith('Up, Up, Right') and rows[1]['success_rate'] == pytest.approx(2 / 3)


def test_baselines_use_the_turn_budget_and_the_heldout_seeds():
    assert turn_budget(EnvSettings(max_steps=3), 5) == 3 and turn_budget(EnvSettings(max_steps=10), 2) == 2
    settings = EnvSettings(search_depth=4, max_steps=1)
    one = baselines(settings, max_turns=2, n=20, train_rooms=20)
    two = baselines(EnvSettings(search_depth=4), max_turns=2, n=20, train_rooms=20)
    assert one[2]['note'] == 'solve(max_depth=1)' and two[2]['note'] == 'solve(max_depth=2)'
    assert one[0]['success_rate'] < two[0]['success_rate']
    rooms = [cached_room(EnvSettings(search_depth=4), s) for s in heldout_seeds(20)]
    assert two[2]['success_rate'] == np.mean([solve(*r, max_depth=2) is not None for r in rooms])
    with pytest.raises(ValueError, match='train_rooms=0'): baselines(settings, 2, 5, train_rooms=0)


def test_heldout_seeds_follow_the_training_range():
    assert heldout_seeds(3) == [20000, 20001, 20002]
    assert heldout_seeds(2, seed=5, train_size=10) == [15, 16]


def test_format_table_shows_every_row_with_dashes_for_missing_values():
    text = format_table(baseline_rows([A, B], [A], 2))
    lines = text.splitlines()
    assert len(lines) == 5 and lines[0].startswith('policy') and set(lines[1]) <= {'-', ' '}
    assert lines[2].split()[10:14] == ['-', '-', 'exact:', 'all']   # 'uniform random': MI and MI null do not apply


def test_format_table_reads_a_table_back_from_json_unchanged(tmp_path):
    from ragen_nb.cli import write_json
    rows = baseline_rows([A, B], [A], 2) + [dict(policy='model greedy', rooms=2, episodes=2, success_rate=0.5, success_low=0.1,
                                                 success_high=0.9, mi=math.nan, mi_null=math.nan, mi_null_std=math.nan)]
    kept = json.loads(write_json(tmp_path/'t.json', rows).read_text())['rows']    # nan is kept as null
    assert kept[-1]['mi'] is None and format_table(kept) == format_table(rows)


# --- model evaluation -----------------------------------------------------------------------------------------------

def _traj(seed, actions, success): return Trajectory(seed=seed, actions=list(actions), rewards=[-0.1] * len(actions), success=success)


def test_trajectory_metrics_by_hand():
    trajs = [_traj(1, [UP], True), _traj(1, [None, UP], False), _traj(2, [DOWN, DOWN], False), _traj(2, [DOWN], True)]
    m = trajectory_metrics(trajs, shuffles=5)
    assert (m['rooms'], m['episodes'], m['success_rate']) == (2, 4, 0.5)
    assert (m['success_low'], m['success_high']) == pytest.approx(wilson_interval(1, 2))   # n = rooms, not episodes
    assert m['valid_action_rate'] == pytest.approx(5 / 6) and m['mean_turns'] == pytest.approx(6 / 4)
    assert m['distinct_first_actions'] == 3                                                 # Up, None, Down
    assert m['first_action_entropy'] == pytest.approx(-(0.25 * math.log(0.25) * 2 + 0.5 * math.log(0.5)))
    assert m['mi'] == pytest.approx(mi_from_counts([[1, 1, 0], [0, 0, 2]]))
    with pytest.raises(ValueError, match='no trajectories'): trajectory_metrics([])


class Recorder:
    "ScriptedEngine that remembers its batch sizes."
    def __init__(self, engine): self.engine, self.batches = engine, []
    def generate(self, prompts, *args, **kwargs):
        self.batches.append(len(prompts)); return self.engine.generate(prompts, *args, **kwargs)


def test_play_chunks_the_episodes_without_changing_them(tok):
    from ragen_nb.rollout import RolloutConfig, ScriptedEngine
    settings, cfg = EnvSettings(search_depth=4), RolloutConfig(max_turns=2, max_response_length=8, temperature=1.0)
    reply = lambda text: ['Up', 'Down', 'Left', 'Right'][len(text) % 4] + '</answer>'   # reads the context
    seeds = heldout_seeds(5)
    whole, chunked = Recorder(ScriptedEngine(tok, reply)), Recorder(ScriptedEngine(tok, reply))
    a = play(whole, tok, seeds, settings, cfg, samples=2, chunk_size=100, progress=False)
    b = play(chunked, tok, seeds, settings, cfg, samples=2, chunk_size=3, progress=False)
    assert max(chunked.batches) == 3 and whole.batches[0] == 10
    assert [t.seed for t in a] == [s for s in seeds for _ in range(2)]
    assert [(t.seed, t.actions, t.success) for t in a] == [(t.seed, t.actions, t.success) for t in b]
    with pytest.raises(ValueError, match='repeats one greedy episode'):
        play(whole, tok, seeds, settings, RolloutConfig(temperature=0.0), samples=2)


def test_scripted_players_score_their_baselines(tok):
    "A player reading the room with BFS scores the BFS optimum; a blind best fixed sequence scores its baseline."
    import re
    from ragen_nb.rollout import RolloutConfig, ScriptedEngine
    settings, turns, n = EnvSettings(search_depth=4), 2, 30
    grid = re.compile(r'^[#_OX√PS]+$', re.MULTILINE)
    def bfs(text):
        plan = solve(*room_from_text('\n'.join(grid.findall(text)[-settings.dim_x:])), max_depth=turns)
        return f'{ACTIONS[plan[0] if plan else 1]}</answer>'
    ref = baselines(settings, turns, n, train_rooms=200)
    sequence = [next(a for a in ACTIONS if ACTIONS[a] == name) for name in ref[1]['note'].split(' (')[0].split(', ')]
    fixed = lambda text: f"{ACTIONS[sequence[text.count('<|im_start|>assistant') - 1]]}</answer>"
    cfg = RolloutConfig(max_turns=turns, max_response_length=8)
    rows = [model_rows(ScriptedEngine(tok, f), tok, heldout_seeds(n), settings, cfg, name, temperatures=(0.0,), progress=False)[0]
            for name, f in (('bfs', bfs), ('fixed', fixed))]
    assert rows[0]['success_rate'] == ref[2]['success_rate'] == 1.0
    assert rows[1]['success_rate'] == ref[1]['success_rate']
    assert rows[1]['first_action_entropy'] == 0 and rows[1]['distinct_first_actions'] == 1
    assert rows[0]['valid_action_rate'] == rows[1]['valid_action_rate'] == 1.0


def test_move_quality_on_scripted_episodes():
    from ragen_nb.evaluate import move_quality
    from ragen_nb.sokoban import SokobanEnv
    settings, turns = EnvSettings(search_depth=4), 2
    seeds = [s for s in range(20000, 20040) if len(solve(*cached_room(settings, s), max_depth=turns)) == 2][:3]
    def episode(seed, actions): return _traj(seed, actions, False)
    def no_effect_action(seed):
        for a in ACTIONS:
            env = SokobanEnv(settings); env.reset(seed=seed); before = env.room_state.copy(); env.step(a)
            if (env.room_state == before).all(): return a
    plans = {s: solve(*cached_room(settings, s), max_depth=turns) for s in seeds}
    bfs = move_quality([episode(s, plans[s]) for s in seeds], settings, turns)
    assert [(r['turn'], r['answers'], r['solvable'], r['optimal'], r['no_effect']) for r in bfs] == [(1, 3, 3, 1.0, 0.0), (2, 3, 3, 1.0, 0.0)]
    # a wasted first move leaves one move for a 2-move room: lost, so turn 2 is not judged
    bumps = [episode(s, [no_effect_action(s), plans[s][0]]) for s in seeds if no_effect_action(s)]
    assert bumps, 'no room with a no-effect move among the chosen ones'
    q = move_quality(bumps, settings, turns)
    assert (q[0]['optimal'], q[0]['no_effect'], q[1]['solvable'], q[1]['answers']) == (0.0, 1.0, 0, len(bumps))
    invalid = move_quality([episode(seeds[0], [None, plans[seeds[0]][0]])], settings, turns)   # an answer that was no action
    assert (invalid[0]['no_action'], invalid[0]['optimal'], invalid[1]['solvable']) == (1.0, 0.0, 0)
