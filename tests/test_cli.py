"The `ragen_nb` command: help that helps, and `eval` end to end on a small saved model."
import subprocess, sys
import pytest
from ragen_nb.cli import parser
from ragen_nb.models import load_tokenizer, tiny_model


def run(*args):
    return subprocess.run([sys.executable, '-m', 'ragen_nb.cli', *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize('command', ['data', 'eval'])
def test_help_lists_options_with_defaults(command):
    r = run(command, '--help')
    assert r.returncode == 0
    assert 'SEARCH_DEPTH' in r.stdout and '(default:' in r.stdout


def test_bad_arguments_exit_with_a_message():
    r = run('data', '--prefix', 'chatml')
    assert r.returncode == 2 and "invalid choice: 'chatml'" in r.stderr
    with pytest.raises(SystemExit): parser().parse_args([])


def test_eval_prints_a_table_for_a_saved_model(tmp_path):
    tok = load_tokenizer()
    tiny_model(tok).save_pretrained(tmp_path/'tiny'); tok.save_pretrained(tmp_path/'tiny')
    r = run('eval', '--model', str(tmp_path/'tiny'), '--n', '2', '--max_turns', '2', '--max_response_length', '4')
    assert r.returncode == 0, r.stderr
    header, rule, *rows = r.stdout.strip().splitlines()[-4:]
    assert header.split() == ['template', 'rooms', 'success_rate', 'valid_action_rate', 'mean_reward', 'mean_turns', 'seconds']
    assert [row.split()[:2] for row in rows] == [['qwen-instruct', '2'], ['base', '2']]
    # a random model never answers with an action, so every turn of every room is played and penalised
    assert [row.split()[3:6] for row in rows] == [['0.000', '-0.200', '2.000']] * 2


def test_train_cpu_is_train_with_the_main_job_settings_first(tmp_path, monkeypatch):
    import ragen_nb.cli as cli
    import ragen_nb.trainer as trainer
    seen = []
    monkeypatch.setattr(trainer, 'train_main', lambda argv: seen.append(argv) or 0)
    assert cli.main(['train-cpu', 'TOTAL_STEPS=3']) == 0 and cli.main(['train', 'TOTAL_STEPS=3']) == 0
    assert seen == [cli.MAIN_JOB + ['TOTAL_STEPS=3'], ['TOTAL_STEPS=3']]
    cfg = trainer.Config.from_args(seen[0])                                  # valid, and the user's setting wins
    assert cfg.total_steps == 3 and cfg.lora_rank > 0 and cfg.critic == 'shared'


def test_train_cpu_help_shows_its_settings_and_every_key():
    r = run('train-cpu', '--help')
    assert r.returncode == 0 and 'LORA_RANK=16' in r.stdout and 'TRAIN_BATCH_SIZE=128' in r.stdout
