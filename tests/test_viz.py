"Tests for ragen_nb.viz: the rollouts file, frames and trajectory figures, the token strip, the widget's content, small images."
import dataclasses, functools, io, json, re, warnings
import numpy as np
import pytest
from PIL import Image
from matplotlib import colormaps
from matplotlib.colors import to_hex
from ragen_nb.models import load_tokenizer
from ragen_nb.tokens import LLM, PROMPT
from ragen_nb.sokoban import EnvSettings, SokobanEnv, room_from_text, render_rgb, solve, ACTIONS
from ragen_nb.rollout import rollout, ScriptedEngine, RolloutConfig
from ragen_nb.viz import (write_rollouts, read_rollouts, read_records, find_room, first_room, rooms_before_after, room_rgb,
                          trajectory_figure, save_trajectory_images, describe_turn, font_families, quiet_glyphs,
                          small_image)
from ragen_nb.data import read_jsonl
from ragen_nb.curves import plot_run, synthetic_metrics
from ragen_nb.widget import token_strip, TrajectoryWidget

SETTINGS = EnvSettings(dim_x=6, dim_y=6, num_boxes=1, max_steps=5, search_depth=30)
ODD = 'not sure $\\frac{ 你好 √'   # an unparseable answer with mathtext, CJK and the box-on-target symbol

@functools.cache
def tokenizer(): return load_tokenizer()

def oracle_then_odd(context: str) -> str:
    "Turns 1 and 3: the solver's first move on the latest room in the context; turn 2: an unparseable reply."
    if context.count('<|im_start|>assistant') == 2: return ODD
    room = find_room(context.rsplit('<|im_start|>user', 1)[1])
    return f'{ACTIONS[solve(*room_from_text(room))[0]]}</answer>'

def long_rooms(k: int) -> list[int]:
    "The first `k` seeds whose rooms need at least 3 moves, so a 3-turn episode is not solved early."
    seeds = (s for s in range(1000) if len(solve(*room_from_text(SokobanEnv(SETTINGS).reset(seed=s)))) >= 3)
    return [next(seeds) for _ in range(k)]

@functools.cache
def _batch():
    tok = tokenizer()
    return rollout(ScriptedEngine(tok, oracle_then_odd), tok, long_rooms(3), SETTINGS, RolloutConfig(max_turns=3, max_response_length=20))

@pytest.fixture
def trajs(): return [dataclasses.replace(t) for t in _batch()]

def test_batch_shape(trajs):
    "The scripted batch the other tests rely on: a valid move, an unparseable reply, then (if not done) a valid move."
    for t in trajs:
        assert t.actions[0] is not None and t.responses[1] == ODD and t.actions[1] is None

# ---------------------------------------------------------------- rollouts file
def test_round_trip_is_exact(trajs, tmp_path):
    rng = np.random.default_rng(0)
    for t in trajs: t.logprobs = [float(-rng.exponential()) * (1 + 1e-12) if s == LLM else 0.0 for s in t.sources]
    trajs[0].logprobs[-1] = 0.1 + 0.2          # a float with no short decimal form
    path = tmp_path/'r.jsonl'
    write_rollouts(trajs, path, step=1)
    write_rollouts(trajs[1:], path, step=2)
    back = read_rollouts(path)
    assert back == trajs + trajs[1:]
    assert back[0].logprobs[-1] == 0.1 + 0.2 and all(type(a) is type(b) for a, b in zip(back[0].actions, trajs[0].actions))
    assert read_rollouts(path, step=2) == trajs[1:]
    assert [r['step'] for r in read_records(path)] == [1, 1, 1, 2, 2]

def test_token_stats_stored_and_checked(trajs, tmp_path):
    stats = {'advantage': [np.linspace(-1, 1, len(t)) for t in trajs]}
    write_rollouts(trajs, tmp_path/'r.jsonl', step=0, token_stats=stats)
    records = read_records(tmp_path/'r.jsonl')
    assert all(np.array_equal(r['token_stats']['advantage'], s) for r, s in zip(records, stats['advantage']))
    with pytest.raises(ValueError, match='one per token'):
        write_rollouts(trajs, tmp_path/'bad.jsonl', token_stats={'value': [[0.0]] * len(trajs)})
    with pytest.raises(ValueError, match='one per trajectory'):
        write_rollouts(trajs, tmp_path/'bad.jsonl', token_stats={'value': [[0.0] * len(trajs[0])]})
    assert not (tmp_path/'bad.jsonl').exists()

@pytest.mark.parametrize('bad,message', [('{"step": 3, "ids": [1, 2', r'r\.jsonl, line 3, is not a JSON record'),
                                         ('{"step": 3}', r'r\.jsonl, record 3: not a trajectory written by write_rollouts'),
                                         ('[1, 2, 3]', r'r\.jsonl, line 3, is not a JSON record')])
def test_corrupt_line_names_file_and_line(trajs, tmp_path, bad, message):
    "A whole line (it ends in a newline) that is damaged is an error naming the file and the line (read_jsonl) or record."
    path = tmp_path/'r.jsonl'
    write_rollouts(trajs[:2], path)
    with path.open('a') as f: f.write(bad + '\n')
    with pytest.raises(ValueError, match=message): read_rollouts(path)
    with pytest.raises(ValueError, match=message): TrajectoryWidget(path)
    with pytest.raises(FileNotFoundError, match=r'missing\.jsonl does not exist'): read_rollouts(tmp_path/'missing.jsonl')

def test_torn_last_line_is_left_out_with_a_warning(trajs, tmp_path):
    "A process killed while appending leaves a last line without its newline: read_jsonl leaves it out and warns; once more lines follow it, it is damage."
    path = tmp_path/'r.jsonl'
    write_rollouts(trajs, path, step=1)
    with path.open('a') as f: f.write('{"step": 2, "ids": [1, 2')
    with pytest.warns(UserWarning, match=r'r\.jsonl, line 4: unfinished last line left out'):
        assert read_rollouts(path) == trajs
    with pytest.warns(UserWarning, match='unfinished last line'): assert len(read_jsonl(path)) == len(trajs)
    with path.open('a') as f: f.write('\n{"step": 5}\n')
    with pytest.raises(ValueError, match=r'r\.jsonl, line 4, is not a JSON record'): read_jsonl(path)

# ---------------------------------------------------------------- frames
def test_find_room():
    text = 'Legend: # wall, _ floor, O target\n#####\n#P_O#\n#_X_#\n#####\nWhich way? ###'
    assert find_room(text) == '#####\n#P_O#\n#_X_#\n#####'
    assert find_room('###\n#P#') is None                      # two lines are not a room
    assert find_room('####\n###\n#P#\n###\n') == '###\n#P#\n###'   # a longer line before does not join the run
    assert find_room('no room here') is None

def test_first_room_is_the_one_kept_and_the_prompt_showed(trajs):
    tok = tokenizer()
    for t in trajs:
        unkept = dataclasses.replace(t, room=None)                 # a rollouts file from before rooms were kept
        assert first_room(t) == t.room == SokobanEnv(SETTINGS).reset(seed=t.seed) == first_room(unkept, tok)
        assert first_room(unkept) is None                          # neither kept nor readable without the tokenizer
    shifted = dataclasses.replace(trajs[0], room=trajs[0].observations[0])   # an episode that began elsewhere than its seed's room
    assert first_room(shifted, tok) == trajs[0].observations[0]

def test_rooms_before_after_chain(trajs):
    for t in trajs:
        pairs = rooms_before_after(t, tokenizer())
        assert len(pairs) == len(t.actions)
        assert all(pairs[k][1] == pairs[k + 1][0] for k in range(len(pairs) - 1))
        assert pairs[0][0] != pairs[0][1]                        # the oracle's move changes the room
        assert pairs[1][0] == pairs[1][1]                        # the unparseable turn leaves it as it was

def test_room_rgb_scale():
    room = SokobanEnv(SETTINGS).reset(seed=4)
    small, big = room_rgb(room), room_rgb(room, 3)
    assert np.array_equal(small, render_rgb(*room_from_text(room)))
    assert big.shape == (small.shape[0] * 3, small.shape[1] * 3, 3) and np.array_equal(big[::3, ::3], small)

# ---------------------------------------------------------------- figures
def test_trajectory_figure_content(trajs):
    t = trajs[0]
    fig = trajectory_figure(t, tokenizer())
    axes = fig.axes
    assert len(axes) == 3 * len(t.actions)
    for k, (before, after) in enumerate(rooms_before_after(t, tokenizer())):
        assert np.array_equal(axes[3 * k].images[0].get_array(), room_rgb(before))
        assert np.array_equal(axes[3 * k + 2].images[0].get_array(), room_rgb(after))
        texts = [x.get_text() for x in axes[3 * k + 1].texts]
        assert texts[0].replace('\n', '') .startswith(t.responses[k][:20].replace('\n', '')) and texts[1] == describe_turn(t, k)
    assert 'none parsed (invalid)' in describe_turn(t, 1) and '(valid)' in describe_turn(t, 0)

def test_figure_draws_dollar_and_cjk_text(trajs):
    "A reply holding `$\\frac{` must not go to mathtext (it would raise); quiet_glyphs leaves no warning at all."
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        with quiet_glyphs(): trajectory_figure(trajs[0], tokenizer()).savefig(buf, format='png')
    assert Image.open(io.BytesIO(buf.getvalue())).size[0] > 0

def test_cjk_warns_without_quiet_glyphs(trajs):
    if len(font_families()) > 1: pytest.skip(f'a CJK font is installed ({font_families()[1:]}), so nothing is missing')
    fig = trajectory_figure(trajs[0], tokenizer())
    with pytest.warns(UserWarning, match='missing from font'): fig.savefig(io.BytesIO(), format='png')

def test_figure_without_first_room(trajs):
    fig = trajectory_figure(dataclasses.replace(trajs[0], room=None))   # no room kept, no tokenizer: the first board is a note
    assert not fig.axes[0].images and 'room unknown' in fig.axes[0].texts[0].get_text()
    assert fig.axes[2].images                                    # the rooms after each turn are still known

def test_save_trajectory_images(trajs, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        paths = save_trajectory_images(trajs, tmp_path/'img', step=12, n=2)
    assert [p.name for p in paths] == [f'step_000012_traj_{i}_seed_{trajs[i].seed}.png' for i in range(2)] + ['step_000012.pdf']
    assert all(Image.open(p).format == 'PNG' for p in paths[:2])
    assert len(re.findall(rb'/Type\s*/Page[^s]', paths[2].read_bytes())) == 2
    assert save_trajectory_images(trajs, tmp_path/'img2', 3, 5, pdf=False, tokenizer=tokenizer())[-1].suffix == '.png'
    assert save_trajectory_images([], tmp_path/'img3', 3, 5) == []

# ---------------------------------------------------------------- token strip
def _spans(strip: str) -> list[str]: return re.findall(r'<span class="tok ([^"]*)"', strip)

def test_token_strip_turn_and_mask(trajs):
    t, pieces = trajs[0], [str(i) for i in trajs[0].ids]
    for turn in range(len(t.actions) + 1):
        spans = _spans(token_strip(t, pieces, turn))
        assert len(spans) == t.turns.count(turn)
        assert sum('tok-LLM' in s for s in spans) == sum(1 for s, k in zip(t.sources, t.turns) if k == turn and s == LLM)
    assert len(_spans(token_strip(t, pieces))) == len(t)
    assert sum('tok-prompt' in s for s in _spans(token_strip(t, pieces))) == t.sources.count(PROMPT)

def test_token_strip_colours_by_stat(trajs):
    t, pieces = trajs[0], [str(i) for i in trajs[0].ids]
    adv = [0.0] * len(t)
    llm = [k for k, s in enumerate(t.sources) if s == LLM]
    adv[llm[0]], adv[llm[1]] = 2.0, -1.0
    strip = token_strip(t, pieces, None, 'advantage', {'advantage': adv})
    styles = re.findall(r'<span class="tok tok-LLM" style="background:(#[0-9a-f]{6})"', strip)
    assert styles[0] == to_hex(colormaps['coolwarm'](1.0)) and styles[1] == to_hex(colormaps['coolwarm'](0.25))
    assert strip.count('class="tok tok-env dim"') == t.sources.count(2)
    lp = token_strip(t, pieces, None, 'logprob')                 # scripted logprobs are 0: probability 1, the green end
    assert re.findall(r'style="background:(#[0-9a-f]{6})"', lp)[-1] == to_hex(colormaps['RdYlGn'](1.0))
    with pytest.raises(ValueError, match='cannot colour by'): token_strip(t, pieces, None, 'value')

def test_token_strip_shows_characters_split_over_tokens(trajs):
    "The rules line says '√ box on target': √ takes two tokens, and each decoded alone is '\ufffd'; the strip shows √ whole."
    tok = tokenizer()
    rule = tok.encode(' √ box on target', add_special_tokens=False)
    assert [tok.decode([i]) for i in rule[:2]] == [' \ufffd', '\ufffd']      # what decoding each token alone shows
    w = TrajectoryWidget(trajs[:1], tok)
    t, pieces = trajs[0], w.pieces[0]
    assert len(pieces) == len(t) and ''.join(pieces) == tok.decode(t.ids)
    assert not any('\ufffd' in p for p in pieces)
    text = lambda strip: re.sub(r'<style>.*?</style>|<[^>]*>', '', strip)
    prompt, odd = token_strip(t, pieces, 0), token_strip(t, pieces, 2)
    assert 'X box, √ box on target' in text(prompt) and '你好 √' in text(odd)
    empty = re.findall(r'<span class="tok [^"]*" title="([^"]*)"></span>', prompt + odd)
    assert empty and all(title.endswith('part of a character that a later token completes') for title in empty)
    assert '\ufffd' not in w.to_html()


# ---------------------------------------------------------------- widget
def test_widget_from_file(trajs, tmp_path):
    path = tmp_path/'r.jsonl'
    write_rollouts(trajs, path, step=1)
    write_rollouts(trajs[:2], path, step=2, token_stats={'value': [[0.5] * len(t) for t in trajs[:2]]})
    w = TrajectoryWidget(path, tokenizer(), step=2)
    assert w.trajs == trajs[:2] and w.modes == ['source', 'logprob', 'value']
    assert TrajectoryWidget(path, tokenizer()).modes == ['source', 'logprob']   # step 1 has no stats
    with pytest.raises(ValueError, match='no trajectories of step 9'): TrajectoryWidget(path, step=9)
    with pytest.raises(ValueError, match='one value per token'): TrajectoryWidget(trajs, token_stats={'value': [[0.0]] * 3})

def test_widget_structure(trajs):
    w = TrajectoryWidget(trajs, tokenizer(), token_stats={'advantage': [[0.0] * len(t) for t in trajs]})
    picker, toggle, views = w.widget.children
    assert len(picker.options) == len(views.children) == len(trajs)
    assert list(toggle.options) == ['source', 'logprob', 'advantage']
    for t, view in zip(trajs, views.children):
        (play, slider), turns = view.children[0].children, view.children[1]
        assert slider.max == play.max == len(t.actions) and len(turns.children) == len(t.actions) + 1
        boards = turns.children[1].children[0].children        # before, after, text
        assert boards[0].children[1].value == w._boards(trajs.index(t), 1)[0][1]
        assert len(turns.children[1].children[1].children) == 3  # one token strip per colouring
    assert f'seed {trajs[1].seed}' in picker.options[1][0]

def test_widget_static_html(trajs):
    w = TrajectoryWidget(trajs, tokenizer())
    page = w.to_html()
    assert page.count('<img ') == 2 * sum(len(t.actions) for t in trajs)
    assert page.count('not sure $\\frac{') == len(trajs) and '你好' in page
    assert page.count('class="tok ') == sum(map(len, trajs))
    bundle = w._repr_mimebundle_()
    assert bundle['text/html'].endswith(w.to_html(max_trajectories=1)) and f'trajectory #0 of {len(trajs)}' in bundle['text/html']
    assert 'application/vnd.jupyter.widget-view+json' in bundle
    assert TrajectoryWidget(trajs[:1], tokenizer())._repr_mimebundle_()['text/html'] == TrajectoryWidget(trajs[:1], tokenizer()).to_html()

def test_widget_shows_a_thinking_turn():
    "THINK=True: the thought and its closing tag are on the page, the turn marked valid only in R1's format."
    tok = tokenizer()
    replies = iter([' the box is below me </think><answer>Down</answer>', ' the box is below me <answer>Down</answer>'])
    played = rollout(ScriptedEngine(tok, lambda context: next(replies)), tok, long_rooms(2), SETTINGS,
                     RolloutConfig(max_turns=1, max_response_length=24, think=True))
    page = TrajectoryWidget(played, tok).to_html()
    assert page.count('the box is below me') == 2 and page.count('&lt;/think&gt;') == 1
    assert [t.actions for t in played] == [[2], [None]]   # the second never closed its thought: no action, the format penalty


def test_widget_without_tokenizer(trajs):
    assert TrajectoryWidget(trajs[:1])._boards(0, 0)[0][1] is not None   # the kept room needs no tokenizer
    w = TrajectoryWidget([dataclasses.replace(trajs[0], room=None)])       # an older file: the prompt holds the first room
    assert w.pieces[0][0] == f'⟨{trajs[0].ids[0]}⟩' and w._boards(0, 0) == [('start', None)]
    page = w.to_html()   # without the tokenizer turn 1 has no 'before' room; every later board is known
    assert page.count('before: room unknown') == 1 and page.count('<img ') == 2 * len(trajs[0].actions) - 1

# ---------------------------------------------------------------- small images
def test_small_image_keeps_the_figure_in_fewer_colours():
    fig = plot_run(synthetic_metrics())
    plain = io.BytesIO(); fig.savefig(plain, format='png', dpi=60, bbox_inches='tight')
    small = Image.open(io.BytesIO(small_image(fig, dpi=60, colours=64).data))
    full = Image.open(plain).convert('RGB')
    assert small.size == full.size and len(small.getcolors(256)) <= 64
    assert len(small_image(fig, dpi=60).data) < len(plain.getvalue()) / 2
    diff = np.abs(np.asarray(small.convert('RGB'), float) - np.asarray(full, float)).mean()
    assert diff < 3, diff          # mean error per channel, of 255: the same picture
