"GiGPO's step-level advantages against a plain-Python reference, on random episodes played in real rooms: equal to the reference, equal to the episode-level estimator with one turn or with ω = 0, invariant to the order of a group's rollouts."
import random, statistics

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ragen_nb.advantages import TurnTable, anchor_groups, gigpo, group_normalise, on_tokens
from ragen_nb.masking import collate
from ragen_nb.sokoban import ACTIONS, EnvSettings, SokobanEnv
from ragen_nb.tokens import ENV, LLM, PROMPT, Trajectory

SETTINGS = EnvSettings()
ROOMS = [20000, 20002, 20007, 20013]   # one-move, one-move, two-move and four-move rooms at the default settings

def played(seed: int, moves: list[int]) -> Trajectory:
    "An episode of room `seed` with `moves` (0 = an invalid answer: penalty -1, room unchanged), as the rollout records it."
    env = SokobanEnv(SETTINGS)
    obs = env.reset(seed=seed)
    t = Trajectory(seed=seed, room=obs)
    for a in moves:
        if a == 0: reward, done = -1.0, False
        else: obs, reward, done, info = env.step(a); t.success = info['success']
        t.actions.append(a or None); t.rewards.append(reward); t.observations.append(obs); t.dones.append(done)
        if done: break
    return t

def reference(trajs, group_size, norm, gamma, coef, eps=1e-6):
    "GiGPO by hand: {(row, turn): advantage}, from the trajectories alone, with lists, dicts and `statistics`."
    def normalised(xs):
        if len(xs) < 2: return [0.0] * len(xs)
        mean = statistics.fmean(xs)
        if norm == 'grpo': return [(x - mean) / (statistics.stdev(xs) + eps) for x in xs]
        return [(x - mean) / mean if mean > 0 else 0.0 for x in xs]
    out = {}
    for g in range(0, len(trajs), group_size):
        rows = list(range(g, g + group_size))
        score = [float(trajs[i].success) if norm == 'maxrl' else sum(trajs[i].rewards) for i in rows]
        episode = dict(zip(rows, normalised(score)))
        anchors = {}
        for i in rows:
            t = trajs[i]
            per_turn = [float(t.success and k == len(t.rewards) - 1) for k in range(len(t.rewards))] if norm == 'maxrl' else t.rewards
            ret, returns = 0.0, []
            for r in reversed(per_turn): ret = r + gamma * ret; returns.insert(0, ret)
            seen = [SokobanEnv(SETTINGS).reset(seed=t.seed)] + t.observations
            for k, ret in enumerate(returns): anchors.setdefault(seen[k], []).append((i, k, ret))
        for members in anchors.values():
            for (i, k, _), a in zip(members, normalised([r for *_, r in members])):
                out[(i, k)] = (episode[i] + coef * a) / (1 + coef)
    return out

def batch(rng: random.Random, group_size: int, max_turns: int = 5) -> list[Trajectory]:
    "Random episodes, `group_size` per room: random moves, some invalid, of random lengths."
    return [played(seed, [rng.choice([0, *ACTIONS]) for _ in range(rng.randint(1, max_turns))])
            for seed in ROOMS for _ in range(group_size)]

@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from(['maxrl', 'grpo']), st.sampled_from([0.0, 0.5, 1.0, 2.0]), st.sampled_from([1.0, 0.95, 0.5]))
def test_gigpo_equals_the_plain_loop(seed, norm, coef, gamma):
    trajs = batch(random.Random(seed), 4)
    table = TurnTable.of(trajs, 4)
    got, want = gigpo(table, norm, gamma, coef), reference(trajs, 4, norm, gamma, coef)
    cells = sorted(want)
    assert cells == [(i, t) for i in range(len(trajs)) for t in range(len(trajs[i].rewards))]
    torch.testing.assert_close(torch.tensor([got[c].item() for c in cells]), torch.tensor([want[c] for c in cells]), atol=1e-5, rtol=1e-5)
    assert (got[~table.played] == 0).all()

@pytest.mark.parametrize('norm', ['maxrl', 'grpo'])
def test_one_turn_per_episode_is_the_episode_level_estimator(norm):
    trajs = [played(seed, [a]) for seed in ROOMS for a in (0, 1, 2, 3, 4, 4)]   # every answer once, Right twice
    table = TurnTable.of(trajs, 6)
    assert table.success.sum() > 0 and (table.turns == 1).all()
    score = table.success if norm == 'maxrl' else table.total
    for coef in (0.5, 1.0, 3.0):
        torch.testing.assert_close(gigpo(table, norm, step_coef=coef)[:, 0], group_normalise(score, table.groups, norm))

@pytest.mark.parametrize('norm', ['maxrl', 'grpo'])
def test_zero_step_weight_is_the_episode_level_estimator(norm):
    table = TurnTable.of(batch(random.Random(5), 4), 4)
    score = table.success if norm == 'maxrl' else table.total
    episode = group_normalise(score, table.groups, norm)[:, None].expand_as(table.played)
    torch.testing.assert_close(gigpo(table, norm, step_coef=0.0)[table.played], episode[table.played])

def test_the_order_of_rollouts_in_a_group_does_not_matter():
    trajs = batch(random.Random(7), 4)
    rng = torch.Generator().manual_seed(0)
    order = torch.cat([torch.randperm(4, generator=rng) + 4 * g for g in range(len(ROOMS))]).tolist()
    for norm in ('maxrl', 'grpo'):
        torch.testing.assert_close(gigpo(TurnTable.of([trajs[i] for i in order], 4), norm),
                                   gigpo(TurnTable.of(trajs, 4), norm)[order])

def test_anchor_groups_stay_inside_their_room_group():
    "Two groups of the same room are not mixed, and an invalid answer leaves the turn in the state it started in."
    trajs = [played(20007, [0, 2, 2]), played(20007, [2, 2])] * 2
    groups = anchor_groups(TurnTable.of(trajs, 2))
    start = SokobanEnv(SETTINGS).reset(seed=20007)
    assert groups[(0, start)] == [(0, 0), (0, 1), (1, 0)]   # the invalid first answer left rollout 0 at the start
    assert groups[(1, start)] == [(2, 0), (2, 1), (3, 0)]   # the second group of the same room is its own

def test_advantages_reach_only_their_turns_llm_tokens():
    t = Trajectory(seed=0).add([5, 6], PROMPT, 0).add([7, 8], LLM, 1).add([9], ENV, 1).add([10, 11, 12], LLM, 2).add([13], ENV, 2)
    t.rewards = [-0.1, -0.1]
    b = collate([t, Trajectory(seed=0).add([5, 6], PROMPT, 0).add([7], LLM, 1)], pad_id=0)
    out = on_tokens(torch.tensor([[1.5, -2.0], [4.0, 0.0]]), b.turn_ids, b.loss_mask)
    assert out[0].tolist() == [0, 0, 1.5, 1.5, 0, -2.0, -2.0, -2.0, 0]
    assert out[1].tolist() == [0, 0, 4.0] + [0] * 6

@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10**6))
def test_clean_success_is_success_with_every_move_effective(seed):
    "`TurnTable.clean` (read from the room texts) against the env's own `action_is_effective`, replayed move by move; an invalid answer is never effective."
    trajs = batch(random.Random(seed), 2)
    want = []
    for t in trajs:
        env, effective = SokobanEnv(SETTINGS), []
        env.reset(seed=t.seed)
        for a in t.actions: effective.append(a is not None and env.step(a)[3]['action_is_effective'])
        want.append(float(t.success and all(effective)))
    table = TurnTable.of(trajs, 2)
    assert table.clean.tolist() == want
    assert ((table.clean == 1) <= (table.success == 1)).all()   # clean is a kind of success
