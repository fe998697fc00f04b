"Tests of ragen_nb.sokoban against gym-sokoban itself, hand-worked rooms and invariances."
import contextlib, io, itertools, json, os, random, subprocess, sys, warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings as hsettings, strategies as st

from ragen_nb import sokoban
from ragen_nb.sokoban import (ACTIONS, BOX, BOX_ON_TARGET, FLOOR, MAX_ATTEMPTS, PLAYER, TARGET, WALL, EnvSettings,
                              SokobanEnv, derived_seed, generate_room, render_rgb, render_text, room_from_text, solve)

with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
    warnings.simplefilter('ignore')
    from gym_sokoban.envs.render_utils import room_to_rgb
    from gym_sokoban.envs.room_utils import generate_room as gym_generate_room
    from gym_sokoban.envs.sokoban_env import SokobanEnv as GymSokobanEnv


def gym_env_on(room_fixed, room_state, max_steps):
    "gym-sokoban's own env holding the given room."
    env = GymSokobanEnv(dim_room=room_fixed.shape, max_steps=max_steps, num_boxes=int((room_fixed == TARGET).sum()),
                        reset=False)
    env.room_fixed, env.room_state = room_fixed.copy(), room_state.copy()
    env.player_position = np.argwhere(room_state == PLAYER)[0]
    env.num_env_steps, env.reward_last = 0, 0
    env.boxes_on_target = int((room_state == BOX_ON_TARGET).sum())
    return env


# ---- settings -------------------------------------------------------------------------------------------------

def test_settings_defaults_and_env_vars(monkeypatch):
    for name in ('DIM_X', 'DIM_Y', 'NUM_BOXES', 'MAX_STEPS', 'SEARCH_DEPTH'): monkeypatch.delenv(name, raising=False)
    assert EnvSettings.from_env() == EnvSettings(6, 6, 1, 5, 30)
    monkeypatch.setenv('DIM_X', '8'); monkeypatch.setenv('NUM_BOXES', '2'); monkeypatch.setenv('SEARCH_DEPTH', '100')
    assert EnvSettings.from_env() == EnvSettings(8, 6, 2, 5, 100)
    assert EnvSettings.from_env(max_steps=9).max_steps == 9
    monkeypatch.setenv('MAX_STEPS', 'ten')
    with pytest.raises(ValueError, match='MAX_STEPS'): EnvSettings.from_env()


@pytest.mark.parametrize('kwargs, name', [
    (dict(num_boxes=3, dim_x=4, dim_y=4), 'num_boxes'), (dict(num_boxes=0), 'num_boxes'),
    (dict(num_boxes=15, dim_x=6, dim_y=6), 'num_boxes'),
    (dict(dim_x=2), 'dim_x'), (dict(dim_y=1), 'dim_y'), (dict(max_steps=0), 'max_steps'),
    (dict(search_depth=-1), 'search_depth'), (dict(search_depth=2), 'search_depth'), (dict(dim_x=6.0), 'dim_x')])
def test_bad_settings_name_the_setting(kwargs, name):
    with pytest.raises(ValueError, match=name): EnvSettings(**kwargs)
    with pytest.raises(ValueError, match=name): SokobanEnv(EnvSettings(), **kwargs)


def test_the_box_limit_is_the_interior_less_the_player_and_one_free_cell():
    "A 6x6 room has a 4x4 interior: 14 boxes fit beside the player and one free cell, 15 do not."
    assert EnvSettings(dim_x=6, dim_y=6, num_boxes=14).num_boxes == 14
    with pytest.raises(ValueError, match='num_boxes'): EnvSettings(dim_x=6, dim_y=6, num_boxes=15)
    assert EnvSettings(dim_x=7, dim_y=6, num_boxes=18).num_boxes == 18   # 5x4 interior
    with pytest.raises(ValueError, match='num_boxes'): EnvSettings(dim_x=7, dim_y=6, num_boxes=19)


# ---- seeds ----------------------------------------------------------------------------------------------------

SEED_SETTINGS = [EnvSettings(), EnvSettings(dim_x=7, dim_y=7, num_boxes=2, search_depth=100),
                 EnvSettings(search_depth=3)]  # the last needs retries for most seeds


def _rooms_text(seeds):
    return [[render_text(*generate_room(s, seed)) for seed in seeds] for s in SEED_SETTINGS]


def test_same_seed_same_room_in_another_process():
    seeds = list(range(15))
    script = ('import json; from ragen_nb.sokoban import *\n'
              f'sets = [EnvSettings(**d) for d in {[vars(s) for s in SEED_SETTINGS]!r}]\n'
              f'print(json.dumps([[render_text(*generate_room(s, seed)) for seed in {seeds!r}] for s in sets]))')
    for hashseed in ('1', '12345'):
        out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, check=True,
                             env={**os.environ, 'PYTHONHASHSEED': hashseed}).stdout
        assert json.loads(out) == _rooms_text(seeds)


def test_global_random_state_is_left_unchanged():
    random.seed(7); np.random.seed(7)
    before = random.getstate(), np.random.get_state()
    generate_room(EnvSettings(search_depth=3), 5)  # retries too
    SokobanEnv().reset(seed=11)
    after = random.getstate(), np.random.get_state()
    assert after[0] == before[0]
    assert all(np.array_equal(a, b) for a, b in zip(after[1], before[1]))


def test_rooms_differ_between_seeds_and_reset_none_keeps_its_seed():
    assert len({render_text(*generate_room(EnvSettings(), seed)) for seed in range(20)}) > 15
    env = SokobanEnv()
    first = env.reset()
    assert env.reset(env.seed) == first


@pytest.mark.parametrize('seed', [-1, 2**32, 1.5, '3', True])
def test_bad_seed(seed):
    with pytest.raises(ValueError, match='seed'): generate_room(EnvSettings(), seed)


def test_derived_seeds_are_fixed_numbers():
    assert derived_seed(5, 0) == 5
    assert derived_seed(5, 1) == int.from_bytes(__import__('hashlib').sha256(b'5/1').digest()[:4], 'little')
    assert len({derived_seed(5, k) for k in range(MAX_ATTEMPTS)}) == MAX_ATTEMPTS


def test_failed_attempt_retries_with_the_derived_seed():
    settings = EnvSettings(search_depth=3)
    retried = 0
    for seed in range(40):
        for attempt in range(MAX_ATTEMPTS):
            with sokoban._seeded(derived_seed(seed, attempt)):
                try: expected = sokoban._attempt(settings); break
                except (RuntimeError, RuntimeWarning): continue
        retried += attempt > 0
        room = generate_room(settings, seed)
        assert np.array_equal(room[0], expected[0]) and np.array_equal(room[1], expected[1])
    assert retried > 10  # the loop really exercised retries


def test_generator_gives_up_after_a_bounded_number_of_attempts(monkeypatch):
    # a 2x2 interior: the cell behind a stepping player is always wall, so no box can ever be pulled
    with pytest.raises(RuntimeError, match=f'{MAX_ATTEMPTS} attempts.*search_depth'):
        generate_room(EnvSettings(dim_x=4, dim_y=4, num_boxes=2), 0)
    calls = []
    def failing(settings):
        calls.append(random.random()); raise RuntimeWarning('Generated Model with score == 0')
    monkeypatch.setattr(sokoban, '_attempt', failing)
    with pytest.raises(RuntimeError, match='seed 3'): generate_room(EnvSettings(), 3)
    assert len(calls) == MAX_ATTEMPTS and len(set(calls)) == MAX_ATTEMPTS  # a new seed each time


# ---- the generator against PyPI's ------------------------------------------------------------------------------

@pytest.mark.parametrize('dim, num_boxes', [((6, 6), 1), ((7, 7), 2), ((6, 8), 1)])
def test_depth_300_reproduces_pypi_generate_room(dim, num_boxes):
    settings, compared = EnvSettings(dim_x=dim[0], dim_y=dim[1], num_boxes=num_boxes, search_depth=300), 0
    for seed in range(25):
        with sokoban._seeded(seed):
            try: theirs = gym_generate_room(dim=dim, num_steps=int(1.7 * sum(dim)), num_boxes=num_boxes)
            except (RuntimeError, RuntimeWarning): continue  # there ours retries with another seed
        ours = generate_room(settings, seed)
        assert np.array_equal(ours[0], theirs[0]) and np.array_equal(ours[1], theirs[1])
        compared += 1
    assert compared >= 20


def test_search_depth_changes_solution_lengths():
    def mean_length(depth):
        s = EnvSettings(search_depth=depth)
        return np.mean([len(solve(*generate_room(s, seed))) for seed in range(50)])
    shallow, deep = mean_length(5), mean_length(30)
    assert shallow + 1 < deep
    assert mean_length(3) == 1.0  # depth 3 allows exactly one pull, so one push solves it


def test_generated_rooms_are_well_formed():
    s = EnvSettings(dim_x=7, dim_y=8, num_boxes=2)
    for seed in range(10):
        fixed, state = generate_room(s, seed)
        assert fixed.shape == state.shape == (7, 8)
        assert (state == PLAYER).sum() == 1 and (state == BOX).sum() == 2 and (fixed == TARGET).sum() == 2
        assert (state == BOX_ON_TARGET).sum() == 0  # every box starts off its target
        assert solve(fixed, state) is not None


# ---- dynamics against gym-sokoban's env ---------------------------------------------------------------------------

def _compare(room_fixed, room_state, actions, max_steps):
    ours, theirs = SokobanEnv(max_steps=max_steps), gym_env_on(room_fixed, room_state, max_steps)
    assert ours.load_room(room_fixed, room_state) == render_text(room_fixed, room_state)
    for action in actions:
        before = ours.room_state.copy()
        obs, reward, done, info = ours.step(action)
        _, their_reward, their_done, _ = theirs.step(action, observation_mode='tiny_rgb_array')
        assert np.array_equal(ours.room_state, theirs.room_state)
        assert reward == their_reward and done == their_done  # exact: same float operations in the same order
        assert info['success'] == theirs._check_if_all_boxes_on_target()
        assert info['action_is_effective'] == (not np.array_equal(before, ours.room_state))
        assert obs == render_text(ours.room_fixed, ours.room_state)
        if done:
            with pytest.raises(RuntimeError, match='episode is over'): ours.step(action)
            break


actions_st = st.lists(st.sampled_from(list(ACTIONS)), min_size=1, max_size=40)


@hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), which=st.sampled_from([(6, 6, 1), (7, 7, 2), (8, 8, 3)]),
       actions=actions_st, max_steps=st.integers(1, 40))
def test_dynamics_match_gym_sokoban_on_generated_rooms(seed, which, actions, max_steps):
    dim_x, dim_y, num_boxes = which
    room = generate_room(EnvSettings(dim_x=dim_x, dim_y=dim_y, num_boxes=num_boxes, search_depth=30), seed)
    _compare(*room, actions, max_steps)


@st.composite
def random_rooms(draw):
    "Any walled room: random inner walls, boxes (some already on targets), targets, the player (maybe on a target)."
    h, w = draw(st.integers(3, 7)), draw(st.integers(4, 7))
    inner = [(r, c) for r in range(1, h - 1) for c in range(1, w - 1)]
    assume(len(inner) >= 3)
    cells = draw(st.permutations(inner))
    n = draw(st.integers(1, (len(inner) - 1) // 2))
    player, boxes, spare = cells[0], cells[1:n + 1], cells[n + 1:2 * n + 1]
    targets = [box if draw(st.booleans()) else other for box, other in zip(boxes, spare)]
    if targets[0] != boxes[0] and draw(st.booleans()): targets[0] = player  # the player starts on a target
    fixed = np.zeros((h, w), dtype=int)
    for cell in inner: fixed[cell] = draw(st.sampled_from([FLOOR, FLOOR, FLOOR, WALL]))
    for cell in [player, *boxes]: fixed[cell] = FLOOR
    for cell in targets: fixed[cell] = TARGET
    state = fixed.copy()
    for box in boxes: state[box] = BOX_ON_TARGET if fixed[box] == TARGET else BOX
    state[player] = PLAYER
    return fixed, state


@hsettings(max_examples=300, deadline=None)
@given(room=random_rooms(), actions=actions_st, max_steps=st.integers(1, 40))
def test_dynamics_match_gym_sokoban_on_random_rooms(room, actions, max_steps):
    _compare(*room, actions, max_steps)


@hsettings(max_examples=50, deadline=None)
@given(room=random_rooms())
def test_render_rgb_matches_room_to_rgb(room):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', DeprecationWarning)
        assert np.array_equal(render_rgb(*room), room_to_rgb(room[1], room[0]))


def test_hand_computed_rewards():
    env = SokobanEnv(max_steps=10)
    env.load_room(*room_from_text('''
        #######
        #P_X_O#
        #######'''))
    rewards = [env.step(a)[1] for a in (1, 4, 4)]
    assert rewards == [-0.1, -0.1, -0.1]
    obs, reward, done, info = env.step(4)
    assert reward == pytest.approx(10.9) and done and info == {'success': True, 'action_is_effective': True}
    assert obs.splitlines()[1] == '#___P√#'
    env = SokobanEnv(max_steps=3)
    env.load_room(*room_from_text('''
        ######
        #P√_O#
        #X___#
        #____#
        ######'''))
    assert env.step(4)[1] == pytest.approx(-1.1)  # off its target
    assert env.step(4)[1] == pytest.approx(0.9)   # onto another target, one still empty
    obs, reward, done, info = env.step(3)          # the third of max_steps=3 actions
    assert reward == pytest.approx(-0.1) and done and not info['success']
    assert env.num_steps == 3


def test_step_rejects_bad_actions_and_steps_before_reset():
    env = SokobanEnv()
    with pytest.raises(RuntimeError, match='reset'): env.step(1)
    env.reset(seed=0)
    for action in (0, 5, -1, None, '1', 1.5, True):
        with pytest.raises(ValueError, match='action'): env.step(action)
    assert env.num_steps == 0


def test_player_on_target_symbol_and_effectiveness():
    env = SokobanEnv(max_steps=5)
    env.load_room(*room_from_text('''
        #####
        #PO_#
        #X__#
        #___#
        #####'''))
    obs, _, _, info = env.step(4)
    assert obs.splitlines()[1] == '#_S_#' and info['action_is_effective']
    obs, _, _, info = env.step(1)  # into the wall
    assert obs.splitlines()[1] == '#_S_#' and not info['action_is_effective']


# ---- text ------------------------------------------------------------------------------------------------------

def test_text_round_trip_and_errors():
    for seed in range(10):
        room = generate_room(EnvSettings(dim_x=7, dim_y=7, num_boxes=2), seed)
        back = room_from_text(render_text(*room))
        assert np.array_equal(back[0], room[0]) and np.array_equal(back[1], room[1])
    with pytest.raises(ValueError, match='unknown symbols'): room_from_text('###\n#P?\n###')
    with pytest.raises(ValueError, match='same length'): room_from_text('###\n#P#X\n###')


@pytest.mark.parametrize('text, message', [
    ('#####\n#PXO_\n#####', 'border'), ('######\n#PXOP#\n######', 'one player'),
    ('######\n#PXX_#\n##O###\n######', 'as many boxes as targets'), ('#####\n#P__#\n#####', 'at least one')])
def test_load_room_rejects_broken_rooms(text, message):
    with pytest.raises(ValueError, match=message): SokobanEnv().load_room(*room_from_text(text))


def test_load_room_rejects_inconsistent_arrays():
    fixed, state = room_from_text('#####\n#PXO#\n#####')
    state[1, 3] = WALL  # a wall in the state where room_fixed has a target
    with pytest.raises(ValueError, match='disagrees'): SokobanEnv().load_room(fixed, state)


# ---- images ----------------------------------------------------------------------------------------------------

def test_render_rgb_matches_gym_sokoban_and_marks_player_on_target():
    room = room_from_text('''
        #####
        #PO_#
        #X__#
        #___#
        #####''')
    env = SokobanEnv(max_steps=5)
    env.load_room(*room)
    frame = env.render_rgb()
    assert frame.shape == (5 * 16, 5 * 16, 3) and frame.dtype == np.uint8
    env.step(4)
    theirs = gym_env_on(*room, max_steps=5)
    theirs.step(4, observation_mode='tiny_rgb_array')
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', DeprecationWarning)  # gym-sokoban's imageio.imread calls
        assert np.array_equal(env.render_rgb(), theirs.render('rgb_array'))
    on_target, on_floor = env.render_rgb()[16:32, 32:48], frame[16:32, 16:32]
    assert not np.array_equal(on_target, on_floor)  # S and P look different


# ---- solver ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('text, answer', [
    ('#######\n#P_X_O#\n#######', [4, 4, 4]),
    ('#####\n#_P_#\n#_X_#\n#_O_#\n#####', [2]),
    ('#######\n#__P__#\n#_X___#\n#_O___#\n#######', [3, 2]),
    ('#####\n#√P_#\n#####', []),
    ('#####\n#X_P#\n#__O#\n#####', None),                      # a box in a corner never moves
    ('######\n#PXX_#\n#__OO#\n######', None)])                # boxes against the top wall never leave it
def test_solve_known_rooms(text, answer):
    assert solve(*room_from_text(text)) == answer


def test_solve_max_depth():
    room = room_from_text('######\n#O___#\n#_X__#\n#___P#\n######')
    assert len(solve(*room)) == 6
    assert solve(*room, max_depth=5) is None


def _solves(room, actions):
    env = SokobanEnv(max_steps=max(1, len(actions)))
    env.load_room(*room)
    for action in actions:
        _, _, done, info = env.step(action)
        if info['success']: return True
        if done: return False
    return False


@pytest.mark.parametrize('dims', [(6, 6, 1), (7, 7, 2)])
def test_solution_replays_and_is_optimal(dims):
    dim_x, dim_y, num_boxes = dims
    checked = 0
    for seed in range(15):
        room = generate_room(EnvSettings(dim_x=dim_x, dim_y=dim_y, num_boxes=num_boxes), seed)
        solution = solve(*room)
        env = SokobanEnv(max_steps=len(solution))
        env.load_room(*room)
        results = [env.step(a) for a in solution]
        assert results[-1][3]['success'] and not any(r[3]['success'] for r in results[:-1])
        assert sum(r[1] for r in results) == pytest.approx(-0.1 * len(solution) + num_boxes + 10)
        if len(solution) <= 6:  # brute force: no sequence one shorter solves it (success at any prefix counts)
            assert not any(_solves(room, list(seq)) for seq in itertools.product(ACTIONS, repeat=len(solution) - 1))
            checked += 1
    assert checked >= 5
