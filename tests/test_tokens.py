"Tests for ragen_nb.tokens: the Trajectory's bookkeeping, its spans, exact decoding of env text, and the HTML picture."
import functools, itertools, re
from html.parser import HTMLParser
import pytest
from hypothesis import given, settings, strategies as st
from ragen_nb.models import load_tokenizer
from ragen_nb.tokens import PROMPT, LLM, ENV, SOURCE_NAMES, COLOURS, Trajectory, show_tokens, token_pieces
from ragen_nb.sokoban import SokobanEnv, EnvSettings
from ragen_nb.data import render_prompt, first_message, followup_text, observation_message

SETTINGS = EnvSettings(dim_x=6, dim_y=6, num_boxes=1, max_steps=5, search_depth=30)

@functools.cache
def tokenizer(): return load_tokenizer()

def encode(tok, text): return tok.encode(text, add_special_tokens=False)

def hand_episode(tok, seed, answers):
    "A trajectory written as the rollout writes one: each answer (cut after `</answer>`) as LLM tokens, then the eos that closes the turn and the env's reply as env tokens."
    env = SokobanEnv(SETTINGS)
    obs0 = env.reset(seed=seed)
    traj = Trajectory(seed=seed).add(encode(tok, render_prompt(tok, obs0)), PROMPT, 0)
    for turn, (answer, action) in enumerate(answers, start=1):
        ids = encode(tok, answer)
        traj.add(ids, LLM, turn, logprobs=[-0.25 * (k + 1) for k in range(len(ids))])
        traj.add([tok.eos_token_id], ENV, turn)
        obs, reward, done, info = env.step(action)
        traj.responses.append(answer); traj.actions.append(action); traj.rewards.append(reward)
        traj.dones.append(done); traj.observations.append(obs); traj.success = info['success']
        if done: break
        traj.add(encode(tok, followup_text(tok, observation_message(obs, reward))), ENV, turn)
    return traj, obs0

# Chunks appended in a valid order: the prompt, then per turn an LLM chunk and an env chunk, any of them possibly split
# into several `add` calls.
chunks = st.lists(st.tuples(st.sampled_from([LLM, ENV]), st.lists(st.integers(0, 49151), min_size=0, max_size=5),
                            st.booleans()), max_size=12)

@settings(max_examples=300, deadline=None)
@given(prompt=st.lists(st.integers(0, 49151), max_size=6), chunks=chunks)
def test_spans_match_groupby_and_concatenate_to_ids(prompt, chunks):
    traj, turn = Trajectory().add(prompt, PROMPT, 0), 1
    for source, ids, next_turn in chunks:
        turn += next_turn
        traj.add(ids, source, turn, logprobs=[-1.0] * len(ids) if source == LLM else None)
    spans = traj.spans()
    assert [i for _, _, ids in spans for i in ids] == traj.ids
    reference = [(s, t, [i for i, _, _ in group]) for (s, t), group in
                 itertools.groupby(zip(traj.ids, traj.sources, traj.turns), key=lambda x: (x[1], x[2]))]
    assert spans == reference
    assert len(traj) == len(traj.sources) == len(traj.turns) == len(traj.logprobs)
    assert all(lp == 0.0 for lp, s in zip(traj.logprobs, traj.sources) if s != LLM)

def test_add_refuses_what_would_corrupt_a_mask():
    with pytest.raises(ValueError, match='source must be'): Trajectory().add([1], 3, 1)
    with pytest.raises(ValueError, match='turn 0'): Trajectory().add([1], PROMPT, 1)
    with pytest.raises(ValueError, match='turn 0'): Trajectory().add([1], LLM, 0)
    with pytest.raises(ValueError, match='only LLM tokens'): Trajectory().add([1], ENV, 1, logprobs=[0.5])
    with pytest.raises(ValueError, match='one logprob per id'): Trajectory().add([1, 2], LLM, 1, logprobs=[0.5])
    with pytest.raises(ValueError, match='in order'): Trajectory().add([1], LLM, 2).add([2], ENV, 1)
    traj = Trajectory().add([7, 8], LLM, 1, logprobs=[-1, -2]).add([9], ENV, 1)
    assert (traj.ids, traj.sources, traj.turns, traj.logprobs) == ([7, 8, 9], [LLM, LLM, ENV], [1, 1, 1], [-1.0, -2.0, 0.0])

def test_total_reward_and_repr():
    traj = Trajectory(seed=5, rewards=[-0.1, -0.1, 10.9], actions=[1, None, 2])
    assert traj.total_reward == pytest.approx(10.7)
    assert 'seed=5' in repr(traj) and 'actions=[1, None, 2]' in repr(traj)

@pytest.mark.parametrize('seed,answers', [(3, [('Left</answer>', 3), ('Up</answer>', 1)]),
                                          (0, [('Down</answer>', 2), ('Up</answer>', 1), ('Right</answer>', 4)])])
def test_env_spans_decode_to_the_env_text_and_ids_to_the_chat(tok, seed, answers):
    traj, obs0 = hand_episode(tok, seed, answers)
    env_spans = [(t, ids) for s, t, ids in traj.spans() if s == ENV]
    assert env_spans, 'the episode should have at least one env reply'
    for turn, ids in env_spans:  # the eos closing the turn, then the template's user turn around the feedback, then "<answer>"
        done = traj.dones[turn - 1]
        assert tok.decode(ids) == tok.eos_token + ('' if done else followup_text(tok, observation_message(traj.observations[turn - 1], traj.rewards[turn - 1])))
    # independent check: the chat template, rendering the whole conversation at once, gives the decoded ids
    chat = [{'role': 'user', 'content': first_message(obs0)}]
    for response, obs, reward in zip(traj.responses, traj.observations, traj.rewards):
        chat += [{'role': 'assistant', 'content': '<answer>' + response},
                 {'role': 'user', 'content': observation_message(obs, reward)}]
    if traj.dones[-1]:           # ended on the eos that closed the last turn: the template adds a newline after it
        assert tok.decode(traj.ids) + '\n' == tok.apply_chat_template(chat[:-1], tokenize=False)
    else:                        # ended on the env's reply: the template's generation prompt, then the opening
        assert tok.decode(traj.ids) == tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) + '<answer>'

@settings(max_examples=200, deadline=None)
@given(st.text(alphabet='#_OX√PS\n', max_size=60), st.floats(-2, 11, allow_nan=False))
def test_env_text_survives_encode_decode(text, reward):
    "Exact decoding of env spans rests on this: any room text, any reward, survives encode then decode."
    tok = tokenizer()
    reply = followup_text(tok, observation_message(text, round(reward, 1)))
    assert tok.decode(encode(tok, reply)) == reply

class Spans(HTMLParser):
    "Collects (style, title, text) of every <span>."
    def __init__(self):
        super().__init__(); self.spans, self.open = [], None
    def handle_starttag(self, tag, attrs):
        if tag == 'span': self.open = [dict(attrs).get('style', ''), dict(attrs).get('title', ''), '']
    def handle_data(self, data):
        if self.open is not None: self.open[2] += data
    def handle_endtag(self, tag):
        if tag == 'span' and self.open is not None: self.spans.append(tuple(self.open)); self.open = None

def test_show_tokens_is_one_coloured_span_per_token_with_id_and_turn(tok):
    traj, _ = hand_episode(tok, 3, [('Left</answer>', 3), ('Up</answer>', 1)])
    parser = Spans(); parser.feed(show_tokens(traj, tok).data)
    legend, tokens = parser.spans[:3], parser.spans[3:]
    assert [text for _, _, text in legend] == list(SOURCE_NAMES)
    assert len(tokens) == len(traj)
    for (style, title, text), i, s, t in zip(tokens, traj.ids, traj.sources, traj.turns):
        assert f'background:{COLOURS[s]}' in style
        assert re.match(rf'id {i} · turn {t} · {SOURCE_NAMES[s]}', title)
    for (style, title, text), piece in zip(tokens, token_pieces(traj.ids, tok)):
        assert text == piece.replace('\n', '↵\n')  # escaped in the HTML, unescaped by the parser
        assert title.endswith('part of a character that a later token completes') == (piece == '')
    assert COLOURS[PROMPT] != COLOURS[LLM] != COLOURS[ENV] != COLOURS[PROMPT]

@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_token_pieces_join_to_the_text_and_hold_whole_characters(text):
    "Any text that decodes to valid text: one piece per token, joining to the decoded text, and no replacement character."
    tok = tokenizer()
    ids = encode(tok, text)
    pieces = token_pieces(ids, tok)
    assert len(pieces) == len(ids)
    if '\ufffd' not in tok.decode(ids):   # ids that decode to valid text (the tokenizer maps some unassigned characters to invalid bytes)
        assert ''.join(pieces) == tok.decode(ids) and not any('\ufffd' in p for p in pieces)

def test_token_pieces_of_the_box_on_target_symbol(tok):
    "√ is three UTF-8 bytes in two tokens: decoded alone each is a replacement character; as pieces, √ sits on the second."
    ids = encode(tok, 'X box, √ box on target')
    assert [tok.decode([i]) for i in ids].count('\ufffd') == 1 and ' \ufffd' in [tok.decode([i]) for i in ids]
    assert token_pieces(ids, tok) == ['X', ' box', ',', '', ' √', ' box', ' on', ' target']
