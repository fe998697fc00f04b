"The run log: metrics.jsonl cut back on resume, what a failed step leaves, a used folder refused, a broken wandb, thoughts and images."
import json
import sys
from pathlib import Path

import pytest

import ragen_nb.runlog as runlog
import ragen_nb.trainer as trainer
from ragen_nb.cli import train_main
from ragen_nb.config import Config
from ragen_nb.trainer import TRAIN_METRICS, train
from ragen_nb.viz import read_records
from tiny import read_metrics, run_args


def test_keep_steps_drops_lines_after_the_checkpoint_and_a_torn_line(tmp_path):
    path = tmp_path/'metrics.jsonl'
    path.write_text(''.join(json.dumps({'step': s, 'x': s / 3}) + '\n' for s in (1, 2, 3)) + '{"step": 4, "x')
    with pytest.warns(UserWarning, match=r'metrics\.jsonl, line 4: unfinished last line left out'): runlog.keep_steps(path, 2)
    with path.open('a') as f: f.write(json.dumps({'step': 3, 'x': -1}) + '\n')
    assert read_metrics(tmp_path) == [{'step': 1, 'x': 1 / 3}, {'step': 2, 'x': 2 / 3}, {'step': 3, 'x': -1}]
    runlog.keep_steps(tmp_path/'absent.jsonl', 2)
    assert not (tmp_path/'absent.jsonl').exists()


def test_keep_steps_keeps_nothing_without_a_checkpoint_and_refuses_garbage_mid_file(tmp_path):
    "A run resumed without a checkpoint starts over, step-0 validation included, so even step 0's line goes; a bad line that is not the last one is an error and the file stays as it was."
    path = tmp_path/'metrics.jsonl'
    path.write_text(''.join(json.dumps({'step': s}) + '\n' for s in (0, 1)))
    runlog.keep_steps(path, 0)
    assert path.read_text() == ''
    damaged = json.dumps({'step': 1}) + '\nnot json\n' + json.dumps({'step': 2}) + '\n'
    path.write_text(damaged)
    with pytest.raises(ValueError, match='line 2, is not a JSON record'): runlog.keep_steps(path, 2)
    assert path.read_text() == damaged
    stepless = json.dumps({'step': 1}) + '\n' + json.dumps({'x': 1}) + '\n'     # JSON, but no step: edited or damaged too
    path.write_text(stepless)
    with pytest.raises(ValueError, match='record 2, has no step'): runlog.keep_steps(path, 2)
    assert path.read_text() == stepless


def test_a_thinking_run_logs_its_thoughts(tiny_dir, tmp_path):
    "THINK=True: every step line holds the think/ metrics of 13, and the tiny model, which never closes a thought, is in R1's format on no turn."
    train(Config.from_args(run_args(tiny_dir, tmp_path, 'think', 'TOTAL_STEPS=2', 'SAVE_FREQ=0', 'TEST_FREQ=0', 'THINK=True', 'MAX_RESPONSE_LENGTH=12')), progress=False)
    steps = [r for r in read_metrics(tmp_path/'think') if r['step'] >= 1]
    assert len(steps) == 2 and all({k for k in TRAIN_METRICS if k.startswith('think/')} <= set(r) for r in steps)
    assert all(r['think/format'] == 0 and r['train/valid_action_rate'] == 0 and r['think/tokens'] > 0 for r in steps)


def test_a_new_run_refuses_a_used_folder(tiny_dir, tmp_path, capsys):
    (tmp_path/'used').mkdir(); (tmp_path/'used'/'metrics.jsonl').write_text('')
    assert train_main(run_args(tiny_dir, tmp_path, 'used')) == 2
    assert 'RESUME=True' in capsys.readouterr().err


def test_nonfinite_step_stops_and_saves_nothing_of_it(tiny_dir, tmp_path, monkeypatch):
    real = trainer.ppo_update
    def nan_at_step_2(b, *args, **kwargs):
        if kwargs['step'] == 2: raise FloatingPointError('step 2: non-finite loss (pg_loss=nan, vf_loss=nan).')
        return real(b, *args, **kwargs)
    monkeypatch.setattr(trainer, 'ppo_update', nan_at_step_2)
    cfg = Config.from_args(run_args(tiny_dir, tmp_path, 'nan', 'TOTAL_STEPS=3', 'SAVE_FREQ=1', 'TEST_FREQ=0', 'KL_COEF=0'))
    out = train(cfg, progress=False)
    assert out['steps'] == 1 and 'step 2' in out['error'] and out['checkpoint'].endswith('global_step_1')
    assert [r['step'] for r in read_metrics(out['run'])] == [1]
    assert sorted(p.name for p in Path(out['run']).iterdir()) == ['curves.png', 'global_step_1', 'metrics.jsonl', 'run.json']
    assert json.loads((Path(out['run'])/'run.json').read_text())['sessions'][0]['status'] == 'failed'
    assert train_main(run_args(tiny_dir, tmp_path, 'nan', 'TOTAL_STEPS=3', 'SAVE_FREQ=1', 'TEST_FREQ=0', 'KL_COEF=0',
                               'RESUME=True')) == 1


def test_a_broken_wandb_warns_and_the_run_goes_on(tiny_dir, tmp_path, monkeypatch):
    class Broken:
        def init(self, **kwargs): raise RuntimeError('no wandb here')
    monkeypatch.setitem(sys.modules, 'wandb', Broken())
    cfg = Config.from_args(run_args(tiny_dir, tmp_path, 'wb', 'TOTAL_STEPS=1', 'SAVE_FREQ=0', 'TEST_FREQ=0', 'LOG_MODE=wandb'))
    with pytest.warns(UserWarning, match='wandb did not start'): out = train(cfg, progress=False)
    assert out['error'] is None and len(read_metrics(out['run'])) == 1


def test_log_images_draws_the_chosen_steps_and_keeps_their_rollouts(tiny_dir, tmp_path):
    args = run_args(tiny_dir, tmp_path, 'img', 'TOTAL_STEPS=2', 'SAVE_FREQ=0', 'TEST_FREQ=1', 'logging.log_images=True',
                    f'logging.log_image_dir={tmp_path/"images"}', 'logging.log_image_step_size=2',
                    'logging.log_n_image_per_batch=1')
    assert train_main(args) == 0
    drawn = sorted(p.name for p in (tmp_path/'images'/'img').iterdir())   # step 2 only, one trajectory
    assert drawn[0] == 'step_000002.pdf' and drawn[1].startswith('step_000002_traj_0_seed_') and len(drawn) == 2
    records = read_records(tmp_path/'img'/'rollouts.jsonl')
    assert [r['step'] for r in records] == [2] and len(records[0]['trajectory'].ids) > 0
    assert (tmp_path/'img'/'curves.png').stat().st_size > 10_000
