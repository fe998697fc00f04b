"The start-state curriculum: starts on the solver's path, the schedule on a scripted learner, and a run that trains near the goal while validation and evaluation play true starts only."
import collections, json, math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import ragen_nb.evaluate as evaluate
import ragen_nb.trainer as trainer
from ragen_nb.config import Config
from ragen_nb.sokoban import EnvSettings, SokobanEnv, room_from_text, solve
from ragen_nb.starts import StartSchedule, distance_shaping, solution, start_state
from ragen_nb.tokens import Trajectory

ROOMS = EnvSettings(search_depth=30)   # RAGEN's setting: rooms of 1 to 9 moves


@settings(max_examples=40, deadline=None)
@given(st.integers(10000, 19999), st.integers(1, 9))
def test_a_start_k_moves_before_the_goal_is_the_solutions_first_moves_played(seed, k):
    plan = solution(ROOMS, seed)
    env = SokobanEnv(ROOMS, max_steps=20); room = env.reset(seed=seed)
    for action in plan[:max(len(plan) - k, 0)]: room, *_ = env.step(action)   # played by hand, apart from start_state
    assert start_state(ROOMS, seed, k) == room
    assert len(solve(*room_from_text(room))) == min(k, len(plan))                # BFS from there needs exactly k moves
    if k >= len(plan): assert room == SokobanEnv(ROOMS).reset(seed=seed)           # k >= L: the true start


def test_the_solution_is_the_shortest_and_found_once():
    plan = solution(ROOMS, 10002)
    assert list(plan) == solve(*evaluate.cached_room(ROOMS, 10002)) and solution(ROOMS, 10002) is plan   # cached: the same tuple


def run(schedule, steps, can, length=5, rooms=16):
    "Frontiers of `steps` steps of a scripted learner: of the episodes starting at most `can` moves before the goal, the 1st, 3rd, 5th... at each start succeed; the others fail."
    out = []
    for step in range(steps):
        ks, seen = schedule.moves_left(rooms, np.random.default_rng(step)), collections.Counter()
        solved = []
        for k in ks:
            seen[k] += 1
            solved.append(k is not None and k <= can and k < length and seen[k] % 2 == 1)
        out.append(schedule.update(solved, ks, [length] * rooms)['start/frontier'])
    return out


def test_the_schedule_moves_back_when_the_learner_succeeds_and_never_past_a_rooms_length():
    assert run(StartSchedule(frontier=1), 8, can=3) == [1, 2, 3, 4, 4, 4, 4, 4]       # stops where the learner fails
    assert run(StartSchedule(frontier=1), 8, can=9) == [1, 2, 3, 4, 5, 5, 5, 5]       # stops at the most moves an episode plays
    assert run(StartSchedule(frontier=1), 4, can=9, length=2) == [1, 2, 2, 2]         # a 2-move room has no rung past 2
    assert run(StartSchedule(frontier=2, advance_at=0.8), 4, can=9) == [2, 2, 2, 2]   # about half succeed, under 0.8: no move
    shares = StartSchedule(frontier=4, true_share=0.25, easier_share=0.25).moves_left(4000, np.random.default_rng(0))
    assert abs(shares.count(None) / 4000 - 0.25) < 0.03 and abs(shares.count(4) / 4000 - 0.5) < 0.03
    assert {k for k in shares if k not in (None, 4)} == {1, 2, 3}                   # the easier starts: below the frontier, all of it


def test_the_step_metrics_count_frontier_and_true_starts_apart():
    m = StartSchedule(frontier=2).update([True, False, True, True], [2, 2, None, 5], [5, 5, 5, 5])
    assert m == {'start/frontier': 2, 'start/frontier_success': 0.5, 'start/true_start_share': 0.5, 'start/true_start_success': 1.0}


def test_a_run_trains_near_the_goal_and_validates_and_judges_only_true_starts(tiny_dir, tmp_path, monkeypatch):
    played = []
    def spy(module, kind):
        real = module.rollout
        def wrapper(engine, tok, seeds, settings, cfg, seed=None, rooms=None):
            trajs = real(engine, tok, seeds, settings, cfg, seed=seed, rooms=rooms)
            played.append((kind, list(seeds), rooms, [t.room for t in trajs], settings))
            return trajs
        monkeypatch.setattr(module, 'rollout', wrapper)
    spy(trainer, 'train'); spy(evaluate, 'held-out')   # training rollouts; validation and eval play through 10's `play`
    args = [f'BASE_MODEL={tiny_dir}', f'OUTPUT_DIR={tmp_path}', 'EXPERIMENT_NAME=starts', 'TRAIN_BATCH_SIZE=8', 'GROUP_SIZE=2',
            'ADV_ESTIMATOR=maxrl', 'PPO_BATCH_SIZE=8', 'MICRO_BATCH_SIZE=2', 'MAX_TURNS=3', 'MAX_STEPS=3', 'MAX_RESPONSE_LENGTH=6',
            'KL_COEF=0', 'START_CURRICULUM=True', 'START_MOVES=2', 'START_TRUE_SHARE=0.25', 'START_EASIER_SHARE=0.25',
            'TEST_FREQ=1', 'VAL_ROOMS=4', 'TOTAL_STEPS=2', 'SAVE_FREQ=1', 'ROLLOUT_ENGINE=hf']
    out = trainer.train(Config.from_args(args), progress=False)
    assert out['error'] is None
    train = [p for p in played if p[0] == 'train']
    assert len(train) == 2
    for _, seeds, rooms, firsts, settings in train:
        assert rooms is not None and firsts == rooms                                # each episode began where it was told
        starts = [r for r, s in zip(rooms, seeds) if r != SokobanEnv(settings).reset(seed=s)]
        assert starts and all(len(solve(*room_from_text(r))) <= 2 for r in starts)   # the shifted ones: at most 2 moves from the goal
        assert all(rooms[i] == rooms[i + 1] for i in range(0, len(rooms), 2))       # one start per room group
    held_out = [p for p in played if p[0] == 'held-out']
    assert held_out and all(rooms is None for _, _, rooms, _, _ in held_out)
    assert all(f == SokobanEnv(settings).reset(seed=s) for _, seeds, _, firsts, settings in held_out for s, f in zip(seeds, firsts))
    lines = [json.loads(l) for l in (tmp_path/'starts'/'metrics.jsonl').read_text().splitlines()]
    first, last = [l for l in lines if 'start/frontier' in l]
    assert first['start/frontier'] == 2 and 0 < first['start/true_start_share'] < 1
    saved = json.loads((tmp_path/'starts'/'global_step_2'/'start.json').read_text())
    moved = last['start/frontier_success'] is not None and last['start/frontier_success'] >= 0.5 and last['start/frontier'] < 3
    assert saved['frontier'] == last['start/frontier'] + moved                      # the frontier the next step would use
    # a resumed run goes on from the saved frontier
    resumed = trainer.setup(Config.from_args(args + ['RESUME=True', 'TOTAL_STEPS=3']))
    assert resumed.starts.frontier == saved['frontier'] and resumed.done == 2


def test_evaluation_plays_true_starts(tiny_dir, tmp_path, monkeypatch):
    "ragen_nb eval judges a model on held-out rooms from their true starts, whatever the run it came from trained on."
    import ragen_nb.cli as cli
    seen = []
    real = evaluate.rollout
    def spy(engine, tok, seeds, settings, cfg, seed=None, rooms=None):
        seen.append(rooms); trajs = real(engine, tok, seeds, settings, cfg, seed=seed, rooms=rooms)
        assert all(t.room == SokobanEnv(settings).reset(seed=s) for t, s in zip(trajs, seeds))
        return trajs
    monkeypatch.setattr(evaluate, 'rollout', spy)
    assert cli.main(['eval', f'MODEL={tiny_dir}', 'BASE=none', 'N=3', 'MAX_TURNS=2', 'TEMPERATURES=0', 'TRAIN_ROOMS=5']) == 0
    assert seen and all(r is None for r in seen)


def bfs_moves(room: str) -> int:
    "The reference distance: moves `solve` needs from `room` within 30, or 31 when it finds none."
    plan = solve(*room_from_text(room), max_depth=30)
    return 31 if plan is None else len(plan)

@settings(max_examples=30, deadline=None)
@given(st.integers(10000, 19999), st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_distance_shaping_undone_telescopes_to_the_change_in_distance(seed, moves):
    "sinh(shaping / α) of each turn is that turn's change in BFS distance, so over an episode they sum to N(start) − N(end) (found here by `solve`)."
    env = SokobanEnv(ROOMS)
    t = Trajectory(seed=seed, room=env.reset(seed=seed))
    for a in moves:
        obs, reward, done, info = env.step(a)
        t.actions.append(a); t.rewards.append(reward); t.observations.append(obs)
        if done: break
    shaped = distance_shaping(t, 0.1, 30)
    assert len(shaped) == len(t.observations)
    assert sum(round(math.sinh(x / 0.1)) for x in shaped) == bfs_moves(t.room) - bfs_moves(t.observations[-1])
    assert all(x == 0 for x, before, after in zip(shaped, [t.room] + t.observations, t.observations) if before == after)


def test_distance_shaping_reaches_the_update(tiny_dir, tmp_path, monkeypatch):
    "With DISTANCE_SHAPING the rewards the update sees are the env's plus α·asinh(N(s) − N(s′)) for each move, N found by `solve`."
    from ragen_nb.rollout import ScriptedEngine
    played, updated = [], []
    real_rollout, real_step = trainer.rollout, trainer.ppo_step
    def scripted(engine, tok, seeds, settings, cfg, seed=None, rooms=None):   # every answer Up, so moves are played
        trajs = real_rollout(ScriptedEngine(tok, lambda text: 'Up</answer>'), tok, seeds, settings, cfg, seed=seed, rooms=rooms)
        played.extend((t.room, list(t.observations), list(t.rewards)) for t in trajs)
        return trajs
    def step(trajs, *args, **kwargs):
        updated.extend(list(t.rewards) for t in trajs)
        return real_step(trajs, *args, **kwargs)
    monkeypatch.setattr(trainer, 'rollout', scripted); monkeypatch.setattr(trainer, 'ppo_step', step)
    args = [f'BASE_MODEL={tiny_dir}', f'OUTPUT_DIR={tmp_path}', 'EXPERIMENT_NAME=shaped', 'TRAIN_BATCH_SIZE=8', 'GROUP_SIZE=2',
            'ADV_ESTIMATOR=grpo', 'PPO_BATCH_SIZE=8', 'MICRO_BATCH_SIZE=2', 'MAX_TURNS=3', 'MAX_STEPS=3', 'MAX_RESPONSE_LENGTH=6',
            'KL_COEF=0', 'SEARCH_DEPTH=30', 'DISTANCE_SHAPING=0.1', 'TEST_FREQ=0', 'TOTAL_STEPS=1', 'SAVE_FREQ=1', 'ROLLOUT_ENGINE=hf']
    assert trainer.train(Config.from_args(args), progress=False)['error'] is None
    assert len(updated) == len(played) == 8
    moved = 0
    for (room, seen, env_rewards), got in zip(played, updated):
        rooms = [room] + seen
        want = [r + 0.1 * math.asinh(bfs_moves(a) - bfs_moves(b)) for r, a, b in zip(env_rewards, rooms, rooms[1:])]
        assert got == pytest.approx(want)
        moved += sum(bfs_moves(a) != bfs_moves(b) for a, b in zip(rooms, rooms[1:]))
    assert moved > 0                                                                 # some Up changed the distance
