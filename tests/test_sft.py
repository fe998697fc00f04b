"SFT: demonstrations equal the rollout's episodes, the loss mask is their answers, a step raises their logprobs, every setting reaches the run, and checkpoints start `train`."
import dataclasses, json, re, subprocess, sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ragen_nb.sft as sft_module
from ragen_nb.checkpoint import STATE_FILE
from ragen_nb.cli import train_main
from ragen_nb.config import Config, RunSettings
from ragen_nb.masking import collate, forward_logprobs, llm_forward, masked_mean
from ragen_nb.models import cpu_has_bf16, load_model, load_tokenizer, tiny_model, with_lora
from ragen_nb.ppo import policy_loss
from ragen_nb.rollout import RolloutConfig, ScriptedEngine, rollout
from ragen_nb.sft import (SFT_FILE, SFTConfig, demonstration, demonstrations, sft, sft_loss, sft_main, sft_step,
                          single_turn_demonstrations)
from ragen_nb.thinking import grounding, split_reply, think_text
from ragen_nb.sokoban import ACTIONS, BOX, BOX_ON_TARGET, TARGET, EnvSettings, SokobanEnv, solve
from ragen_nb.tokens import ENV, LLM, PROMPT

SEED_SETTINGS = EnvSettings(dim_x=6, dim_y=6, num_boxes=1, max_steps=5, search_depth=30)
SEEDS = range(10000, 10040)


def scripted_bfs(seed, think):
    "A reply function: the solver's move for the turn being answered (found here, apart from `demonstration`), then a ramble."
    env = SokobanEnv(SEED_SETTINGS); env.reset(seed=seed)
    plan = solve(env.room_fixed, env.room_state)
    goes = way_pushed_next(seed, plan) if plan else []
    def reply(context):
        turn = context.count('<|im_start|>assistant')
        room = re.findall(r'(?:^[#_OX√PS]+\n)+', context, re.MULTILINE)[-1].strip()
        thought = f'{think_text(room, goes[turn - 1])}</think><answer>' if think else ''
        return f'{thought}{ACTIONS[plan[turn - 1]]}</answer><|im_end|>\n<|im_start|>user\nDone'
    return reply


def way_pushed_next(seed, plan):
    "For each move of `plan`, found by playing it in the env (not by reading the room's text, as `box_goes` does): the way the box moves at the next push, if that push brings it nearer the target, else None."
    env = SokobanEnv(SEED_SETTINGS); env.reset(seed=seed)
    target = tuple(np.argwhere(env.room_fixed == TARGET)[0])
    boxes = [tuple(np.argwhere(np.isin(env.room_state, (BOX, BOX_ON_TARGET)))[0])]
    for action in plan:
        env.step(action); boxes.append(tuple(np.argwhere(np.isin(env.room_state, (BOX, BOX_ON_TARGET)))[0]))
    out = []
    for i in range(len(plan)):
        j = next((j for j in range(i, len(plan)) if boxes[j + 1] != boxes[j]), None)
        if j is None: out.append(None); continue
        step = (boxes[j + 1][0] - boxes[j][0], boxes[j + 1][1] - boxes[j][1])
        dist = lambda b: abs(b[0] - target[0]) + abs(b[1] - target[1])
        out.append({(-1, 0): 'up', (1, 0): 'down', (0, -1): 'left', (0, 1): 'right'}[step] if dist(boxes[i]) > dist((boxes[i][0] + step[0], boxes[i][1] + step[1])) else None)
    return out


def tiny_args(tiny_dir, out, name, *extra):
    return [f'BASE_MODEL={tiny_dir}', f'OUTPUT_DIR={out}', f'EXPERIMENT_NAME={name}', 'TRAIN_BATCH_SIZE=2',
            'MICRO_BATCH_SIZE=1', 'TOTAL_STEPS=2', 'LORA_RANK=0', *extra]


def read_metrics(run):
    return [json.loads(l) for l in (Path(run)/'metrics.jsonl').read_text().splitlines()]


def llm_logprobs(model, b, share_prefix=False):
    "The (B, L) logprobs of the LLM tokens of `b` (0 off the loss mask), by `llm_forward` (05), in place of sft's old helpers."
    return llm_forward(model, b, share_prefix=share_prefix)[0]


# --- demonstrations -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('think, coordinates', [(False, False), (True, False), (False, True)])
def test_demonstrations_are_the_rollouts_episodes_and_solve_their_rooms(tok, think, coordinates):
    cfg, compared = RolloutConfig(think=think, coordinates=coordinates, max_obs_length=160), 0
    for seed in SEEDS:
        demo = demonstration(tok, seed, SEED_SETTINGS, cfg)
        env = SokobanEnv(SEED_SETTINGS); env.reset(seed=seed)
        shortest = solve(env.room_fixed, env.room_state)
        if shortest is None or len(shortest) > 5:
            assert demo is None; continue                                          # skipped: BFS needs more than 5 moves
        played = rollout(ScriptedEngine(tok, scripted_bfs(seed, think)), tok, [seed], SEED_SETTINGS, cfg)[0]
        assert dataclasses.asdict(played) == dataclasses.asdict(demo)
        for action in demo.actions: *_, done, info = env.step(action)              # replayed in a fresh env: solved
        assert info['success'] and demo.success and len(demo.actions) == len(shortest)
        compared += 1
    assert compared >= 30


@pytest.mark.parametrize('settings', [SEED_SETTINGS, EnvSettings(search_depth=4, max_steps=5)], ids=['6x6', 'main-job'])
def test_demonstrated_thoughts_are_true_of_their_room_and_a_wrong_position_is_caught(tok, settings):
    "Every statement of every demonstrated thought (multi- and single-turn) checks true against the room before its move; the box's way is stated on most turns; the same thought with the player, the box or the target one row off checks false."
    cfg, thoughts = RolloutConfig(think=True, max_turns=5, max_obs_length=160), []
    for seed in SEEDS:
        demo = demonstration(tok, seed, settings, cfg)
        if demo is None: continue
        env = SokobanEnv(settings)
        rooms = [env.reset(seed=seed)] + [env.step(a)[0] for a in demo.actions[:-1]]   # the room before each move, replayed
        singles = single_turn_demonstrations(tok, seed, settings, cfg)
        for responses in (demo.responses, [s.responses[0] for s in singles]):
            thoughts += [(split_reply('<think>' + r)[0], room) for r, room in zip(responses, rooms, strict=True)]
    assert len(thoughts) >= 60
    for thought, room in thoughts:
        g = grounding(thought, room)
        assert g['claims'] == g['true'] >= 3, (thought, room)
        for name in ('I am', 'the box', 'the target'):
            r, c = map(int, re.search(name + r' at \((\d+),(\d+)\)', thought).groups())
            wrong = thought.replace(f'{name} at ({r},{c})', f'{name} at ({r + 1},{c})')
            assert grounding(wrong, room) == dict(claims=g['claims'], true=g['claims'] - 1)
    assert sum('The box must go' in t for t, _ in thoughts) >= 0.9 * len(thoughts)


def test_unsolvable_rooms_are_counted_and_skipped(tok):
    demos, skipped = demonstrations(tok, SEEDS, SEED_SETTINGS)
    lengths = {}
    for seed in SEEDS:
        env = SokobanEnv(SEED_SETTINGS); env.reset(seed=seed)
        lengths[seed] = len(solve(env.room_fixed, env.room_state) or range(99))
    assert skipped == [s for s in SEEDS if lengths[s] > 5] and len(skipped) > 0
    assert [d.seed for d in demos] == [s for s in SEEDS if lengths[s] <= 5]
    # a shorter episode skips more: MAX_TURNS=2 keeps only rooms of one or two moves
    _, skipped2 = demonstrations(tok, SEEDS, SEED_SETTINGS, RolloutConfig(max_turns=2))
    assert skipped2 == [s for s in SEEDS if lengths[s] > 2]


def test_single_turn_demonstrations_pose_each_state_of_the_path_as_a_first_prompt(tok):
    for seed in (10000, 10003, 10005):
        multi = demonstration(tok, seed, SEED_SETTINGS)
        singles = single_turn_demonstrations(tok, seed, SEED_SETTINGS)
        assert [s.actions[0] for s in singles] == multi.actions and singles[-1].success
        played = rollout(ScriptedEngine(tok, scripted_bfs(seed, False)), tok, [seed], SEED_SETTINGS, RolloutConfig(max_turns=1))[0]
        assert dataclasses.asdict(played) == dataclasses.asdict(singles[0])                   # the first: a 1-turn rollout
        rooms = [SokobanEnv(SEED_SETTINGS).reset(seed=seed)] + multi.observations[:-1]
        for room, s in zip(rooms, singles):
            n_prompt, n_answer = s.sources.count(PROMPT), len(tok.encode(s.responses[0], add_special_tokens=False))
            assert s.sources == [PROMPT] * n_prompt + [LLM] * n_answer + [ENV]                # prompt, answer, the closing eos
            assert tok.decode(s.ids[:n_prompt]).count(room) == 1                              # the room before this move


def test_the_loss_mask_covers_exactly_the_demonstrated_answers(tok):
    demos = [demonstration(tok, s, SEED_SETTINGS, RolloutConfig(think=t)) for s, t in ((10000, False), (10003, True))]
    b = collate(demos, tok.pad_token_id)
    for row, demo in enumerate(demos):
        masked = b.input_ids[row][b.loss_mask[row].bool()].tolist()
        answers = [tok.encode(r, add_special_tokens=False) for r in demo.responses]
        assert masked == sum(answers, [])                                         # the answers' ids, nothing else
        assert tok.decode(masked) == ''.join(demo.responses)
        assert all(r.endswith('</answer>') for r in demo.responses)
        ids, mask = b.input_ids[row].tolist(), b.loss_mask[row].tolist()
        closing = [i + 1 for i in range(len(ids) - 1) if mask[i] and not mask[i + 1]]   # right after each answer
        assert [ids[i] for i in closing] == [tok.eos_token_id] * len(demo.responses)   # the eos closing it is not trained


def test_a_demonstrated_answer_longer_than_a_turn_is_an_error(tok):
    with pytest.raises(ValueError, match='MAX_RESPONSE_LENGTH'):
        demonstration(tok, 10000, SEED_SETTINGS, RolloutConfig(think=True, max_response_length=10))


# --- the loss -------------------------------------------------------------------------------------------------------

def test_sft_loss_is_ppos_loss_with_advantage_one_at_ratio_one(tok):
    b = collate(demonstrations(tok, range(10000, 10004), SEED_SETTINGS)[0], tok.pad_token_id)
    model = tiny_model(tok)
    def grad(loss_fn):
        model.zero_grad(); loss = loss_fn(forward_logprobs(model, b)); loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])
    sft_value, g_sft = grad(lambda lp: sft_loss(lp, b.loss_mask))
    ppo_value, g_ppo = grad(lambda lp: policy_loss(lp, lp.detach(), torch.ones_like(lp), b.loss_mask)[0])
    torch.testing.assert_close(g_ppo, g_sft)                      # the gradients agree; the values do not:
    assert ppo_value.item() == pytest.approx(-1.0)                   # PPO's surrogate at ratio 1 is −mean(A)
    adv = torch.randn(b.loss_mask.shape, generator=torch.Generator().manual_seed(1))
    _, g_ppo = grad(lambda lp: policy_loss(lp, lp.detach(), adv, b.loss_mask)[0])
    _, g_weighted = grad(lambda lp: masked_mean(-adv * lp, b.loss_mask))
    torch.testing.assert_close(g_ppo, g_weighted)
    # by hand: the mean of −log p over the masked positions, in a plain loop
    with torch.no_grad(): lp = forward_logprobs(model, b)
    picked = [-lp[i, j].item() for i in range(len(b)) for j in range(b.input_ids.shape[1]) if b.loss_mask[i, j]]
    assert sft_value.item() == pytest.approx(sum(picked) / len(picked), rel=1e-5)


@pytest.mark.parametrize('multi_turn', [True, False])
def test_fast_logprobs_equal_the_reference(tok, multi_turn):
    b = collate(demonstrations(tok, range(10000, 10004), SEED_SETTINGS, multi_turn=multi_turn)[0], tok.pad_token_id)
    model = tiny_model(tok)
    mask = b.loss_mask.bool()
    reference = forward_logprobs(model, b)[mask]
    g = []
    for share_prefix in (False, True):
        model.zero_grad(); full = llm_logprobs(model, b, share_prefix)
        assert full.shape == b.loss_mask.shape and (full[~mask] == 0).all()   # (B, L), zeroed off the loss mask
        lp = full[mask]
        torch.testing.assert_close(lp, reference, atol=1e-5, rtol=1e-5)
        lp.sum().backward(); g.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    model.zero_grad(); reference.sum().backward()
    for grad in g: torch.testing.assert_close(grad, torch.cat([p.grad.flatten() for p in model.parameters()]), atol=1e-5, rtol=1e-4)


def test_one_step_raises_the_demonstrated_tokens_logprobs_full_and_lora(tok):
    demos = demonstrations(tok, range(10000, 10003), SEED_SETTINGS)[0]
    b = collate(demos, tok.pad_token_id)
    for lora_rank in (0, 8):
        model = tiny_model(tok)
        if lora_rank: model = with_lora(model, lora_rank, Config().lora_alpha, seed=0)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        with torch.no_grad(): before = llm_logprobs(model, b)[b.loss_mask.bool()]
        stats = sft_step(model, opt, demos, tok.pad_token_id, micro_batch_size=2)
        with torch.no_grad(): after = llm_logprobs(model, b)[b.loss_mask.bool()]
        assert after.mean() > before.mean() and stats['loss'] == pytest.approx(-before.mean().item(), rel=1e-4)
        assert stats['llm_tokens'] == int(b.loss_mask.sum()) and not model.training


def test_micro_batches_and_the_shared_prefix_leave_the_step_unchanged(tok):
    demos = demonstrations(tok, range(10000, 10006), SEED_SETTINGS)[0][:4]
    after = []
    for micro, share in ((4, False), (1, False), (2, True), (4, True)):
        model = tiny_model(tok)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sft_step(model, opt, demos, tok.pad_token_id, micro_batch_size=micro, share_prefix=share)
        after.append(torch.nn.utils.parameters_to_vector(model.parameters()))
    for a in after[1:]: torch.testing.assert_close(a, after[0], atol=1e-5, rtol=1e-5)


def test_a_bf16_step_moves_the_weights_as_the_fp32_step_does(tok):
    demos = demonstrations(tok, range(10000, 10006), SEED_SETTINGS)[0][:4]
    start = torch.nn.utils.parameters_to_vector(tiny_model(tok).parameters())
    moves, losses = [], []
    for bf16 in (False, True):
        model = tiny_model(tok)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        stats = sft_step(model, opt, demos, tok.pad_token_id, micro_batch_size=2, bf16=bf16)
        moves.append(torch.nn.utils.parameters_to_vector(model.parameters()) - start); losses.append(stats['loss'])
        assert all(p.dtype == torch.float32 for p in model.parameters())   # autocast leaves the weights in fp32
    assert losses[1] == pytest.approx(losses[0], rel=1e-2)               # bf16 keeps ~3 significant digits
    assert torch.nn.functional.cosine_similarity(moves[0], moves[1], dim=0) > 0.99
    assert not torch.equal(moves[0], moves[1])                              # it did run in bf16


def test_nonfinite_step_raises_and_applies_nothing(tok):
    demos = demonstrations(tok, range(10000, 10002), SEED_SETTINGS)[0]
    model = tiny_model(tok)
    with torch.no_grad(): model.model.norm.weight.fill_(float('nan'))
    before = torch.nn.utils.parameters_to_vector(model.parameters()).clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(FloatingPointError, match='step 7'): sft_step(model, opt, demos, tok.pad_token_id, 1, step=7)
    assert torch.equal(torch.nn.utils.parameters_to_vector(model.parameters()).nan_to_num(), before.nan_to_num())


# --- settings and the run -------------------------------------------------------------------------------------------

def test_help_lists_every_setting_with_its_doc(capsys):
    assert sft_main(['--help']) == 0
    text = capsys.readouterr().out
    settings = text.splitlines()[2:]
    assert len(settings) == len(dataclasses.fields(SFTConfig)) and all(len(l.split(None, 1)) == 2 for l in settings)
    for f in dataclasses.fields(SFTConfig): assert f'{f.name.upper()}={f.default}' in text
    assert text == SFTConfig.help() + '\n'
    assert issubclass(SFTConfig, RunSettings) and text.startswith('ragen_nb sft KEY=value')
    env = SFTConfig.env_vars()   # RAGEN's exported variables that SFT reads: the room and episode limits and the logger, not the run's sizes
    assert env == ('DATA_DIR', 'DIM_X', 'DIM_Y', 'NUM_BOXES', 'MAX_STEPS', 'SEARCH_DEPTH', 'MAX_START_LENGTH',
                   'MAX_RESPONSE_LENGTH', 'MAX_OBS_LENGTH', 'MAX_TURNS', 'BASE_MODEL', 'LOG_MODE')
    for f in dataclasses.fields(SFTConfig): assert (f'[env {f.name.upper()}]' in text) == (f.name.upper() in env)


@pytest.mark.parametrize('args, says', [(['LR=0'], 'lr=0'), (['MICRO_BATCH_SIZE=3'], 'must divide'),
                                        (['CLIP_RATIO=0.2'], 'unknown setting'), (['LR_SCHEDULER=poly'], 'lr_scheduler'),
                                        (['TOTAL_STEPS=ten'], 'an integer'), (['DIM_X=2'], 'dim'),
                                        (['WARMUP_STEPS_RATIO=1'], 'warmup'), (['MAX_TURNS=0'], 'max_turns'),
                                        (['THINK=True', 'MAX_RESPONSE_LENGTH=10'], 'MAX_RESPONSE_LENGTH'),
                                        (['BASE_MODEL=/nonexistent/model'], '/nonexistent/model')])
def test_bad_settings_are_one_error_line_before_any_model_loads(tmp_path, monkeypatch, capsys, args, says):
    def no_model(*a, **k): raise AssertionError('a model was loaded')
    monkeypatch.setattr(sft_module, 'load_model', no_model)
    assert sft_main([f'OUTPUT_DIR={tmp_path}', *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith('error: ') and says in err
    assert not any(tmp_path.iterdir())


def test_the_command_line_rejects_bad_settings_and_a_used_folder(tmp_path):
    r = subprocess.run([sys.executable, '-m', 'ragen_nb.cli', 'sft', 'LR=-1'], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ['error: lr=-1.0: must be > 0']
    (tmp_path/'used').mkdir(); (tmp_path/'used'/'metrics.jsonl').write_text('')
    r = subprocess.run([sys.executable, '-m', 'ragen_nb.cli', 'sft', f'OUTPUT_DIR={tmp_path}', 'EXPERIMENT_NAME=used'],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and 'already holds a run' in r.stderr and r.stderr.count('\n') == 1


def test_env_variables_set_the_rooms_but_not_the_run(monkeypatch):
    for k, v in {'SEARCH_DEPTH': '4', 'MAX_TURNS': '2', 'TRAIN_BATCH_SIZE': '128', 'EXPERIMENT_NAME': 'rl'}.items():
        monkeypatch.setenv(k, v)
    cfg = SFTConfig.from_env(['MAX_TURNS=3'])
    assert (cfg.search_depth, cfg.max_turns, cfg.train_batch_size, cfg.experiment_name) == (4, 3, 8, 'sft-smollm2-135m')


def test_rollout_config_is_trains(tok):
    for args in ([], ['THINK=True', 'MAX_TURNS=2', 'MAX_OBS_LENGTH=90', 'TEMPLATE=base'], ['COORDINATES=true', 'MAX_OBS_LENGTH=160']):
        assert SFTConfig.from_args(args).rollout_config() == Config.from_args(args).rollout_config()
    assert Config.from_args(['COORDINATES=true']).rollout_config().coordinates and not Config().rollout_config().coordinates


@pytest.mark.slow
def test_a_run_counts_schedules_saves_and_validates_as_set(tok, tiny_dir, tmp_path, monkeypatch):
    seen_batches = []
    real_collate = sft_module.collate
    monkeypatch.setattr(sft_module, 'collate', lambda trajs, pad: seen_batches.append(len(trajs)) or real_collate(trajs, pad))
    monkeypatch.setattr(sft_module, 'val_seeds', lambda cfg: list(range(20000, 20000 + cfg.val_rooms)))
    args = tiny_args(tiny_dir, tmp_path, 'run', 'TOTAL_STEPS=4', 'TRAIN_BATCH_SIZE=4', 'MICRO_BATCH_SIZE=2', 'SAVE_FREQ=2',
                     'TEST_FREQ=3', 'VAL_ROOMS=3', 'LR=0.01', 'LR_SCHEDULER=linear', 'WARMUP_STEPS_RATIO=0.5', 'MAX_TURNS=2')
    assert sft_main(args) == 0
    rows = read_metrics(tmp_path/'run')
    assert [r['step'] for r in rows] == [1, 2, 3, 4] and seen_batches == [2] * 8          # 4 steps of 2 micro-batches of 2
    assert [r['examples'] for r in rows] == [4, 8, 12, 16]
    assert [round(r['lr'], 6) for r in rows] == [0.0, 0.005, 0.01, 0.005]                # warm-up 2 steps, then linear to 0
    assert [r.get('val/rooms') for r in rows] == [None, None, 3, 3]                     # every 3 steps and after the last
    assert rows[-1]['rooms_skipped'] > 0 and rows[-1]['answers'] <= 2 * rows[-1]['examples']   # MAX_TURNS=2: rooms of 1-2 moves
    assert sorted(p.name for p in (tmp_path/'run').iterdir()) == ['curves.png', 'global_step_2', 'global_step_4', 'metrics.jsonl', 'run.json']
    assert (tmp_path/'run'/'curves.png').read_bytes()[:4] == b'\x89PNG'                  # drawn by RunLog.close, as train's
    saved = json.loads((tmp_path/'run'/'global_step_4'/SFT_FILE).read_text())
    saved['config'] = json.loads((tmp_path/'run'/'global_step_4'/'settings.json').read_text())   # the run's settings, beside it
    session, = json.loads((tmp_path/'run'/'run.json').read_text())['sessions']                # the command's own record
    assert session['kind'] == 'sft' and session['status'] == 'done' and session['step'] == 4 and session['settings'] == saved['config']
    assert saved['step'] == 4 and saved['config']['lr'] == 0.01 and saved['metrics'] == rows[-1]


def test_validation_of_a_thinking_model_reports_its_thoughts(tok, monkeypatch):
    "With THINK=True the SFT's validation adds 13's think/ metrics: on the demonstrations themselves, every turn in format and every thought grounded; without, no think/ key."
    cfg = RolloutConfig(think=True, max_turns=5, max_response_length=64, max_obs_length=160)
    demos = [d for d in (demonstration(tok, seed, SEED_SETTINGS, cfg) for seed in SEEDS[:12]) if d is not None]
    monkeypatch.setattr(sft_module, 'play', lambda engine, tokenizer, seeds, settings, cfg, progress: demos)
    with_thoughts = sft_module.play_heldout(None, tok, [d.seed for d in demos], SEED_SETTINGS, cfg)
    assert with_thoughts['val/success_rate'] == 1.0 and with_thoughts['val/think/format'] == 1.0
    assert with_thoughts['val/think/checkable'] == 1.0 and with_thoughts['val/think/grounded'] == 1.0
    plain = sft_module.play_heldout(None, tok, [d.seed for d in demos], SEED_SETTINGS, dataclasses.replace(cfg, think=False))
    assert not any(k.startswith('val/think/') for k in plain)


def test_multi_turn_seed_and_think_change_the_examples(tok, tiny_dir, tmp_path, monkeypatch):
    batches = {}
    def spy(name):
        def step(model, opt, trajs, *args, **kwargs):
            batches.setdefault(name, []).append(trajs)
            opt.step()                                                  # no gradients: nothing moves
            return dict(loss=1.0, grad_norm=0.0, llm_tokens=1, tokens=1)
        return step
    for name, extra in (('multi', []), ('single', ['MULTI_TURN=False']), ('seed1', ['SEED=1']), ('think', ['THINK=True']),
                        ('format', ['THINK=True', 'MULTI_TURN=False', 'FORMAT_ONLY=True'])):
        monkeypatch.setattr(sft_module, 'sft_step', spy(name))
        assert sft_main(tiny_args(tiny_dir, tmp_path, name, 'TOTAL_STEPS=1', 'TRAIN_BATCH_SIZE=4', *extra)) == 0
    first = {k: v[0] for k, v in batches.items()}
    assert all(len(t.actions) == 1 for t in first['single']) and max(len(t.actions) for t in first['multi']) > 1
    assert [t.seed for t in first['seed1']] != [t.seed for t in first['multi']]
    assert all('<think>' in tok.decode(t.ids) for t in first['think']) and not any('</think>' in tok.decode(t.ids) for t in first['multi'])
    trained = {tok.decode([i for i, s in zip(t.ids, t.sources) if s == LLM]) for t in first['format']}
    assert trained == {'</think><answer></answer>'}   # FORMAT_ONLY: the tags alone are in the loss


def test_format_only_demonstrations_train_the_tags_and_give_the_thought_and_move(tok):
    "The same states and moves as the plain think demonstrations; the loss mask covers the tags, and the given thought and move are right."
    cfg = RolloutConfig(think=True)
    for seed in SEEDS[:10]:
        formatted = single_turn_demonstrations(tok, seed, SEED_SETTINGS, cfg, format_only=True)
        plain = single_turn_demonstrations(tok, seed, SEED_SETTINGS, cfg)
        assert [f.actions for f in formatted] == [p.actions for p in plain]
        for f in formatted:
            b = collate([f], tok.pad_token_id)
            in_loss = [i for i, m in zip(f.ids, b.loss_mask[0].tolist()) if m]
            assert tok.decode(in_loss) == '</think><answer></answer>'
            assert f.responses[0] == f"{think_text(f.room)}</think><answer>{ACTIONS[f.actions[0]]}</answer>"
    with pytest.raises(ValueError, match='THINK=True'): single_turn_demonstrations(tok, 10000, SEED_SETTINGS, RolloutConfig(), format_only=True)
    for bad in (['FORMAT_ONLY=True'], ['FORMAT_ONLY=True', 'THINK=True']):
        with pytest.raises(ValueError, match='MULTI_TURN=False'): SFTConfig.from_args(bad).validate()


def test_share_prefix_chooses_the_shared_forward(tok, tiny_dir, tmp_path, monkeypatch):
    calls = []
    real = sft_module.llm_forward
    monkeypatch.setattr(sft_module, 'llm_forward', lambda *a, **k: calls.append(k.get('share_prefix', False)) or real(*a, **k))
    assert sft_main(tiny_args(tiny_dir, tmp_path, 'on', 'TOTAL_STEPS=1', 'SHARE_PREFIX=True')) == 0
    assert calls == [True, True]                                # one step, two micro-batches of one, both shared
    assert sft_main(tiny_args(tiny_dir, tmp_path, 'off', 'TOTAL_STEPS=1', 'SHARE_PREFIX=False')) == 0
    assert calls == [True, True, False, False]                  # none more shared


def test_bf16_setting_reaches_the_step(tok, tiny_dir, tmp_path, monkeypatch):
    seen = []
    real = sft_module.sft_step
    monkeypatch.setattr(sft_module, 'sft_step', lambda *a, **k: seen.append(a[-1]) or real(*a, **k))
    assert sft_main(tiny_args(tiny_dir, tmp_path, 'bf16', 'TOTAL_STEPS=1', 'BF16=true')) == 0
    assert sft_main(tiny_args(tiny_dir, tmp_path, 'fp32', 'TOTAL_STEPS=1', 'BF16=false')) == 0
    assert sft_main(tiny_args(tiny_dir, tmp_path, 'auto', 'TOTAL_STEPS=1')) == 0   # BF16=auto: as the CPU's flags say
    assert seen == [True, False, bool(cpu_has_bf16())]


@pytest.mark.parametrize('flags, native', [('fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni', True),   # Zen 4, Cooper Lake
                                           ('fpu sse2 avx2 amx_bf16 amx_tile', True),                 # Sapphire Rapids
                                           ('fp asimd bf16 i8mm', True),                              # Arm (Features line)
                                           ('fpu sse2 avx2 fma', False),                              # Zen 2: emulated
                                           ('fpu sse2 avx512f avx512bw avx512_vnni', False)])         # AVX-512 without bf16
def test_cpu_has_bf16_reads_the_cpu_flags(tmp_path, flags, native):
    (tmp_path/'cpuinfo').write_text(f'processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n')
    assert cpu_has_bf16(tmp_path/'cpuinfo') is native
    assert cpu_has_bf16(tmp_path/'absent') is None     # not Linux: cannot tell, so no warning


@pytest.mark.parametrize('native, emulated', [(False, True), (True, False), (None, False)])
def test_bf16_on_a_cpu_without_bf16_instructions_says_so(tiny_dir, tmp_path, monkeypatch, capsys, native, emulated):
    "The precision line sft prints says when bf16 is emulated (slower than fp32), and only then."
    import ragen_nb.models as models
    monkeypatch.setattr(models, 'cpu_has_bf16', lambda *a: native)
    assert sft_main(tiny_args(tiny_dir, tmp_path, 'bf16', 'TOTAL_STEPS=1', 'BF16=true')) == 0
    assert ('bf16 is emulated here, slower than fp32' in capsys.readouterr().err) == emulated
    assert sft_main(tiny_args(tiny_dir, tmp_path, 'fp32', 'TOTAL_STEPS=1', 'BF16=false')) == 0   # fp32 is never emulated
    assert 'emulated' not in capsys.readouterr().err


@pytest.mark.parametrize('lora_rank', [0, 4])
def test_a_checkpoint_starts_train_as_base_model(tok, tiny_dir, tmp_path, lora_rank):
    assert sft_main(tiny_args(tiny_dir, tmp_path, 'sft', f'LORA_RANK={lora_rank}', 'LR=0.01')) == 0
    ckpt = tmp_path/'sft'/'global_step_2'
    assert (ckpt/'actor_lora').exists() == bool(lora_rank) and (ckpt/'actor'/'config.json').exists()
    assert not (ckpt/STATE_FILE).exists() and (ckpt/SFT_FILE).exists()   # no optimizer state: a start, not a resume point
    demos = demonstrations(tok, range(10000, 10002), SEED_SETTINGS)[0]
    b = collate(demos, tok.pad_token_id)
    with torch.no_grad():
        start, tuned = forward_logprobs(load_model(str(tiny_dir), device='cpu'), b), forward_logprobs(load_model(str(ckpt), device='cpu'), b)
    assert masked_mean(tuned - start, b.loss_mask) > 0                                  # SFT moved the demonstrated tokens up
    assert train_main([f'BASE_MODEL={ckpt}', f'OUTPUT_DIR={tmp_path}', 'EXPERIMENT_NAME=rl', 'TOTAL_STEPS=1', 'TRAIN_BATCH_SIZE=2',
                       'PPO_BATCH_SIZE=2', 'MAX_TURNS=2', 'MAX_RESPONSE_LENGTH=6', 'TEST_FREQ=0', 'SAVE_FREQ=1',
                       'ROLLOUT_ENGINE=hf', 'KL_COEF=0', 'GCP=False', f'LORA_RANK={lora_rank}', 'ACTOR_LR=1e-9',
                       'CRITIC_LR=1e-9']) == 0
    with torch.no_grad(): after_rl = forward_logprobs(load_model(str(tmp_path/'rl'/'global_step_1'), device='cpu'), b)
    torch.testing.assert_close(after_rl, tuned, atol=1e-3, rtol=0)                       # RL started from the SFT weights
