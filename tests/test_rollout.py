"Tests for ragen_nb.rollout: action parsing (fuzzed), token-level truncation, the HF engine, and the multi-turn loop."
import collections, functools, json, random, re, subprocess, sys
import pytest, torch
from hypothesis import given, settings, strategies as st
from ragen_nb.models import load_tokenizer, load_model, tiny_model
from ragen_nb.tokens import LLM, ENV
from ragen_nb.sokoban import SokobanEnv, EnvSettings, ACTIONS, room_from_text, solve
from ragen_nb.data import coordinates_line, render_prompt, first_message, followup_text, observation_message, question
from ragen_nb.rollout import (parse_action, truncate_after_answer, HFEngine, ScriptedEngine, RolloutConfig, rollout,
                              env_reply, CUT_MARKER, CLOSE)
from ragen_nb.engines import SharedPrefixEngine, common_prefix_length

# The old HFEngine shared the prompt start by default; now HFEngine is plain left padding and SharedPrefixEngine (14)
# shares it. Every engine test runs on both: they must give the same answers.
ENGINES = pytest.mark.parametrize('Engine', [HFEngine, SharedPrefixEngine], ids=['plain', 'shared'])

SETTINGS = EnvSettings(dim_x=6, dim_y=6, num_boxes=1, max_steps=5, search_depth=30)

@functools.cache
def tokenizer(): return load_tokenizer()

@functools.cache
def tiny(): return tiny_model(tokenizer())

@functools.cache
def smollm(): return load_model()

def encode(text): return tokenizer().encode(text, add_special_tokens=False)

# ---------------------------------------------------------------- parse_action
WS = ' \t\n\r\x0b\x0c'  # the ASCII whitespace that the parser strips
NAMES = {'up': 1, 'down': 2, 'left': 3, 'right': 4}

def reference_parse(text):
    "parse_action written with plain string operations, no regular expressions."
    start = text.find('<answer>')
    if start < 0: return None
    end = text.find('</answer>', start + len('<answer>'))
    if end < 0: return None
    inner = text[start + len('<answer>'):end].strip(WS)
    if inner.isascii() and inner.lower() in NAMES: return NAMES[inner.lower()]
    if not inner or inner[0] not in '1234': return None
    number, rest = int(inner[0]), inner[1:].lstrip(WS)
    if rest == '': return number
    if rest[0] != '(' or rest[-1] != ')': return None
    name = rest[1:-1].strip(WS)
    return number if name.isascii() and name.isalpha() and NAMES.get(name.lower()) == number else None

FRAGMENTS = ['<answer>', '</answer>', '<answer', 'answer>', '</', '<', '>', 'Up', 'up', 'UP', 'Down', 'left', 'RIGHT',
             '1', '2', '4', '5', '0', '(', ')', ' (Up)', '(Down)', ' ', '\n', '\t', '\u00a0', '１', 'Ｕｐ', 'İ', 'x',
             '<think>', '</think>', ',', '.', 'upp', '√']

@settings(max_examples=1000, deadline=None)
@given(st.text())
def test_parse_action_arbitrary_unicode(text):
    got = parse_action(text)
    assert got in (None, 1, 2, 3, 4) and got == reference_parse(text)
    assert parse_action('<answer>' + text + '</answer>') == reference_parse('<answer>' + text + '</answer>')

@settings(max_examples=1000, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=12).map(''.join))
def test_parse_action_tag_soup(text):
    "Unclosed, nested, repeated and misplaced tags, unicode look-alikes: never raises, agrees with the reference."
    assert parse_action(text) == reference_parse(text)

@settings(max_examples=500, deadline=None)
@given(action=st.sampled_from([1, 2, 3, 4]), form=st.sampled_from(['name', 'number', 'both']),
       case=st.sampled_from([str.lower, str.upper, str.title]), pad=st.text(alphabet=WS, max_size=3),
       before=st.text().filter(lambda s: '<answer>' not in s), after=st.text())
def test_parse_action_well_formed(action, form, case, pad, before, after):
    name = case(ACTIONS[action])
    inner = {'name': name, 'number': str(action), 'both': f'{action}{pad}({pad}{name}{pad})'}[form]
    assert parse_action(f'{before}<answer>{pad}{inner}{pad}</answer>{after}') == action

def fuzz_text(rng: random.Random) -> str:
    "One answer-like string: a well-formed answer (random case, padding, number/name pairs that may disagree), tag soup, or unicode noise, with text around it."
    noise = lambda: ''.join(chr(rng.choice([rng.randint(32, 126), rng.randint(0, 0x10FFFF)])) for _ in range(rng.randint(0, 6)))
    pad = lambda: ''.join(rng.choice(WS + '\u00a0\u2003\u3000\u200b') for _ in range(rng.choice([0, 0, 1, 2])))
    kind = rng.random()
    if kind < 0.5:
        action = rng.randint(1, 4)
        number = action if rng.random() < 0.7 else rng.randint(0, 5)
        name = list(NAMES)[action - 1] if rng.random() < 0.7 else rng.choice(list(NAMES) + ['upp', 'Uр', 'Ｕｐ', 'ﬁve', 'rİght', ''])
        name = rng.choice([str.lower, str.upper, str.title])(name)
        inner = rng.choice([name, str(number), f'{number}{pad()}({pad()}{name}{pad()})', f'{number}{name}'])
        opening, closing = rng.choice(['<answer>'] * 4 + ['<answer', '<Answer>']), rng.choice(['</answer>'] * 4 + ['</answer', ''])
        return noise().replace('<', '') + opening + pad() + inner + pad() + closing + noise()
    if kind < 0.8: return ''.join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 12)))
    return noise() + rng.choice(['', '<answer>', '</answer>']) + noise() + rng.choice(['', '</answer>']) + noise()

def test_parse_action_seeded_fuzz():
    "20,000 seeded cases against the reference; every outcome must occur often, so the fuzz is not all misses."
    rng, outcomes = random.Random(20261130), collections.Counter()
    for _ in range(20_000):
        text = fuzz_text(rng)
        got = parse_action(text)
        assert got == reference_parse(text), text
        outcomes[got] += 1
    print(f'parse_action seeded fuzz: {sum(outcomes.values())} cases, outcomes {dict(outcomes)}')
    assert sum(outcomes.values()) == 20_000 and all(outcomes[a] >= 200 for a in (1, 2, 3, 4)) and outcomes[None] >= 2_000

def test_parse_action_cases():
    assert parse_action('<answer>1 (Down)</answer>') is None      # number and name disagree
    assert parse_action('<answer><answer>Up</answer></answer>') is None  # nested: the answer is "<answer>Up"
    assert parse_action('<answer>Up') is None and parse_action('Up</answer>') is None
    assert parse_action('<answer>１</answer>') is None            # full-width digit
    assert parse_action(None) is None and parse_action(b'<answer>Up</answer>') is None
    assert parse_action('<answer>Up</answer><answer>Down</answer>') == 1  # only the first answer counts

# ---------------------------------------------------------------- truncate_after_answer
def reference_cut(ids, tok):
    "The first k (a plain loop) whose prefix decodes to text holding </answer>, else None."
    return next((k for k in range(len(ids) + 1) if CLOSE in tok.decode(ids[:k])), None)

PIECES = ['Up', '</', 'answer', '>', '>.', '</answer>', '</answer>.', ' ', '\n', '√', 'answer>', '<answer>', '<|im_end|>']

@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(PIECES).map(encode), st.lists(st.integers(0, 49151), max_size=2)), max_size=10))
def test_truncate_keeps_the_shortest_prefix_holding_the_answer(parts):
    tok = tokenizer()
    ids = [i for part in parts for i in part]
    kept, was_cut = truncate_after_answer(ids, tok)
    k = reference_cut(ids, tok)
    assert kept == ids[:k if k is not None else len(ids)]       # a prefix of the sampled ids, never re-tokenized
    assert was_cut == (len(kept) < len(ids))

def test_truncate_split_and_merged_tokens(tok):
    split = encode('Up</answer>\n<|im_start|>user\nThe room')
    assert [tok.decode([i]) for i in split[:4]] == ['Up', '</', 'answer', '>']    # the tag spans three tokens
    assert truncate_after_answer(split, tok) == (split[:4], True)
    merged = encode('Up</answer>. Then Left')
    assert tok.decode(merged[3:4]) == '>.'                                          # the tag ends inside a token
    assert truncate_after_answer(merged, tok) == (merged[:4], True)
    assert truncate_after_answer(merged[:4], tok) == (merged[:4], False)
    assert truncate_after_answer(encode('no answer here'), tok) == (encode('no answer here'), False)

# ---------------------------------------------------------------- HFEngine
PROMPTS = ['The room:\n######\n#P_O#', 'Hi', '<answer>']

def manual_logprobs(model, prompt, ids, temperature):
    "log_softmax(logits / T) of each sampled id, from one plain forward pass over prompt + ids."
    logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(ids)[:, None])[:, 0]

@ENGINES
@pytest.mark.parametrize('temperature,top_p', [(1.0, 1.0), (0.7, 0.9), (1.5, 0.5)])
def test_engine_logprobs_equal_a_manual_forward(tok, temperature, top_p, Engine):
    model, prompts = tiny(), [encode(p) for p in PROMPTS]
    outs = Engine(model, tok).generate(prompts, 10, temperature, top_p, seed=1)
    for prompt, (ids, lps) in zip(prompts, outs):
        assert len(ids) == len(lps) == 10
        torch.testing.assert_close(torch.tensor(lps), manual_logprobs(model, prompt, ids, temperature), atol=1e-4, rtol=0)

@ENGINES
def test_engine_seed_reproducible_and_leaves_global_rng_alone(tok, Engine):
    engine, prompts = Engine(tiny(), tok), [encode(p) for p in PROMPTS]
    state = torch.get_rng_state()
    a = engine.generate(prompts, 6, seed=5)
    assert torch.equal(state, torch.get_rng_state())
    assert engine.generate(prompts, 6, seed=5) == a and engine.generate(prompts, 6, seed=6) != a
    torch.manual_seed(5); b = engine.generate(prompts, 6)           # no seed: the global generator, which moves on
    torch.manual_seed(5); assert engine.generate(prompts, 6) == b and engine.generate(prompts, 6) != b

@ENGINES
def test_engine_greedy_does_not_depend_on_the_batch(tok, Engine):
    engine, prompts = Engine(tiny(), tok), [encode(p) for p in PROMPTS]
    batched = engine.generate(prompts, 6, temperature=0)
    for prompt, (ids, lps) in zip(prompts, batched):
        alone_ids, alone_lps = engine.generate([prompt], 6, temperature=0)[0]
        assert ids == alone_ids
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(alone_lps), atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(lps), manual_logprobs(tiny(), prompt, ids, 1.0), atol=1e-4, rtol=0)

def test_engine_shared_prefix_gives_the_plain_answers(tok):
    "Running the shared prompt start once (SharedPrefixEngine) against plain left padding (HFEngine): a LoRA model with live adapters, real Sokoban contexts of two turns, greedy and seeded sampling, and a row that is another's start."
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    model = get_peft_model(tiny_model(tok), LoraConfig(r=4, target_modules='all-linear', init_lora_weights=False)).eval()
    cfg = RolloutConfig(max_turns=2, max_response_length=8)
    rooms = [3, 4, 3, 5]
    shared, plain = SharedPrefixEngine(model, tok), HFEngine(model, tok)
    assert shared.name == plain.name == 'hf' and ScriptedEngine(tok, str).name == 'scripted'
    with pytest.raises(TypeError): HFEngine(model, tok, share_prefix=False)   # plain now; sharing is SharedPrefixEngine's
    for e in (shared, plain):   # both sample from the model itself: no weights of their own to free or refresh
        e.before_update(); assert e.after_update(model) == 0.0 and not any(hasattr(e, m) for m in ('sleep', 'wake', 'sync'))
    a, b = (rollout(e, tok, rooms, SETTINGS, cfg, seed=2) for e in (shared, plain))
    assert [t.ids for t in a] == [t.ids for t in b] and max(map(len, a)) > min(map(len, a))
    torch.testing.assert_close(torch.tensor([l for t in a for l in t.logprobs]), torch.tensor([l for t in b for l in t.logprobs]),
                               atol=1e-5, rtol=0)
    contexts = [t.ids for t in a] + [a[0].ids[:100]]
    assert common_prefix_length(contexts) > 50   # the shared path runs: the rooms' prompts share their start
    for kw in (dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=4)):
        x, y = shared.generate(contexts, 6, stop_at_answer=False, **kw), plain.generate(contexts, 6, stop_at_answer=False, **kw)
        assert [ids for ids, _ in x] == [ids for ids, _ in y]
        torch.testing.assert_close(torch.tensor([l for _, lps in x for l in lps]), torch.tensor([l for _, lps in y for l in lps]),
                                   atol=1e-5, rtol=0)

@ENGINES
def test_engine_top_p_samples_inside_the_nucleus(tok, Engine):
    "One token from 300 copies of a prompt: with top_p=0.5 every sample lies in the nucleus; with top_p=1 many do not."
    model, prompt = tiny(), encode('The room:')
    probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].float() / 0.8, dim=-1)
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]   # mass of the tokens more likely than each token
    nucleus = set(order[before < 0.5].tolist())
    def firsts(top_p): return [ids[0] for ids, _ in Engine(model, tok).generate([prompt] * 300, 1, 0.8, top_p, seed=0)]
    assert set(firsts(0.5)) <= nucleus
    assert sum(i not in nucleus for i in firsts(1.0)) > 50

@ENGINES
def test_engine_stops_at_eos_with_pad_different_from_eos(tok, Engine):
    "Make the tiny model's greedy token the eos: each row stops right after it, and no padding leaks into the ids."
    model, prompts = tiny(), [encode(p) for p in PROMPTS]
    greedy = Engine(model, tok).generate(prompts, 6, temperature=0)
    first = greedy[0][0][0]
    other = load_tokenizer(); other.eos_token = tok.convert_ids_to_tokens(first)
    assert other.eos_token_id == first != other.pad_token_id
    for (ids, lps), (full, _) in zip(Engine(model, other).generate(prompts, 6, temperature=0), greedy):
        k = full.index(first) + 1 if first in full else len(full)
        assert ids == full[:k] and len(lps) == len(ids)

@ENGINES
@pytest.mark.slow
def test_engine_on_smollm_stops_where_the_cut_would_be(tok, Engine):
    "SmolLM2, 8 rows: with the stop off some run past their answer; with it on, every row is exactly its cut ids."
    model, env = smollm(), SokobanEnv(SETTINGS)
    prompt = encode(render_prompt(tok, env.reset(seed=3)))
    engine = Engine(model, tok)
    ran_on = engine.generate([prompt] * 8, 24, seed=0, stop_at_answer=False)
    cuts = [truncate_after_answer(ids, tok) for ids, _ in ran_on]
    assert any(was_cut for _, was_cut in cuts), 'some sample should run past its answer; if the model or prompt changed, pick another seed'
    stopped = engine.generate([prompt] * 8, 24, seed=0)
    for (ids, lps), (kept, _), (_, ran_lps) in zip(stopped, cuts, ran_on):
        assert ids == kept and lps == pytest.approx(ran_lps[:len(kept)], abs=1e-5)
        assert len(lps) == len(ids) <= 24
        assert tok.eos_token_id not in ids[:-1]                       # padding (= eos here) never leaks into a row
        answered = CLOSE in tok.decode(ids)
        assert ids[-1] == tok.eos_token_id or answered or len(ids) == 24
        if answered: assert CLOSE not in tok.decode(ids[:-1])         # stopped on the token that completes it
    assert len({len(ids) for ids, _ in stopped}) > 1, 'rows should end at different lengths'
    ids, lps = stopped[0]
    torch.testing.assert_close(torch.tensor(lps), manual_logprobs(model, prompt, ids, 1.0), atol=1e-3, rtol=0)

# ---------------------------------------------------------------- rollout
def solver(context):
    "A perfect player: solve the last room in the context, answer its first move, then invent a next turn."
    room = re.findall(r'(?:^[#_OX√PS]+\n)+', context, re.MULTILINE)[-1].strip()
    return f'{ACTIONS[solve(*room_from_text(room))[0]]}</answer>\n<|im_start|>user\n######\n#_'

def check_trajectory(traj, tok, cfg):
    "What must hold for every trajectory: sources, spans, limits, env text, and the chat it decodes to."
    assert [i for _, _, ids in traj.spans() for i in ids] == traj.ids
    n = len(traj.actions)
    assert len(traj.responses) == len(traj.rewards) == len(traj.dones) == len(traj.observations) == n >= 1
    assert traj.turns.count(0) <= cfg.max_start_length and len(traj) <= cfg.max_context_length and n <= cfg.max_turns
    eos, opening, env = tok.eos_token_id, '<answer>', SokobanEnv(SETTINGS)
    obs0 = env.reset(seed=traj.seed)
    chat = [{'role': 'user', 'content': first_message(obs0, coordinates=cfg.coordinates)}]
    for turn in range(1, n + 1):
        llm = [i for i, s, t in zip(traj.ids, traj.sources, traj.turns) if s == LLM and t == turn]
        env_ids = [i for i, s, t in zip(traj.ids, traj.sources, traj.turns) if s == ENV and t == turn]
        assert len(llm) <= cfg.max_response_length
        assert CLOSE not in tok.decode(llm[:-1])                       # cut right after the first answer
        closed_by_model = bool(llm) and llm[-1] == eos
        assert eos not in llm[:-1]
        assert tok.decode(llm[:-1] if closed_by_model else llm) == traj.responses[turn - 1]
        action = traj.actions[turn - 1]
        assert action == parse_action(opening + traj.responses[turn - 1])
        if action is None: assert traj.rewards[turn - 1] == cfg.format_penalty
        # the env tokens of a turn: the eos that closes the model's turn (if the model did not write it), then the reply
        closing = [] if closed_by_model else [eos]
        assert env_ids[:len(closing)] == closing
        reply = env_ids[len(closing):]
        message = observation_message(traj.observations[turn - 1], traj.rewards[turn - 1], valid=action is not None,
                                      coordinates=cfg.coordinates)
        assert len(reply) <= cfg.max_obs_length and (turn < n or not reply)
        if reply and CUT_MARKER not in tok.decode(reply): assert tok.decode(reply) == followup_text(tok, message)
        chat += [{'role': 'assistant', 'content': opening + traj.responses[turn - 1]}, {'role': 'user', 'content': message}]
    # independent check: the template renders the same conversation in one go (when no reply was cut)
    if CUT_MARKER not in tok.decode(traj.ids):
        assert tok.decode(traj.ids) + '\n' == tok.apply_chat_template(chat[:-1], tokenize=False)
    assert traj.ids[-1] == eos

def test_rollout_solver_solves_and_finished_envs_leave_the_batch(tok):
    sizes = []
    class Spy(ScriptedEngine):
        def generate(self, prompts, *args, **kwargs):
            sizes.append(len(prompts)); return super().generate(prompts, *args, **kwargs)
    trajs = rollout(Spy(tok, solver), tok, [1, 0, 5], SETTINGS)
    assert [len(solve(*room_from_text(SokobanEnv(SETTINGS).reset(seed=s)))) for s in (1, 0, 5)] == [2, 4, 4]
    assert sizes == [3, 3, 2, 2]
    assert [t.success for t in trajs] == [True] * 3 and [t.dones[-1] for t in trajs] == [True] * 3
    assert [t.total_reward for t in trajs] == pytest.approx([10.8, 10.6, 10.6])
    for t in trajs: check_trajectory(t, tok, RolloutConfig())

def test_rollout_only_the_parsed_action_reaches_the_env(tok, monkeypatch):
    seen = []
    real_step = SokobanEnv.step
    def spy(self, action):
        seen.append(action); return real_step(self, action)
    monkeypatch.setattr(SokobanEnv, 'step', spy)
    replies = iter(['1 (Left)</answer>', ' left </answer> Up Up', 'Upwards</answer>', '2</answer><|im_end|>',
                    'Right', '4 (Right)</answer>'])
    traj = rollout(ScriptedEngine(tok, lambda ctx: next(replies)), tok, [0], SETTINGS, RolloutConfig(max_turns=6))[0]
    assert traj.actions == [None, 3, None, 2, None, 4]
    assert seen == [3, 2, 4]
    check_trajectory(traj, tok, RolloutConfig(max_turns=6))

@pytest.mark.parametrize('mode', ['noop', 'stop'])
def test_rollout_invalid_answer(tok, mode):
    cfg = RolloutConfig(invalid_action=mode, format_penalty=-0.25, max_turns=3)
    traj = rollout(ScriptedEngine(tok, lambda ctx: 'I would push the box</answer>'), tok, [3], SETTINGS, cfg)[0]
    n = 3 if mode == 'noop' else 1
    assert traj.actions == [None] * n and traj.rewards == [-0.25] * n
    assert traj.dones == ([False] * 3 if mode == 'noop' else [True])
    obs0 = SokobanEnv(SETTINGS).reset(seed=3)
    assert traj.observations == [obs0] * n                        # no-op: the env was not stepped
    if mode == 'noop': assert 'not one of Up, Down, Left, Right' in tok.decode(traj.ids)
    check_trajectory(traj, tok, cfg)

def test_rollout_model_eos_is_llm_and_added_eos_is_env(tok):
    replies = iter(['Left</answer><|im_end|>', 'hmm<|im_end|>Up</answer>', 'Up</answer>'])
    traj = rollout(ScriptedEngine(tok, lambda ctx: next(replies)), tok, [3], SETTINGS, RolloutConfig(max_turns=3))[0]
    # the first eos of each turn closes the model's turn: cut after the answer, the rollout's (env); the model's own
    # eos, which ends the turn even though an answer follows it (LLM); cut after the answer again (env)
    closing = [next(s for i, s, t in zip(traj.ids, traj.sources, traj.turns) if t == turn and i == tok.eos_token_id)
               for turn in (1, 2, 3)]
    assert closing == [ENV, LLM, ENV] and traj.actions == [3, None, 1] and traj.success
    check_trajectory(traj, tok, RolloutConfig(max_turns=3))

def test_rollout_with_coordinates_poses_every_room_with_its_positions(tok):
    contexts = []
    def reply(context): contexts.append(context); return 'Right</answer>'
    cfg = RolloutConfig(max_turns=3, coordinates=True, max_obs_length=160)
    traj = rollout(ScriptedEngine(tok, reply), tok, [0], SETTINGS, cfg)[0]
    rooms = [SokobanEnv(SETTINGS).reset(seed=0)] + traj.observations[:-1]
    assert rooms[0] != rooms[1] and len(contexts) == 3                  # seed 0: the first Right walks, the next ones hit a wall
    for turn, (context, room) in enumerate(zip(contexts, rooms), start=1):
        assert context.count('Positions as') == turn                    # one line per user turn so far
        assert context.endswith(f'{room}\n{coordinates_line(room)}\n{question()}<|im_end|>\n<|im_start|>assistant\n<answer>')
    check_trajectory(traj, tok, cfg)

def test_rollout_limits(tok):
    wander = ScriptedEngine(tok, lambda ctx: 'Left</answer>')          # seed 3: a wall on the left; nothing changes
    t = rollout(wander, tok, [3], SETTINGS, RolloutConfig(max_turns=4))[0]
    assert t.actions == [3] * 4 and t.dones == [False] * 4              # cut by max_turns: not done
    prompt_len, turn_len = t.turns.count(0), t.turns.count(1)
    budget = prompt_len + turn_len + 10 + 1
    for extra, turns in [(0, 2), (-1, 1), (turn_len - 1, 2), (turn_len, 3)]:
        cfg = RolloutConfig(max_start_length=prompt_len, max_response_length=10, max_context_length=budget + extra)
        t = rollout(wander, tok, [3], SETTINGS, cfg)[0]
        assert len(t.actions) == turns and len(t) <= cfg.max_context_length
        check_trajectory(t, tok, cfg)
    with pytest.raises(ValueError, match='max_start_length'):
        rollout(wander, tok, [3], SETTINGS, RolloutConfig(max_start_length=prompt_len - 1))
    with pytest.raises(ValueError, match='raise max_obs_length'):
        rollout(wander, tok, [3], SETTINGS, RolloutConfig(max_obs_length=5))
    ramble = ScriptedEngine(tok, lambda ctx: 'thinking ' * 100)
    t = rollout(ramble, tok, [3], SETTINGS, RolloutConfig(max_turns=2, max_response_length=7))[0]
    assert [t.sources[t.turns.index(k):].count(LLM) for k in (1, 2)] == [14, 7] and t.actions == [None, None]

def test_env_reply_cut_is_marked_and_fits(tok):
    message = observation_message(SokobanEnv(SETTINGS).reset(seed=3), -0.1, valid=False)
    full = env_reply(tok, message, RolloutConfig())
    assert tok.decode(full) == followup_text(tok, message) and CUT_MARKER not in tok.decode(full)
    for limit in range(len(full) - 1, 22, -7):
        ids = env_reply(tok, message, RolloutConfig(max_obs_length=limit))
        text = tok.decode(ids)
        assert len(ids) <= limit and CUT_MARKER in text and text.endswith('<|im_start|>assistant\n<answer>')
        start = text.index('user\n') + len('user\n')
        kept = text[start:text.index(CUT_MARKER)]
        assert message.startswith(kept) and followup_text(tok, kept + CUT_MARKER) == text
        assert len(encode(followup_text(tok, message[:len(kept) + 1] + CUT_MARKER))) > limit   # cut no more than needed

@settings(max_examples=40, deadline=None)
@given(response=st.integers(1, 30), obs=st.integers(25, 80), extra=st.integers(0, 200), turns=st.integers(1, 5),
       reply=st.sampled_from(['Left</answer>', 'Up</answer> and then', 'word ' * 40, '3</answer><|im_end|>', '']))
def test_rollout_never_breaks_a_limit(response, obs, extra, turns, reply):
    tok = tokenizer()
    cfg = RolloutConfig(max_turns=turns, max_start_length=200, max_response_length=response, max_obs_length=obs,
                        max_context_length=200 + response + 1 + extra)
    for traj in rollout(ScriptedEngine(tok, lambda ctx: reply), tok, [3, 0], SETTINGS, cfg):
        assert len(traj) <= cfg.max_context_length and len(traj.actions) <= turns
        for turn in range(1, len(traj.actions) + 1):
            span = [s for s, t in zip(traj.sources, traj.turns) if t == turn]
            assert span.count(LLM) <= response and span.count(ENV) <= 1 + obs

@ENGINES
@pytest.mark.slow
def test_rollout_deterministic_and_samples_groups_independently(tok, Engine):
    engine, cfg = Engine(tiny(), tok), RolloutConfig(max_turns=2, max_response_length=8)
    a = rollout(engine, tok, [3, 4, 3], SETTINGS, cfg, seed=11)
    assert [(t.ids, t.logprobs) for t in rollout(engine, tok, [3, 4, 3], SETTINGS, cfg, seed=11)] == [(t.ids, t.logprobs) for t in a]
    assert [t.ids for t in rollout(engine, tok, [3, 4, 3], SETTINGS, cfg, seed=12)] != [t.ids for t in a]
    assert a[0].ids != a[2].ids                                    # the same room twice: two samples
    torch.manual_seed(0); b = rollout(engine, tok, [3, 4, 3], SETTINGS, cfg)          # no seed: the global generator
    torch.manual_seed(0); assert [t.ids for t in rollout(engine, tok, [3, 4, 3], SETTINGS, cfg)] == [t.ids for t in b]
    assert [t.ids for t in rollout(engine, tok, [3, 4, 3], SETTINGS, cfg)] != [t.ids for t in b]  # it moved on
    for t in a:
        check_trajectory(t, tok, cfg)
        for turn in (1, 2):                                           # LLM logprobs are the sampler's
            llm = [k for k, (s, tt) in enumerate(zip(t.sources, t.turns)) if s == LLM and tt == turn]
            expect = manual_logprobs(tiny(), t.ids[:llm[0]], t.ids[llm[0]:llm[-1] + 1], 1.0)
            torch.testing.assert_close(torch.tensor([t.logprobs[k] for k in llm]), expect, atol=1e-4, rtol=0)

SCRIPT = """
import json
from ragen_nb.models import load_tokenizer, tiny_model
from ragen_nb.sokoban import EnvSettings
from ragen_nb.rollout import RolloutConfig, rollout
from ragen_nb.engines import SharedPrefixEngine
tok = load_tokenizer()
trajs = rollout(SharedPrefixEngine(tiny_model(tok), tok), tok, [3, 4], EnvSettings(6, 6, 1, 5, 30), RolloutConfig(max_turns=2, max_response_length=8), seed=11)
print(json.dumps([t.ids for t in trajs]))
"""

@pytest.mark.slow
def test_rollout_same_in_another_process(tok):
    here = rollout(SharedPrefixEngine(tiny(), tok), tok, [3, 4], SETTINGS, RolloutConfig(max_turns=2, max_response_length=8), seed=11)
    out = subprocess.run([sys.executable, '-c', SCRIPT], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == [t.ids for t in here]

@ENGINES
@pytest.mark.slow
def test_rollout_with_smollm(tok, Engine):
    "The real model for a short rollout: every invariant holds on real text."
    cfg = RolloutConfig(max_turns=2, max_response_length=16)
    for traj in rollout(Engine(smollm(), tok), tok, [3, 4], SETTINGS, cfg, seed=0):
        check_trajectory(traj, tok, cfg)
