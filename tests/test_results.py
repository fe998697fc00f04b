"The tables of results are rendered from the kept run folders: `runs_table` on made-up runs, and the README's tables against it."
import json, re
from pathlib import Path

import pytest

from ragen_nb.results import RUNS, baselines_table, keep_run, kept_runs, markdown, read_run, runs_table, time_report

ROOT = Path(__file__).resolve().parents[1]

def made_up(root: Path, name: str, greedy: tuple, sampled: tuple | None, lengths: dict, wall: str = '32:00.80', rss_kb: int = 3574832):
    "A run folder as train-cpu leaves it (metrics.jsonl, eval.json with absolute checkpoint paths) and its /usr/bin/time -v report, kept."
    def row(policy, s):
        return dict(policy=policy, rooms=200, success_rate=s[0], success_low=s[1], success_high=s[2], mi=0.9, mi_null=0.4, mi_null_std=0.05,
                    by_length={str(k): dict(rooms=n, success_rate=p) for k, (n, p) in lengths.items()})
    source = root/'source'/name; source.mkdir(parents=True)
    rows = [row('model greedy', greedy)] + ([row('model T=0.5', sampled)] if sampled else []) + [
        dict(policy='uniform random', success_rate=0.2, success_low=0.15, success_high=0.26, note='exact'),
        dict(policy='BFS optimum', success_rate=0.865, success_low=0.811, success_high=0.906, note='solve(max_depth=5)')]
    (source/'eval.json').write_text(json.dumps(dict(model=f'/home/someone/checkpoints/{name}/global_step_30', rows=rows)))
    (source/'metrics.jsonl').write_text('{"step": 0, "val/success_rate": 0.1}\n{"step": 1, "train/success_rate": 0.5}\n')
    (root/f'{name}.time').write_text(f'\tCommand being timed: "ragen_nb train-cpu"\n\tUser time (seconds): 1.0\n'
                                     f'\tElapsed (wall clock) time (h:mm:ss or m:ss): {wall}\n\tMaximum resident set size (kbytes): {rss_kb}\n')
    return keep_run(source, name, 'ragen_nb train-cpu', 'abc1234', 'a 2-core CPU', 'a test', root/f'{name}.time', runs=root/'runs')

def test_time_report_reads_wall_time_and_peak_memory(tmp_path):
    (tmp_path/'t').write_text('\tCommand being timed: "x y"\n\tElapsed (wall clock) time (h:mm:ss or m:ss): 1:02:03\n'
                              '\tMaximum resident set size (kbytes): 1000000\n')
    assert time_report(tmp_path/'t') == dict(command='x y', wall_s=3723.0, peak_rss_gb=1.024)
    (tmp_path/'u').write_text('nothing here')
    with pytest.raises(ValueError, match='time -v'): time_report(tmp_path/'u')

def test_runs_table_renders_what_the_folders_hold(tmp_path):
    made_up(tmp_path, 'b-run', (0.8, 0.74, 0.85), (0.75, 0.7, 0.8), {1: (100, 0.9), 2: (50, 0.8), 4: (30, 0.5), 5: (20, 0.25)})
    made_up(tmp_path, 'a-run', (0.5, 0.43, 0.57), None, {1: (100, 0.7), 'none': (10, 0.0)}, wall='5:00.00', rss_kb=2000000)
    runs = kept_runs(tmp_path/'runs')
    assert list(runs) == ['a-run', 'b-run']                           # in name order
    rows = runs_table(runs, ['b-run', 'a-run'])                       # or in the order asked
    assert [r['run'] for r in rows] == ['b-run', 'a-run']
    assert rows[0]['greedy'] == '0.800 (0.740-0.850)' and rows[0]['T=0.5'] == '0.750 (0.700-0.800)'
    assert rows[0]['MI vs null'] == '0.90 vs 0.40 ± 0.05'
    assert rows[0]['3+ moves, greedy'] == f'{(30 * 0.5 + 20 * 0.25) / 50:.3f} of 50'
    assert rows[1]['3+ moves, greedy'] == 'none' and rows[1]['T=0.5'] == ''
    assert (rows[0]['wall min'], rows[0]['peak GB'], rows[1]['wall min'], rows[1]['peak GB']) == ('32.0', '3.7', '5.0', '2.0')
    assert [r['run'] for r in baselines_table(runs['b-run'])] == ['uniform random actions', 'BFS']
    table = markdown(rows, ['run', 'greedy'])
    assert table.splitlines() == ['| run | greedy |', '| --- | --- |', '| b-run | 0.800 (0.740-0.850) |', '| a-run | 0.500 (0.430-0.570) |']

def test_kept_runs_name_no_path_of_the_machine_they_ran_on(tmp_path):
    made_up(tmp_path, 'r', (0.8, 0.74, 0.85), None, {1: (10, 1.0)})
    assert read_run(tmp_path/'runs'/'r')['eval_info']['model'] == 'r/global_step_30'
    for folder in RUNS.iterdir():
        for f in folder.glob('*.json*'):
            text = f.read_text()
            assert not re.search(r'/(tmp|work|home|root|Users)/', text), f'{f} names a path of the machine it ran on'

def test_every_kept_run_says_how_it_was_made():
    runs = kept_runs()
    assert runs, 'no kept runs in data/runs'
    for name, run in runs.items():
        assert run['name'] == name and run['command'] and run['commit'] and run['machine'] and run['purpose'], name
        assert run['eval'] or run['metrics'], f'{name} holds neither eval.json nor metrics.jsonl'

def test_the_readme_tables_are_the_results_tables():
    "Each results table of the README is `markdown(runs_table(...))` of the kept runs, as 20_results prints it."
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
        rendered = runs_table(runs, kept)
        if base:   # the baselines rows come from the first run's eval table
            rendered += [r for r in baselines_table(runs[kept[0]]) if r['run'] in base]
        assert table.strip() == markdown(rendered, columns), 'the README table differs from runs_table: paste 20_results\' output'
