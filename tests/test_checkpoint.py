"Checkpoints: atomic saves, the last step saved off SAVE_FREQ, and resumed steps and runs (killed hard, LoRA) equal to uninterrupted ones."
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ragen_nb.checkpoint import latest_checkpoint
from ragen_nb.cli import train_main
from ragen_nb.config import RAGEN_ENV_VARS, Config
from ragen_nb.masking import collate, forward_logprobs
from ragen_nb.critic import ValueModel
from ragen_nb.models import load_tokenizer, tiny_model
from ragen_nb.trainer import TRAIN_METRICS, make_optimizers, ppo_step, train
from ragen_nb.viz import read_records
from tiny import ROOT, cfg_for, episode, read_metrics, run_args, untimed


def test_resume_from_checkpoint_matches_an_uninterrupted_run(tok, tmp_path):
    from ragen_nb.models import load_model
    from ragen_nb.checkpoint import load_training_state, save_checkpoint
    trajs = [episode(tok, 'Up', 1., 0), episode(tok, 'Down', -1., 1)]
    cfg = cfg_for(2, ACTOR_LR=1e-3, CRITIC_LR=1e-3)
    actor = tiny_model(tok); critic = ValueModel.from_causal_lm(actor)
    opts = make_optimizers(actor, critic, cfg)
    ppo_step(trajs, actor, critic, *opts, cfg, tok.pad_token_id, step=0)
    path = save_checkpoint(tmp_path, 1, actor, tok, critic, *opts, config=dataclasses.asdict(cfg))
    assert torch.load(path/'state.pt', weights_only=False)['config'] == dataclasses.asdict(cfg)
    assert (path/'actor'/'tokenizer.json').exists()
    expected_rand = torch.rand(3)
    ppo_step(trajs, actor, critic, *opts, cfg, tok.pad_token_id, step=1)
    vec = torch.nn.utils.parameters_to_vector

    def resumed(restore):
        a, c = load_model(str(path), device='cpu'), ValueModel.from_pretrained(str(path), device='cpu')
        o = make_optimizers(a, c, cfg)
        if restore: assert load_training_state(path, *o) == 1
        ppo_step(trajs, a, c, *o, cfg, tok.pad_token_id, step=1)
        return a, c

    a, c = resumed(True)
    assert torch.equal(torch.rand(3), expected_rand)                      # RNG restored
    torch.testing.assert_close(vec(a.parameters()), vec(actor.parameters()), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(vec(c.parameters()), vec(critic.parameters()), atol=1e-6, rtol=1e-5)
    a, _ = resumed(False)                                                 # without Adam's state the run diverges
    assert (vec(a.parameters()) - vec(actor.parameters())).abs().max() > 1e-4
    assert sorted(p.name for p in tmp_path.iterdir()) == ['global_step_1']


def test_save_is_atomic_and_replaces(tok, tmp_path, monkeypatch):
    from ragen_nb.checkpoint import STATE_FILE, load_training_state, save_checkpoint
    cfg = cfg_for(2)
    actor = tiny_model(tok); critic = ValueModel.from_causal_lm(actor)
    opts = make_optimizers(actor, critic, cfg)
    start = save_checkpoint(tmp_path/'start', 0, actor, critic=critic)       # no optimizer: a start, not a resume point
    assert sorted(p.name for p in start.iterdir()) == ['actor', 'critic']
    path = save_checkpoint(tmp_path, 5, actor, critic=critic, actor_opt=opts[0], critic_opt=opts[1])
    assert (path/'actor'/'config.json').exists() and (path/'critic'/'value_head.safetensors').exists()
    with torch.no_grad(): actor.lm_head.weight.add_(1.)
    def boom(*a, **k): raise OSError('disk full')
    monkeypatch.setattr(torch, 'save', boom)
    with pytest.raises(OSError, match='disk full'):
        save_checkpoint(tmp_path, 6, actor, critic=critic, actor_opt=opts[0], critic_opt=opts[1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ['global_step_5', 'start']   # no global_step_6, no temp folder
    monkeypatch.undo()
    save_checkpoint(tmp_path, 5, actor, critic=critic, actor_opt=opts[0], critic_opt=opts[1])   # overwrite in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ['global_step_5', 'start']
    from ragen_nb.models import load_model
    torch.testing.assert_close(load_model(str(path), device='cpu').lm_head.weight, actor.lm_head.weight)
    (path/STATE_FILE).unlink()
    with pytest.raises(FileNotFoundError, match='save_checkpoint'): load_training_state(path, *opts)


# keys a step line holds only with some settings: the dual clip, the KL loss, sampled validation, room groups
OPTIONAL = ({'actor/dual_clipfrac', 'actor/kl_loss', 'val/mi', 'val/mi_null', 'val/mi_null_std'}   # VAL_SAMPLES > 1 only
            | {k for k in TRAIN_METRICS if k.startswith(('filter/', 'collapse/', 'think/', 'start/'))}   # THINK=True, START_CURRICULUM=True only
            | {'timing/prefill', 'timing/decode', 'perf/prefill_tokens', 'perf/decode_tokens', 'perf/rollout_tokens_per_s'})   # ROLLOUT_ENGINE=decode only


CRASH = """
import os, sys
import ragen_nb.runlog as runlog, ragen_nb.cli as cli
real = runlog.save_checkpoint                # what RunLog.checkpoint calls
def save_then_die(folder, step, *args, **kwargs):
    if step == 2: os._exit(17)              # killed after writing step 2's metrics, before its checkpoint
    return real(folder, step, *args, **kwargs)
runlog.save_checkpoint = save_then_die
sys.exit(cli.train_main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_killed_run_resumes_to_the_metrics_of_an_uninterrupted_run(tiny_dir, tmp_path):
    env = {**os.environ, 'PYTHON': sys.executable}
    for k in RAGEN_ENV_VARS: env.pop(k, None)
    steps = ['TOTAL_STEPS=3', 'SAVE_FREQ=1', 'TEST_FREQ=2', 'LOG_IMAGES=True', 'LOG_IMAGE_STEP_SIZE=1',
             'LOG_N_IMAGE_PER_BATCH=1', f'LOG_IMAGE_DIR={tmp_path/"img"}']
    # the uninterrupted run, through train.sh
    done = subprocess.run(['bash', str(ROOT/'train.sh'), *run_args(tiny_dir, tmp_path, 'whole', *steps)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    whole = read_metrics(tmp_path/'whole')
    assert [r['step'] for r in whole] == [0, 1, 2, 3] and set(whole[2]) == set(TRAIN_METRICS) - OPTIONAL   # 0: validation only
    assert latest_checkpoint(tmp_path/'whole').name == 'global_step_3'
    # the same run, killed hard in step 2: the line of step 2 is written, its checkpoint is not
    crashed = subprocess.run([sys.executable, '-c', CRASH, *run_args(tiny_dir, tmp_path, 'crash', *steps)], env=env,
                             capture_output=True, text=True, timeout=300)
    assert crashed.returncode == 17, crashed.stderr[-3000:]
    cut = read_metrics(tmp_path/'crash')
    assert [r['step'] for r in cut] == [0, 1, 2] and latest_checkpoint(tmp_path/'crash').name == 'global_step_1'
    # reproducibility: same seed, another process, same numbers
    assert [untimed(r) for r in cut] == [untimed(r) for r in whole[:3]]
    # resumed: step 2 is redone from global_step_1 and the file continues as if nothing happened
    assert train_main(run_args(tiny_dir, tmp_path, 'crash', *steps, 'RESUME=True')) == 0
    resumed = read_metrics(tmp_path/'crash')
    assert [untimed(r) for r in resumed] == [untimed(r) for r in whole]
    assert resumed[:2] == cut[:2]                                            # the lines up to the checkpoint are intact
    # rollouts.jsonl too: step 2's trajectory, drawn before the kill, is replaced by the redone step's, not doubled
    drawn = {run: [(r['step'], r['trajectory']) for r in read_records(tmp_path/run/'rollouts.jsonl')] for run in ('whole', 'crash')}
    assert [step for step, _ in drawn['whole']] == [1, 2, 3] and drawn['crash'] == drawn['whole']
    from safetensors.torch import load_file
    a, b = (load_file(tmp_path/run/'global_step_3'/'actor'/'model.safetensors') for run in ('whole', 'crash'))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_last_step_is_saved_even_off_the_save_frequency(tiny_dir, tmp_path):
    done = train(Config.from_args(run_args(tiny_dir, tmp_path, 'last', 'TOTAL_STEPS=3', 'SAVE_FREQ=2', 'TEST_FREQ=0')), progress=False)
    assert [p.name for p in sorted((tmp_path/'last').glob('global_step_*'))] == ['global_step_2', 'global_step_3']
    assert Path(done['checkpoint']).name == 'global_step_3' and latest_checkpoint(tmp_path/'last').name == 'global_step_3'
    train(Config.from_args(run_args(tiny_dir, tmp_path, 'never', 'TOTAL_STEPS=1', 'SAVE_FREQ=0', 'TEST_FREQ=0')), progress=False)
    assert not list((tmp_path/'never').glob('global_step_*'))              # SAVE_FREQ=0 still saves nothing


def test_lora_run_checkpoints_a_loadable_actor_and_resumes_exactly(tiny_dir, tmp_path):
    from ragen_nb.models import load_model
    steps = ['TOTAL_STEPS=2', 'SAVE_FREQ=1', 'TEST_FREQ=0', 'LORA_RANK=4', 'CRITIC=shared', 'KL_COEF=0.01', 'GCP=False', 'BF16=false']   # fp32: the merged actor equals the LoRA model to float rounding
    whole = train(Config.from_args(run_args(tiny_dir, tmp_path, 'whole', *steps)), progress=False)
    ckpt = Path(whole['checkpoint'])
    assert sorted(p.name for p in ckpt.iterdir()) == ['actor', 'actor_lora', 'critic', 'settings.json', 'state.pt']
    assert sorted(p.name for p in (ckpt/'critic').iterdir()) == ['value_head.safetensors']   # shared: the head only
    trajs = [episode(load_tokenizer(), 'Up', 1., 0)]
    b = collate(trajs, 2)
    with torch.no_grad():
        torch.testing.assert_close(forward_logprobs(load_model(str(ckpt/'actor'), device='cpu'), b),
                                   forward_logprobs(whole['actor'], b), atol=1e-5, rtol=1e-5)
    train(Config.from_args(run_args(tiny_dir, tmp_path, 'cut', *steps[1:], 'TOTAL_STEPS=1')), progress=False)
    resumed = train(Config.from_args(run_args(tiny_dir, tmp_path, 'cut', *steps, 'RESUME=True')), progress=False)
    assert [untimed(r) for r in read_metrics(tmp_path/'cut')] == [untimed(r) for r in read_metrics(tmp_path/'whole')]
    vec = torch.nn.utils.parameters_to_vector
    torch.testing.assert_close(vec(resumed['actor'].parameters()), vec(whole['actor'].parameters()), rtol=0, atol=1e-6)
