"The `ragen_nb` command: help that helps, and `eval` end to end on a small saved model."
import json, re, subprocess, sys
from pathlib import Path
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


@pytest.fixture(scope='module')
def tiny_folder(tmp_path_factory):
    "A small random model saved with the embedded tokenizer: it loads in a second and never answers with an action."
    path = tmp_path_factory.mktemp('tiny')
    tok = load_tokenizer()
    tiny_model(tok).save_pretrained(path); tok.save_pretrained(path)
    return path


def test_eval_prints_one_table_and_writes_json(tiny_folder, tmp_path):
    out = tmp_path/'eval.json'
    r = run('eval', '--model', str(tiny_folder), '--no-base', '--n', '2', '--max_turns', '2', '--max_response_length', '4',
            '--search_depth', '4', '--train_rooms', '5', '--samples', '2', '--json', str(out))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith('policy '))
    header, rule, *rows = lines[start:start + 7]
    # then a blank line, the same rows by shortest solution, a blank line, each model row's moves by turn, and the footer
    footer, policies = lines[-1], [row.split('  ')[0].strip() for row in rows]
    assert lines[start + 7] == '' and lines[start + 8].startswith('shortest solution')
    assert [l.split('  ')[0].strip() for l in lines[start + 10:start + 15]] == policies and lines[start + 15] == ''
    moves = lines[start + 16:-1]
    assert [l.split(':')[0] for l in moves if not l.startswith(' ')] == ['model greedy', 'model T=0.5']
    assert len(moves) == 2 * (1 + 2)                                       # a header and one line per turn, for each model row
    assert header.split()[:6] == ['policy', 'rooms', 'episodes', 'success', '95%', 'interval']
    assert [row.split('  ')[0].strip() for row in rows] == ['model greedy', 'model T=0.5', 'uniform random',
                                                           'best fixed sequence', 'BFS optimum']
    # a random model never answers with an action: nothing solved, no valid turn, both turns played, episodes per room
    model = [row.split() for row in rows[:2]]
    assert [m[2:5] for m in model] == [['2', '2', '0.000'], ['2', '4', '0.000']]
    assert [m[6:8] for m in model] == [['0.000', '2.00']] * 2
    assert 'solve(max_depth=2)' in rows[-1] and footer.startswith('2 held-out rooms')
    saved = json.loads(out.read_text())
    assert saved['settings']['search_depth'] == 4 and saved['turn_budget'] == 2 and saved['seeds'] == [20000, 20001]
    assert [row['policy'] for row in saved['rows']] == ['model greedy', 'model T=0.5', 'uniform random',
                                                       'best fixed sequence', 'BFS optimum']
    assert saved['rows'][2]['mi'] is None                                    # nan is written as null
    assert saved['rows'][0]['success_low'] == 0.0 and saved['rows'][0]['success_high'] > 0.5   # Wilson on 0 of 2
    rooms = {k: v['rooms'] for k, v in saved['rows'][-1]['by_length'].items()}
    assert sum(rooms.values()) == 2 and set(rooms) <= {'1', '2', 'none'}    # every room once, by its shortest solution (2 turns)
    for row in saved['rows']: assert {k: v['rooms'] for k, v in row['by_length'].items()} == rooms   # the same rooms in every row
    assert all(v['success_rate'] == float(k != 'none') for k, v in saved['rows'][-1]['by_length'].items())   # BFS solves all it can
    assert all(v['success_rate'] == 0 for row in saved['rows'][:2] for v in row['by_length'].values())
    for row, episodes in zip(saved['rows'][:2], (2, 4)):                    # the model's moves, turn by turn: never an action
        assert [m['turn'] for m in row['moves']] == [1, 2] and all(m['answers'] == episodes for m in row['moves'])
        assert all(m['optimal'] == m['no_effect'] == 0 and m['no_action'] == (1.0 if m['solvable'] else 0.0) for m in row['moves'])
    assert not any('moves' in row for row in saved['rows'][2:])              # the baselines have no moves


def test_eval_takes_room_settings_from_the_environment(tiny_folder, tmp_path, monkeypatch):
    import ragen_nb.cli as cli
    seen = []
    monkeypatch.setattr(cli, 'evaluate', lambda *a, **k: seen.append(a[4]) or cli.baselines(a[4], 2, 2, 5))
    monkeypatch.setenv('SEARCH_DEPTH', '4'); monkeypatch.setenv('MAX_STEPS', '3')
    assert cli.main(['eval', '--n', '2', '--max_turns', '2']) == 0
    assert cli.main(['eval', '--n', '2', '--max_turns', '2', '--search_depth', '5']) == 0     # an option beats the env
    assert [(s.search_depth, s.max_steps) for s in seen] == [(4, 3), (5, 3)]


@pytest.mark.parametrize('args,message', [
    (['--n', '0'], '--n 0'), (['--temperatures', '-1'], 'temperatures >= 0'), (['--samples', '0'], '--samples 0'),
    (['--max_turns', '9', '--max_steps', '20'], 'lower --max_turns'), (['--search_depth', '2'], 'search_depth=2'),
    (['--train_rooms', '0'], '--train_rooms 0'), (['--json', '/nonexistent/x.json'], 'no folder /nonexistent'),
    (['--data', '/nonexistent'], 'does not exist')])
def test_eval_bad_arguments_fail_before_any_model_loads(args, message, monkeypatch, capsys):
    import ragen_nb.cli as cli
    monkeypatch.setattr(cli, 'load_model', lambda *a, **k: pytest.fail('a model was loaded'))
    monkeypatch.setattr(cli, 'load_tokenizer', lambda *a, **k: pytest.fail('a tokenizer was loaded'))
    assert cli.main(['eval', '--no-base', *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('ragen_nb eval: error: ') and message in err[0]


def test_eval_coordinates_reach_the_rollout_and_the_json(tmp_path, monkeypatch):
    import ragen_nb.cli as cli
    seen = []
    monkeypatch.setattr(cli, '_engine', lambda name, kind, turn_cache=False: (None, None))
    monkeypatch.setattr(cli, 'model_rows', lambda engine, tok, seeds, settings, cfg, *a: seen.append(cfg) or [])
    for flag in ([], ['--coordinates']):
        out = tmp_path/f'eval{len(flag)}.json'
        assert cli.main(['eval', '--no-base', '--n', '2', '--max_turns', '2', '--search_depth', '4', '--train_rooms', '5',
                         '--json', str(out), *flag]) == 0
        assert json.loads(out.read_text())['coordinates'] is bool(flag)
    assert [cfg.coordinates for cfg in seen] == [False, True]


def test_eval_data_with_too_few_rooms_names_the_fix(tmp_path):
    from ragen_nb.cli import eval_plan, main
    main(['data', '--output', str(tmp_path), '--train_size', '3', '--test_size', '2'])
    assert eval_plan(n=2, data=str(tmp_path))['seeds'] == [10003, 10004]
    with pytest.raises(ValueError, match=r'holds 2 rooms, fewer than the 5 asked.*--test_size 5'):
        eval_plan(n=5, data=str(tmp_path))


def test_train_cpu_is_train_with_the_main_job_settings_first(tmp_path, monkeypatch):
    import ragen_nb.cli as cli
    from ragen_nb.config import Config, RECIPES
    seen, judged, exit_code = [], [], 0
    monkeypatch.setattr(cli, 'train_main', lambda argv: seen.append(argv) or exit_code)
    monkeypatch.setattr(cli, 'recipe_eval', lambda argv: judged.append(argv) or 0)
    assert not hasattr(cli, 'MAIN_JOB') and not hasattr(cli, 'main_job_eval')   # the main job is a recipe now
    assert cli.main(['train-cpu', 'TOTAL_STEPS=3']) == 0 and cli.main(['train', 'TOTAL_STEPS=3']) == 0
    assert seen == [['RECIPE=main-job', 'TOTAL_STEPS=3'], ['TOTAL_STEPS=3']]
    assert judged == [['RECIPE=main-job', 'TOTAL_STEPS=3']]                 # train-cpu ends with the eval table; train does not
    assert cli.main(['train-cpu', 'RECIPE=ragen-v1-ppo', 'TOTAL_STEPS=3']) == 0   # another recipe named: nothing prepended
    assert seen[-1] == judged[-1] == ['RECIPE=ragen-v1-ppo', 'TOTAL_STEPS=3']
    exit_code = 1                                                            # a run stopped on a non-finite step: no eval
    assert cli.main(['train-cpu']) == 1 and len(judged) == 2 and seen[-1] == ['RECIPE=main-job']
    cfg = Config.from_args(seen[0])                                          # valid, and the user's setting wins
    assert cfg.total_steps == 3 and cfg.lora_rank > 0 and cfg.adv_estimator == 'maxrl' and cfg.critic_free
    assert cfg == Config.from_args(RECIPES['main-job'] + ['TOTAL_STEPS=3'])  # RECIPE=main-job stands for the recipe's settings
    assert Config.from_args(['RECIPE=main-job']).total_steps == 30 and 'TOTAL_STEPS=30' in RECIPES['main-job']
    assert Config.from_args(['TOTAL_STEPS=3', 'RECIPE=main-job']).total_steps == 30   # later settings override earlier ones
    with pytest.raises(ValueError, match=re.escape(f"RECIPE='main_job': known recipes are {', '.join(RECIPES)}")):
        Config.from_args(['RECIPE=main_job'])


def test_train_cpu_help_shows_its_settings_and_every_key():
    r = run('train-cpu', '--help')
    assert r.returncode == 0 and 'LORA_RANK=16' in r.stdout and 'TRAIN_BATCH_SIZE=128' in r.stdout


def test_recipe_eval_judges_the_last_checkpoint_beside_the_baselines(tmp_path, capsys):
    import ragen_nb.cli as cli
    from ragen_nb.config import Config
    from ragen_nb.evaluate import heldout_seeds
    from ragen_nb.models import load_tokenizer, tiny_model
    from ragen_nb.trainer import train
    tok = load_tokenizer(); tiny_model(tok).save_pretrained(tmp_path/'tiny'); tok.save_pretrained(tmp_path/'tiny')
    argv = ['RECIPE=main-job', f'BASE_MODEL={tmp_path/"tiny"}', f'OUTPUT_DIR={tmp_path}', 'TRAIN_BATCH_SIZE=4', 'PPO_BATCH_SIZE=4',
                           'TOTAL_STEPS=2', 'SAVE_FREQ=1', 'TEST_FREQ=0', 'LOG_IMAGES=False']
    assert cli.recipe_eval(argv, n=3) == 0 and 'no checkpoint' in capsys.readouterr().err   # nothing trained yet
    train(Config.from_args(argv), progress=False)
    assert cli.recipe_eval(argv, n=3) == 0
    out = capsys.readouterr().out
    table = json.loads((tmp_path/'cpu-smollm2-135m'/'eval.json').read_text())
    assert Path(table['model']).name == 'global_step_2'                      # the last checkpoint
    assert table['seeds'] == heldout_seeds(3, None, Config.from_args(argv).env_settings) and table['turn_budget'] == 2
    assert [r['policy'] for r in table['rows']] == ['model greedy', 'model T=0.5', 'base greedy', 'uniform random',
                                                    'best fixed sequence', 'BFS optimum']
    assert all(r['rooms'] == 3 for r in table['rows']) and 'BFS optimum' in out
    assert all(len(r['per_room']) == 3 for r in table['rows'][:3]) and 'model greedy - base greedy:' in out   # room by room
    assert table['rows'][1]['episodes'] == 6 and table['base'] == str(tmp_path/'tiny')   # 2 samples per room: the MI has pairs
    from ragen_nb.cli import main
    main(['data', '--output', str(tmp_path/'rooms'), '--train_size', '3', '--test_size', '2'])   # 2 test rooms, 3 asked
    capsys.readouterr()
    assert cli.recipe_eval(argv + [f'DATA_DIR={tmp_path/"rooms"}', 'SEARCH_DEPTH=30'], n=3) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('error:') and 'global_step_2 is saved' in err[0] and '--test_size 3' in err[0]
