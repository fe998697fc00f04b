"The `ragen_nb` command: help that helps, and `eval` end to end on a small saved model."
import json, re, subprocess, sys
from pathlib import Path
import pytest
from ragen_nb.cli import parser
from ragen_nb.models import load_tokenizer, tiny_model


def run(*args):
    return subprocess.run([sys.executable, '-m', 'ragen_nb.cli', *args], capture_output=True, text=True, timeout=600)


def test_help_lists_options_with_defaults():
    r = run('data', '--help')
    assert r.returncode == 0 and 'SEARCH_DEPTH' in r.stdout and '(default:' in r.stdout


def test_eval_help_lists_every_setting_with_its_default():
    r = run('eval', '--help')
    assert r.returncode == 0 and r.stdout.startswith('ragen_nb eval KEY=value')
    for key in ('MODEL=smollm2-135m', 'BASE=smollm2-135m', 'N=200', 'TEMPERATURES=0,0.5', 'SEARCH_DEPTH=30', 'MAX_RESPONSE_LENGTH=100',
                'THINK=False', 'OUTPUT='):
        assert key in r.stdout, key


def test_eval_prints_one_table_and_writes_json_and_its_session(tiny_dir, tmp_path):
    out = tmp_path/'eval.json'
    args = ['eval', f'MODEL={tiny_dir}', 'BASE=none', 'N=2', 'MAX_TURNS=2', 'MAX_RESPONSE_LENGTH=4', 'SEARCH_DEPTH=4',
            'TRAIN_ROOMS=5', 'SAMPLES=2', f'OUTPUT={out}']
    r = run(*args)
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
    assert saved['turn_budget'] == 2 and saved['seeds'] == [20000, 20001]
    # every setting that changes a score is kept: rooms, episode limits, prompt, temperatures, samples, engine
    assert {k: saved['settings'][k] for k in ('search_depth', 'max_turns', 'max_response_length', 'max_obs_length', 'think',
                                              'template', 'coordinates', 'temperatures', 'samples', 'rollout_engine', 'turn_cache',
                                              'chunk_size', 'model', 'base')} == dict(
        search_depth=4, max_turns=2, max_response_length=4, max_obs_length=120, think=False, template='qwen-instruct',
        coordinates=False, temperatures='0,0.5', samples=2, rollout_engine='hf', turn_cache=False, chunk_size=32,
        model=str(tiny_dir), base='none')
    session = json.loads((tmp_path/'run.json').read_text())['sessions'][-1]   # the command's own record, beside its output
    assert session['argv'] == ['ragen_nb', *args] and session['kind'] == 'eval' and session['status'] == 'done'
    assert session['settings'] == saved['settings'] and session['peak_rss_gb'] > 0.1 and session['wall_s'] > 0
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


def test_eval_of_a_thinking_model_reports_its_thoughts(tiny_dir, tmp_path):
    "THINK=True: each model row carries the think/ metrics of 13 (the tiny model never closes a thought: format 0, the budget hit)."
    out = tmp_path/'eval.json'
    r = run('eval', f'MODEL={tiny_dir}', 'BASE=none', 'N=2', 'MAX_TURNS=1', 'MAX_RESPONSE_LENGTH=6', 'SEARCH_DEPTH=4', 'TRAIN_ROOMS=5',
            'TEMPERATURES=0', 'THINK=True', f'OUTPUT={out}')
    assert r.returncode == 0, r.stderr
    row = json.loads(out.read_text())['rows'][0]
    assert len(row['thoughts']) == 2 and row['policy'] == 'model greedy' and row['think/format'] == 0 and row['think/budget_hit'] == 1 and row['think/tokens'] > 0


def test_eval_rollouts_keeps_the_greedy_episodes_of_the_judged_model_only(tiny_dir, tmp_path):
    "ROLLOUTS=path: one greedy episode per held-out room, in the table's room order, readable by the widget's reader; never appended to."
    from ragen_nb.evaluate import heldout_seeds
    from ragen_nb.viz import read_rollouts
    path = tmp_path/'rollouts.jsonl'
    args = ['eval', f'MODEL={tiny_dir}', 'BASE=none', 'N=3', 'MAX_TURNS=2', 'MAX_RESPONSE_LENGTH=4',
            'SEARCH_DEPTH=4', 'TRAIN_ROOMS=5', 'TEMPERATURES=0,1', 'SAMPLES=2', f'ROLLOUTS={path}']
    r = run(*args)
    assert r.returncode == 0, r.stderr
    episodes = read_rollouts(path)
    assert [t.seed for t in episodes] == list(heldout_seeds(3))     # greedy only: one per room, not the 2 samples at T=1
    assert all(len(t.actions) >= 1 and t.room for t in episodes)
    again = run(*args)
    assert again.returncode == 2 and 'the file exists' in again.stderr and len(read_rollouts(path)) == 3


def test_eval_takes_room_settings_from_the_environment(monkeypatch):
    import ragen_nb.cli as cli
    seen = []
    monkeypatch.setattr(cli, 'eval_rows', lambda cfg, **k: seen.append(cfg.env_settings) or cli.baselines(cfg.env_settings, 2, 2, 5))
    monkeypatch.setenv('SEARCH_DEPTH', '4'); monkeypatch.setenv('MAX_STEPS', '3')
    assert cli.main(['eval', 'N=2', 'MAX_TURNS=2']) == 0
    assert cli.main(['eval', 'N=2', 'MAX_TURNS=2', 'SEARCH_DEPTH=5']) == 0     # an argument beats the env
    assert [(s.search_depth, s.max_steps) for s in seen] == [(4, 3), (5, 3)]


@pytest.mark.parametrize('args,message', [
    (['N=0'], 'n=0'), (['TEMPERATURES=-1'], 'temperatures >= 0'), (['SAMPLES=0'], 'samples=0'),
    (['MAX_TURNS=9', 'MAX_STEPS=20'], 'lower MAX_TURNS'), (['SEARCH_DEPTH=2'], 'search_depth=2'),
    (['TRAIN_ROOMS=0'], 'train_rooms=0'), (['OUTPUT=/nonexistent/x.json'], 'no folder /nonexistent'),
    (['DATA_DIR=/nonexistent'], 'does not exist'), (['--n', '2'], 'is not KEY=value'), (['NN=2'], "unknown setting 'NN'"),
    (['MODEL=/nonexistent/model'], 'no model folder')])
def test_eval_bad_arguments_fail_before_any_model_loads(args, message, monkeypatch, capsys):
    import ragen_nb.cli as cli
    monkeypatch.setattr(cli, 'load_policy', lambda *a, **k: pytest.fail('a model was loaded'))
    monkeypatch.setattr(cli, 'load_tokenizer', lambda *a, **k: pytest.fail('a tokenizer was loaded'))
    assert cli.main(['eval', 'BASE=none', *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('ragen_nb eval: error: ') and message in err[0]


def test_eval_coordinates_reach_the_rollout_and_the_json(tmp_path, monkeypatch):
    import ragen_nb.cli as cli
    seen = []
    monkeypatch.setattr(cli, '_engine', lambda name, kind, turn_cache=False, bf16=False: (None, None))
    monkeypatch.setattr(cli, 'model_rows', lambda engine, tok, seeds, settings, cfg, *a: seen.append(cfg) or [])
    for flag in ([], ['COORDINATES=True']):
        out = tmp_path/f'eval{len(flag)}.json'
        assert cli.main(['eval', 'BASE=none', 'N=2', 'MAX_TURNS=2', 'SEARCH_DEPTH=4', 'TRAIN_ROOMS=5', f'OUTPUT={out}', *flag]) == 0
        assert json.loads(out.read_text())['settings']['coordinates'] is bool(flag)
    assert [cfg.coordinates for cfg in seen] == [False, True]


def test_an_eval_interrupted_or_failing_mid_play_closes_its_session(tmp_path, monkeypatch):
    "Ctrl-C while the rooms are played leaves the session 'stopped', an error in them 'failed': never 'running' after the process ends."
    import ragen_nb.cli as cli
    def interrupted(cfg, plan): raise KeyboardInterrupt
    def broken(cfg, plan): raise OSError('disk full')
    args = ['eval', 'BASE=none', 'N=2', 'MAX_TURNS=2', 'SEARCH_DEPTH=4', 'TRAIN_ROOMS=5', f'OUTPUT={tmp_path/"eval.json"}']
    monkeypatch.setattr(cli, 'eval_rows', interrupted)
    with pytest.raises(KeyboardInterrupt): cli.main(args)
    monkeypatch.setattr(cli, 'eval_rows', broken)
    assert cli.main(args) == 2
    sessions = json.loads((tmp_path/'run.json').read_text())['sessions']
    assert [s['status'] for s in sessions] == ['stopped', 'failed'] and not (tmp_path/'eval.json').exists()


def test_eval_data_with_too_few_rooms_names_the_fix(tmp_path):
    from ragen_nb.cli import EvalSettings, eval_plan, main
    main(['data', '--output', str(tmp_path), '--train_size', '3', '--test_size', '2'])
    assert eval_plan(EvalSettings(n=2, data_dir=str(tmp_path)))['seeds'] == [10003, 10004]
    with pytest.raises(ValueError, match=r'holds 2 rooms, fewer than the 5 asked.*--test_size 5'):
        eval_plan(EvalSettings(n=5, data_dir=str(tmp_path)))


def test_train_cpu_is_train_with_the_main_job_settings_first(tmp_path, monkeypatch):
    import ragen_nb.cli as cli
    from ragen_nb.config import Config, RECIPES
    seen, judged, exit_code = [], [], 0
    monkeypatch.setattr(cli, 'train_main', lambda argv, command: seen.append(argv) or exit_code)
    monkeypatch.setattr(cli, 'recipe_eval', lambda argv, command: judged.append(argv) or 0)
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


def test_recipe_eval_judges_the_last_checkpoint_beside_the_baselines_in_its_own_episodes(tmp_path, capsys):
    import ragen_nb.cli as cli
    from ragen_nb.config import Config
    from ragen_nb.evaluate import heldout_seeds
    from ragen_nb.models import load_tokenizer, tiny_model
    from ragen_nb.trainer import train
    tok = load_tokenizer(); tiny_model(tok).save_pretrained(tmp_path/'tiny'); tok.save_pretrained(tmp_path/'tiny')
    argv = ['RECIPE=main-job', f'BASE_MODEL={tmp_path/"tiny"}', f'OUTPUT_DIR={tmp_path}', 'TRAIN_BATCH_SIZE=4', 'PPO_BATCH_SIZE=4',
                           'TOTAL_STEPS=2', 'SAVE_FREQ=1', 'TEST_FREQ=0', 'KEEP_BEST=False', 'LOG_IMAGES=False', 'EVAL_ROOMS=3']
    assert cli.recipe_eval(argv) == 0 and 'no checkpoint' in capsys.readouterr().err   # nothing trained yet
    train(Config.from_args(argv), progress=False)
    assert cli.recipe_eval(argv, ['ragen_nb', 'train-cpu', *argv]) == 0
    out = capsys.readouterr().out
    run = tmp_path/'cpu-smollm2-135m'
    table = json.loads((run/'eval.json').read_text())
    assert Path(table['settings']['model']).name == 'global_step_2'          # the last checkpoint
    # judged on the episodes the run trained on, though the eval was not told them: the recipe's rooms, turns and replies
    job = Config.from_args(argv)
    assert {k: table['settings'][k] for k in ('search_depth', 'max_turns', 'max_response_length')} == \
        {'search_depth': job.search_depth, 'max_turns': job.max_turns, 'max_response_length': job.max_response_length} == \
        {'search_depth': 4, 'max_turns': 2, 'max_response_length': 8}
    assert table['seeds'] == heldout_seeds(3, None, job.env_settings) and table['turn_budget'] == 2
    assert [r['policy'] for r in table['rows']] == ['model greedy', 'model T=0.5', 'base greedy', 'uniform random',
                                                    'best fixed sequence', 'BFS optimum']
    assert all(r['rooms'] == 3 for r in table['rows']) and 'BFS optimum' in out
    assert all(len(r['per_room']) == 3 for r in table['rows'][:3]) and 'model greedy - base greedy:' in out   # room by room
    assert table['rows'][1]['episodes'] == 6 and table['settings']['base'] == str(tmp_path/'tiny')   # 2 samples per room
    sessions = json.loads((run/'run.json').read_text())['sessions']          # the run's record, then its eval's
    assert [s['kind'] for s in sessions] == ['train', 'eval'] and sessions[1]['argv'] == ['ragen_nb', 'train-cpu', *argv]
    from ragen_nb.cli import main
    main(['data', '--output', str(tmp_path/'rooms'), '--train_size', '3', '--test_size', '2'])   # 2 test rooms, 3 asked
    capsys.readouterr()
    (run/'global_step_2'/'settings.json').write_text(json.dumps({**json.loads((run/'global_step_2'/'settings.json').read_text()),
                                                                 'data_dir': str(tmp_path/'rooms'), 'search_depth': 30}))
    assert cli.recipe_eval(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith('ragen_nb eval: error:') and '--test_size 3' in err[0]
    assert err[1].startswith('error:') and 'global_step_2 is saved' in err[1]


def test_recipe_eval_judges_the_checkpoint_validation_preferred(tmp_path, monkeypatch):
    import ragen_nb.cli as cli
    from ragen_nb.checkpoint import BEST_FILE
    judged = []
    monkeypatch.setattr(cli, 'eval_main', lambda args, command: judged.append(args[0]) or 0)
    monkeypatch.setattr(cli, 'latest_checkpoint', lambda run: run/'global_step_4')
    run = tmp_path/'cpu-smollm2-135m'
    monkeypatch.setattr(cli, 'best_checkpoint', lambda r: run/'global_step_2' if (r/BEST_FILE).exists() else None)
    run.mkdir(); argv = ['RECIPE=main-job', f'OUTPUT_DIR={tmp_path}']
    cli.recipe_eval(argv + ['KEEP_BEST=True']); (run/BEST_FILE).write_text('{"step": 2}')
    cli.recipe_eval(argv + ['KEEP_BEST=True']); cli.recipe_eval(argv + ['KEEP_BEST=False'])
    assert judged == [f'MODEL={run}/global_step_4', f'MODEL={run}/global_step_2', f'MODEL={run}/global_step_4']
