"The thought before the answer (13): splitting and format against hand-written replies, grounding against a hand-built room, the MI summary against a plain count, truncation on real model replies, and the think/ metrics of scripted episodes."
import json, math, re
from pathlib import Path

import pytest

from ragen_nb.data import positions
from ragen_nb.rollout import CLOSE, RolloutConfig, ScriptedEngine, rollout, truncate_after_answer
from ragen_nb.sokoban import EnvSettings
from ragen_nb.thinking import THINK_METRICS, claims, grounding, split_reply, thought_metrics, thought_mi

ROOM = '######\n#____#\n#_X__#\n#_P_O#\n#____#\n######'   # player (3, 2), box (2, 2) right above it, target (3, 4)


def test_split_reply_on_hand_written_replies():
    "The thought, and the action only in R1's format (RAGEN's rule in think mode, `parse_reply`)."
    assert split_reply('<think> the box is above me </think> <answer>Up</answer>') == ('the box is above me', 1)
    assert split_reply('<think> push it up <answer>Up</answer>') == ('push it up', None)   # never closed: the thought ends at the answer, no action
    assert split_reply('<think> I will think about this for a very long') == ('I will think about this for a very long', None)
    assert split_reply('<think> hmm </think> <answer>jump</answer>') == ('hmm', None)   # closed, but the answer holds no action
    assert split_reply('<answer>Up</answer>') == ('', None)   # no thought at all


def test_claims_are_read_and_judged_against_the_room():
    assert positions(ROOM) == {'you': [(3, 2)], 'boxes': [(2, 2)], 'targets': [(3, 4)]}
    true = 'I am at (3, 2). The box is at (2, 2) and the target is at (3,4). The box is above me. The box must go down.'
    assert claims(true) == [('player', (3, 2)), ('box', (2, 2)), ('target', (3, 4)), ('side', 'box', 'above'), ('goes', 'down')]
    assert grounding(true, ROOM) == dict(claims=5, true=5)
    false = 'The box is at (3, 3). The box is to the left of me. The box must go up. The target is below me.'
    assert grounding(false, ROOM) == dict(claims=4, true=0)
    assert grounding('Let me think step by step about the best move.', ROOM) == dict(claims=0, true=0)   # nothing checkable


def test_thought_mi_is_the_plain_count_of_first_words():
    rooms = [0, 0, 1, 1, 2, 2, 3, 3]
    blind = ['I should move the box towards the target now, carefully'] * 8   # the same first words in every room
    assert thought_mi(rooms, blind)['mi'] == 0
    words = ['left', 'left', 'up', 'up', 'down', 'down', 'right', 'right']
    reads = [f'The box must go {w} so I push it {w} and then stop here' for w in words]
    mi = thought_mi(rooms, reads)
    # plug-in MI of the 4x4 table by a plain loop, plus Miller-Madow's (cells - rows - columns + 1) / 2n
    n, joint = len(rooms), {}
    for r, w in zip(rooms, words): joint[r, w] = joint.get((r, w), 0) + 1
    pr = {r: rooms.count(r) / n for r in set(rooms)}; pw = {w: words.count(w) / n for w in set(words)}
    plug_in = sum(c / n * math.log(c / n / (pr[r] * pw[w])) for (r, w), c in joint.items())
    assert mi['mi'] == pytest.approx(plug_in - (len(joint) - len(pr) - len(pw) + 1) / (2 * n))
    assert mi['mi'] > mi['mi_null'] + 3 * mi['mi_null_std']
    # words past the eighth never count: thoughts that differ only there read as room-blind
    late = [f'one two three four five six seven eight {w}' for w in words]
    assert thought_mi(rooms, late)['mi'] == 0


def test_truncation_keeps_the_first_answer_of_real_think_replies(tok):
    "Replies the untrained model wrote at T=1 with no stop: each cut at the token completing its first </answer>, or kept whole."
    replies = json.loads((Path(__file__).parent / 'artifacts' / 'think_replies.json').read_text())['replies']
    cut = 0
    for r in replies:
        text = tok.decode(r['ids'])
        kept, shortened = truncate_after_answer(r['ids'], tok)
        if CLOSE in text:
            assert CLOSE in tok.decode(kept) and CLOSE not in tok.decode(kept[:-1]) and kept == r['ids'][:len(kept)]
            cut += shortened
        else: assert kept == r['ids'] and not shortened
    assert 0 < cut < len(replies)   # the fixture holds both kinds


GRID = re.compile(r'^[#_OX√PS]+$', re.MULTILINE)

def _room(text: str, settings: EnvSettings) -> str:
    return '\n'.join(GRID.findall(text)[-settings.dim_x:])

@pytest.mark.parametrize('kind', ['true', 'false', 'partly', 'ramble'])
def test_thought_metrics_of_scripted_episodes(tok, kind):
    settings, budget = EnvSettings(search_depth=4), 40
    def reply(context):
        (player,), box = positions(_room(context, settings))['you'], positions(_room(context, settings))['boxes'][0]
        if kind == 'ramble': return ' and so on' * 40
        at = box if kind in ('true', 'partly') else (box[0] + 1, box[1] + 1)
        wrong = f' I am at ({player[0] + 1}, {player[1]}).' if kind == 'partly' else ''   # a statement one row off
        return f' The box is at ({at[0]}, {at[1]}).{wrong} </think> <answer>Up</answer>'
    cfg = RolloutConfig(max_turns=2, max_response_length=budget, think=True, temperature=0.0)
    trajs = rollout(ScriptedEngine(tok, reply), tok, list(range(20000, 20008)), settings, cfg)
    m = thought_metrics(trajs, tok, budget)
    assert set(m) == set(THINK_METRICS)
    if kind == 'ramble':
        assert m['think/budget_hit'] == 1 and m['think/format'] == 0 and m['think/checkable'] == 0 and math.isnan(m['think/grounded'])
        assert math.isnan(m['think/claims_true'])
        assert m['think/tokens'] >= budget - 2 and m['think/mi'] == 0   # every thought opens with the same words
    else:
        assert m['think/budget_hit'] == 0 and m['think/format'] == 1 and m['think/checkable'] == 1
        assert m['think/grounded'] == (1.0 if kind == 'true' else 0.0)
        assert m['think/claims_true'] == {'true': 1.0, 'false': 0.0, 'partly': 0.5}[kind]   # one statement of two, on every turn
        if kind != 'partly': assert m['think/tokens'] == len(tok.encode('The box is at (2, 2).', add_special_tokens=False))   # single digits: one count for every room


def test_real_think_replies_in_a_rollout_are_cut_and_penalised(tok):
    "The untrained model's real replies, replayed as a THINK=True turn: each cut after its first </answer>; only R1's format acts, the rest pay the format penalty."
    replies = json.loads((Path(__file__).parent / 'artifacts' / 'think_replies.json').read_text())['replies']
    texts = iter([tok.decode(r['ids']).split('<|im_end|>')[0] for r in replies])
    cfg = RolloutConfig(max_turns=1, max_response_length=96, think=True, format_penalty=-1.0)
    trajs = rollout(ScriptedEngine(tok, lambda context: next(texts)), tok, [r['seed'] for r in replies], EnvSettings(search_depth=4), cfg)
    for r, t in zip(replies, trajs):
        text, (action,) = '<think>' + tok.decode(r['ids']).split('<|im_end|>')[0], t.actions
        assert CLOSE not in t.responses[0][:-len(CLOSE)]   # nothing after the first answer reached the trajectory
        in_format = re.search(r'<think>.*?</think>\s*<answer>', text.split(CLOSE)[0] + CLOSE, re.S) is not None
        assert (action is not None) == (in_format and split_reply(text)[1] is not None)
        if action is None: assert t.rewards == [-1.0]
    valid = [r['seed'] for r, t in zip(replies, trajs) if t.actions[0] is not None]
    assert valid == [20007]   # 'You are to move up. ...</think><answer>Up</answer>': the one reply in R1's format
    assert [t.seed for t in trajs if t.actions[0] is None and '</answer>' in tok.decode(replies[trajs.index(t)]['ids'])] == [20002, 20004, 20009, 20010, 20016, 20019]


def test_the_thinking_recipe_is_the_main_job_thinking_and_help_shows_it(capsys):
    from ragen_nb.cli import main
    from ragen_nb.config import Config
    think, plain = Config.from_args(['RECIPE=main-job-think']), Config.from_args(['RECIPE=main-job'])
    differ = {f for f in vars(think) if getattr(think, f) != getattr(plain, f)}
    assert differ == {'think', 'max_response_length', 'experiment_name'} and think.think and think.max_response_length == 48
    assert main(['train-cpu', '--help']) == 0
    assert 'main-job-think: RECIPE=main-job EXPERIMENT_NAME=cpu-smollm2-135m-think THINK=True MAX_RESPONSE_LENGTH=48' in capsys.readouterr().out
