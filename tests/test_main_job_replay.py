"""The library's re-cuts change no number: the first steps of the main job, run now, equal the kept run of the main job.

`data/runs/main-job-seed0/metrics.jsonl` was written by `ragen_nb train-cpu` (30 steps, SEED=0) before the trainer was cut
into its modules. Its first `STEPS` steps are run again here, through the command line, with the same recipe and seed,
and every logged number but the timings must match to 1e-6: the rooms, the sampled answers, the advantages, the
updates, the validation. About seven minutes on two CPU cores.
"""
import json, math, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEPT = ROOT/'data'/'runs'/'main-job-seed0'/'metrics.jsonl'
STEPS = 5

def test_the_main_job_replays_its_kept_run(tmp_path):
    command = [sys.executable, '-m', 'ragen_nb.cli', 'train', 'RECIPE=main-job', f'TOTAL_STEPS={STEPS}', 'SAVE_FREQ=0',
               'LOG_IMAGES=False', f'OUTPUT_DIR={tmp_path}']
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    now = [json.loads(l) for l in (tmp_path/'cpu-smollm2-135m'/'metrics.jsonl').read_text().splitlines()]
    kept = [json.loads(l) for l in KEPT.read_text().splitlines()][:STEPS + 1]
    assert [r['step'] for r in now] == list(range(STEPS + 1))
    compared = 0
    for a, b in zip(now, kept):
        keys = {k for k in a if not k.startswith(('timing/', 'perf/'))}
        assert keys == {k for k in b if not k.startswith(('timing/', 'perf/'))}, f"step {a['step']}: other metrics logged"
        for k in keys:
            x, y = a[k], b[k]
            if isinstance(x, float) and isinstance(y, float) and not (math.isnan(x) and math.isnan(y)):
                assert abs(x - y) <= 1e-6, f"step {a['step']}, {k}: {x} now, {y} in the kept run"
            else: assert x == y, f"step {a['step']}, {k}: {x!r} now, {y!r} in the kept run"
            compared += 1
    assert compared > 100
