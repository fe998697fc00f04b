"""The library's re-cuts change no number: the first steps of the main job, run now, equal a kept run of the main job.

`data/runs/main-job-fp32-seed2` was written by the main job's recipe of its day (SEED=2) on a 2-core AMD EPYC with AVX-512,
on one torch thread. Its first `STEPS` steps are run again here, through the command line, with every setting and the
thread count its `run.json` recorded (so a later recipe under the same name does not change what is replayed), and
every logged number but the timings must match to 1e-6: the rooms, the sampled answers, the advantages, the losses,
the validation. Two metrics are sums over the whole vocabulary or every weight,
and their last digits depend on the CPU's vector units: on a 2-core AVX2 machine without AVX-512, `actor/entropy`
differed by up to 1.5e-4 and `actor/grad_norm` by up to 1.6e-5, relative, while everything else matched to 1e-6.
Those two are held to 1e-3, relative.

What this cannot promise: a whole run equal on another CPU. On an Intel Xeon, the first recipe's SEED=0 run sampled the
same episodes as the AMD run for 19 steps; at step 20 one sampled token differed, and from there it was another draw
of the recipe (`22_results`). The first `STEPS` steps are short enough to stay equal on the machines tried.
"""
import json, math, os, subprocess, sys
import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEPT_RUN = ROOT/'data'/'runs'/'main-job-fp32-seed2'
KEPT = KEPT_RUN/'metrics.jsonl'
STEPS = 5
VOCAB_OR_WEIGHT_SUMS = {'actor/entropy': 1e-3, 'actor/grad_norm': 1e-3}   # relative tolerance, see above

def mismatches(now: list[dict], kept: list[dict]) -> tuple[list[str], int]:
    "Every logged number of `now` that differs from `kept` (timings aside), and how many numbers were compared."
    out, compared = [], 0
    if [r['step'] for r in now] != [r['step'] for r in kept]: return [f"steps {[r['step'] for r in now]} against {[r['step'] for r in kept]}"], 0
    for a, b in zip(now, kept):
        keys = {k for k in a if not k.startswith(('timing/', 'perf/'))}
        if keys != {k for k in b if not k.startswith(('timing/', 'perf/'))}: out.append(f"step {a['step']}: other metrics logged")
        for k in keys & set(b):
            x, y = a[k], b[k]
            if isinstance(x, float) and isinstance(y, float) and not (math.isnan(x) and math.isnan(y)):
                close = abs(x - y) <= 1e-6 or abs(x - y) <= VOCAB_OR_WEIGHT_SUMS.get(k, 0) * abs(y)
            else: close = x == y
            if not close: out.append(f"step {a['step']}, {k}: {x!r} now, {y!r} in the kept run")
            compared += 1
    return out, compared

def test_the_comparison_catches_a_changed_number():
    kept = [json.loads(l) for l in KEPT.read_text().splitlines()][:STEPS + 1]
    wrong, compared = mismatches(kept, kept)
    assert wrong == [] and compared > 100
    for key, factor in (('actor/pg_loss', 1 + 1e-4), ('actor/entropy', 1 + 2e-3), ('train/success_rate', 0.5)):
        changed = [dict(r) for r in kept]
        step = next(i for i, r in enumerate(changed) if isinstance(r.get(key), float) and r[key] != 0)
        changed[step][key] *= factor
        assert len(mismatches(changed, kept)[0]) == 1, key

@pytest.mark.slow
def test_the_main_job_replays_its_kept_run(tmp_path):
    session = json.loads((KEPT_RUN/'run.json').read_text())['sessions'][0]
    recorded = {k: v for k, v in session['settings'].items() if k not in ('experiment_name', 'output_dir', 'total_steps', 'save_freq', 'log_images')}
    command = [sys.executable, '-m', 'ragen_nb.cli', 'train', *[f'{k.upper()}={v}' for k, v in recorded.items()], f'TOTAL_STEPS={STEPS}',
               'SAVE_FREQ=0', 'LOG_IMAGES=False', f'OUTPUT_DIR={tmp_path}', 'EXPERIMENT_NAME=replay']
    threads = str(session['machine']['torch_threads'])   # a sum split over other threads rounds otherwise
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=threads))
    assert done.returncode == 0, done.stderr[-3000:]
    now = [json.loads(l) for l in (tmp_path/'replay'/'metrics.jsonl').read_text().splitlines()]
    kept = [json.loads(l) for l in KEPT.read_text().splitlines()][:STEPS + 1]
    assert [r['step'] for r in now] == list(range(STEPS + 1))
    wrong, compared = mismatches(now, kept)
    assert not wrong, '\n'.join(wrong[:20])
    assert compared > 100
