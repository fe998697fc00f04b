"The tables of results are rendered from the kept run folders: `runs_table` on made-up runs, and the README's tables against it."
import dataclasses, json, re
from pathlib import Path

import pytest

from ragen_nb.results import RUNS, SCORE_SETTINGS, baselines_table, eval_settings, keep_run, kept_runs, markdown, read_run, runs_table
from ragen_nb.runlog import RunRecord

ROOT = Path(__file__).resolve().parents[1]

def made_up(root: Path, name: str, greedy: tuple, sampled: tuple | None, lengths: dict, reply: int = 8):
    "A run folder as train-cpu leaves it (run.json written by the program, metrics.jsonl, eval.json with absolute checkpoint paths), kept."
    def row(policy, s):
        return dict(policy=policy, rooms=200, success_rate=s[0], success_low=s[1], success_high=s[2], mi=0.9, mi_null=0.4, mi_null_std=0.05,
                    by_length={str(k): dict(rooms=n, success_rate=p) for k, (n, p) in lengths.items()})
    out = root/'out'; source = out/name
    RunRecord(source, 'train', ['ragen_nb', 'train-cpu', f'OUTPUT_DIR={out}'], dict(output_dir=str(out))).close()
    rows = [row('model greedy', greedy)] + ([row('model T=0.5', sampled)] if sampled else []) + [
        dict(policy='uniform random', success_rate=0.2, success_low=0.15, success_high=0.26, note='exact'),
        dict(policy='BFS optimum', success_rate=0.865, success_low=0.811, success_high=0.906, note='solve(max_depth=5)')]
    settings = dict(model=str(source/'global_step_30'), n=200, search_depth=30, max_turns=5, max_response_length=reply)
    (source/'eval.json').write_text(json.dumps(dict(settings=settings, rows=rows)))
    (source/'metrics.jsonl').write_text('{"step": 0, "val/success_rate": 0.1}\n{"step": 1, "train/success_rate": 0.5}\n')
    (source/'rollouts.jsonl').write_text('{"step": 1}\n')
    return keep_run(source, name, 'a test', runs=root/'runs', extra=('rollouts.jsonl',))

def test_runs_table_renders_what_the_folders_hold(tmp_path):
    made_up(tmp_path, 'b-run', (0.8, 0.74, 0.85), (0.75, 0.7, 0.8), {1: (100, 0.9), 2: (50, 0.8), 4: (30, 0.5), 5: (20, 0.25)})
    made_up(tmp_path, 'a-run', (0.5, 0.43, 0.57), None, {1: (100, 0.7), 'none': (10, 0.0)})
    runs = kept_runs(tmp_path/'runs')
    assert list(runs) == ['a-run', 'b-run']                           # in name order
    rows = runs_table(runs, ['b-run', 'a-run'])                       # or in the order asked
    assert [r['run'] for r in rows] == ['b-run', 'a-run']
    assert rows[0]['greedy'] == '0.800 (0.740-0.850)' and rows[0]['T=0.5'] == '0.750 (0.700-0.800)'
    assert rows[0]['MI vs null'] == '0.90 vs 0.40 ± 0.05'
    assert rows[0]['3+ moves, greedy'] == f'{(30 * 0.5 + 20 * 0.25) / 50:.3f} of 50'
    assert rows[1]['3+ moves, greedy'] == 'none' and rows[1]['T=0.5'] == ''
    assert [r['record'] for r in rows] == ['program', 'program'] and rows[0]['command'] == 'ragen_nb train-cpu OUTPUT_DIR=.'
    wall, peak = runs['b-run']['wall_s'], runs['b-run']['peak_rss_gb']   # what the process measured, not typed
    assert rows[0]['wall min'] == (f'{wall / 60:.1f}' if wall else '') and rows[0]['peak GB'] == f'{peak:.1f}' and peak > 0.1
    assert [r['run'] for r in baselines_table(runs['b-run'])] == ['uniform random actions', 'BFS']
    assert (tmp_path/'runs'/'b-run'/'rollouts.jsonl').exists()        # an extra file asked for is kept too
    assert json.loads((tmp_path/'runs'/'b-run'/'run.json').read_text())['kept'] == dict(name='b-run', purpose='a test')
    table = markdown(rows, ['run', 'greedy'])
    assert table.splitlines() == ['| run | greedy |', '| --- | --- |', '| b-run | 0.800 (0.740-0.850) |', '| a-run | 0.500 (0.430-0.570) |']

def test_the_table_refuses_runs_judged_with_different_reply_budgets_unless_told_and_then_says_so(tmp_path):
    made_up(tmp_path, 'eight', (0.8, 0.74, 0.85), None, {1: (100, 0.9)}, reply=8)
    made_up(tmp_path, 'long', (0.5, 0.43, 0.57), None, {1: (100, 0.7)}, reply=24)
    made_up(tmp_path, 'also-eight', (0.6, 0.53, 0.67), None, {1: (100, 0.7)}, reply=8)
    runs = kept_runs(tmp_path/'runs')
    assert eval_settings(runs['long'])['max_response_length'] == 24 and set(eval_settings(runs['long'])) == set(SCORE_SETTINGS)
    with pytest.raises(ValueError, match='eight, long were not all judged alike .max_response_length differ.'):
        runs_table(runs, ['eight', 'long'])
    assert [r['judged with'] for r in runs_table(runs, ['eight', 'long'], mixed=True)] == ['MAX_RESPONSE_LENGTH=8', 'MAX_RESPONSE_LENGTH=24']
    assert [r['judged with'] for r in runs_table(runs, ['eight', 'also-eight'])] == ['', '']   # judged alike: nothing to say

def test_kept_runs_name_no_path_of_the_machine_they_ran_on(tmp_path):
    made_up(tmp_path, 'r', (0.8, 0.74, 0.85), None, {1: (10, 1.0)})
    run = read_run(tmp_path/'runs'/'r')
    assert run['eval_info']['settings']['model'] == 'r/global_step_30' and run['sessions'][0]['settings']['output_dir'] == '.'
    for folder in RUNS.iterdir():
        for f in folder.glob('*.json*'):
            text = f.read_text()
            assert not re.search(r'/(tmp|work|home|root|Users)/', text), f'{f} names a path of the machine it ran on'

def test_keeping_needs_a_run_the_program_recorded(tmp_path):
    (tmp_path/'bare').mkdir(); (tmp_path/'bare'/'metrics.jsonl').write_text('{"step": 1}\n')
    with pytest.raises(FileNotFoundError, match='holds no run.json'): keep_run(tmp_path/'bare', 'bare', 'x', runs=tmp_path/'runs')

def test_every_kept_run_says_how_it_was_made():
    runs = kept_runs()
    assert runs, 'no kept runs in data/runs'
    for name, run in runs.items():
        assert run['name'] == name and run['command'] and run['commit'] and run['machine'] and run['purpose'], name
        assert run['eval'] or run['metrics'], f'{name} holds neither eval.json nor metrics.jsonl'
        assert run['record'] == 'program' or run['provenance'].startswith('typed by hand'), name   # a hand record says so
        if run['eval']: assert 'max_response_length' in run['eval_info']['settings'], f'{name}: its eval settings are not recorded'

def test_the_readme_tables_are_the_results_tables():
    "Each results table of the README is `markdown(runs_table(...))` of the kept runs, as 22_results prints it."
    readme = (ROOT/'README.md').read_text()
    runs = kept_runs()
    tables = re.findall(r'((?:^\|.*\|$\n?)+)', readme, re.M)
    results = [t for t in tables if t.startswith('| run |')]
    assert results, 'the README shows no table of runs'
    for table in results:
        lines = table.strip().splitlines()
        columns = [c.strip() for c in lines[0].strip('|').split('|')]
        names = [l.strip('|').split('|')[0].strip() for l in lines[2:]]
        kept = [n for n in names if n in runs]
        base = [n for n in names if n not in runs]
        rendered = runs_table(runs, kept, mixed='judged with' in columns)   # a table that mixes eval settings must say so
        if base:   # the baselines rows come from the first run's eval table
            rendered += [r for r in baselines_table(runs[kept[0]]) if r['run'] in base]
        assert table.strip() == markdown(rendered, columns), 'the README table differs from runs_table: paste 22_results\' output'


NAMED = re.compile(r'^(?P<recipe>.+?)(-from-sft)?(-gpu)?-seed\d+(-[\w-]+)?$')   # <recipe>[-from-sft][-gpu]-seed<N>[-<what>]

def recipe_mismatch(folder: Path) -> str | None:
    "Why the kept run in `folder`, named after a recipe, was not made by that recipe as it stands today; None when it was, or when its name names no recipe. A run the program recorded: its settings against the recipe's, beside what its command line set; a run recorded by hand: its `recipe` field."
    from ragen_nb.config import Config, RECIPES
    m = NAMED.match(folder.name)
    if not m or m['recipe'] not in RECIPES: return None
    name, run = m['recipe'], json.loads((folder/'run.json').read_text())
    if 'sessions' not in run: return None if run.get('recipe') == name else f"{folder.name}: recorded by hand with recipe {run.get('recipe')!r}"
    first = run['sessions'][0]
    given = dict(a.split('=', 1) for a in first['argv'] if '=' in a and not a.startswith('-'))
    used = given.pop('RECIPE', 'main-job' if 'train-cpu' in first['argv'] else None)
    if used != name: return f'{folder.name}: made by RECIPE={used}'
    today = Config.from_args([f'RECIPE={name}'])
    def keys_of(recipe): return {k for a in RECIPES[recipe] for k in ([a.split('=', 1)[0]] if not a.startswith('RECIPE=') else keys_of(a[7:]))}
    keys = keys_of(name) - set(given) - {'EXPERIMENT_NAME'}
    recorded = first['settings']
    differ = sorted(k for k in keys if recorded.get(k.lower()) != getattr(today, k.lower()))
    return ('; '.join(f'{folder.name}: {k}={recorded.get(k.lower())!r}, where RECIPE={name} now sets {getattr(today, k.lower())!r}' for k in differ)
            or None)


def test_every_run_named_after_a_recipe_was_made_by_it():
    "A kept folder called main-job-seed3 or ragen-6x6-first-gpu-seed1 holds a run of that recipe as the recipe stands today, so a reader who runs `RECIPE=<name>` gets what the folder shows."
    wrong = [w for f in sorted(RUNS.iterdir()) if f.is_dir() and (w := recipe_mismatch(f))]
    assert not wrong, 'runs named after a recipe that did not make them (rename them, or give their recipe its own name):\n' + '\n'.join(wrong)


def test_the_recipe_check_finds_a_run_of_another_recipe(tmp_path):
    "The check is not vacuous: a main-job run whose recorded settings differ from today's recipe, or made by another recipe, is found."
    def run(name, argv, **changed):
        from ragen_nb.config import Config
        settings = {**dataclasses.asdict(Config.from_args(['RECIPE=main-job'])), **changed}
        (tmp_path/name).mkdir(); (tmp_path/name/'run.json').write_text(json.dumps(dict(sessions=[dict(argv=argv, settings=settings)])))
        return recipe_mismatch(tmp_path/name)
    assert run('main-job-seed0', ['ragen_nb', 'train-cpu', 'SEED=0']) is None
    assert run('main-job-seed1', ['ragen_nb', 'train-cpu', 'SEED=1', 'ACTOR_LR=1e-4'], actor_lr=1e-4) is None   # set on its command line
    assert 'ROLLOUT_ENGINE' in run('main-job-seed2', ['ragen_nb', 'train-cpu'], rollout_engine='hf')
    assert 'RECIPE=ragen-6x6' in run('main-job-seed3', ['ragen_nb', 'train', 'RECIPE=ragen-6x6'])
    assert run('main-job-fp32-seed4', ['ragen_nb', 'train-cpu'], rollout_engine='hf') is None   # named after no recipe
