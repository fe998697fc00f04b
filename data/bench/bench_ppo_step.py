"""Benchmark, not a test: whole PPO steps with each rollout engine, by phase.

    .venv/bin/python data/bench/bench_ppo_step.py [--steps 4] [--engines hf vllm vllm-eager] [KEY=value ...]

Runs `ragen_nb train-cpu` (the main job's settings; KEY=value arguments override them) for `--steps` steps once per
engine, each in a fresh process, without validation, checkpoints or images. It prints the median seconds of each
phase over the steps after the first (the first pays one-off costs), the rollout throughput, the process's whole
wall time (model loading and engine start included) and its peak resident memory. `vllm` compiles its model first;
`vllm-eager` is `ENFORCE_EAGER=True`. Run it on an otherwise idle machine."""
import argparse, json, os, statistics, subprocess, sys, tempfile, time
from pathlib import Path

RUNS = {'hf': ['ROLLOUT_ENGINE=hf'], 'vllm': ['ROLLOUT_ENGINE=vllm'], 'vllm-eager': ['ROLLOUT_ENGINE=vllm', 'ENFORCE_EAGER=True']}
PHASES = ('timing/rollout', 'timing/update', 'timing/sync', 'timing/step', 'perf/rollout_tokens_per_s', 'response/llm_tokens')

def run(name: str, steps: int, extra: list[str], out: Path) -> dict:
    "One training process; its wall seconds, peak RSS (GB) and the median of each phase over steps 2..steps."
    args = ['train-cpu', f'EXPERIMENT_NAME={name}', f'OUTPUT_DIR={out}', f'TOTAL_STEPS={steps}', 'TEST_FREQ=0',
            'SAVE_FREQ=0', 'LOG_IMAGES=False', *RUNS[name], *extra]
    start = time.perf_counter()
    with open(out/f'{name}.log', 'w') as log:
        child = subprocess.Popen([sys.executable, '-c', 'import sys; from ragen_nb.cli import main; sys.exit(main())', *args],
                                 stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status): sys.exit(f'{name} failed; see {out/name}.log')
    rows = [json.loads(line) for line in open(out/name/'metrics.jsonl')][1:]
    return dict(wall=time.perf_counter() - start, rss_gb=usage.ru_maxrss / 2**20,
                **{k: statistics.median(r[k] for r in rows) for k in PHASES})

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--steps', type=int, default=4, help='training steps per run (the first is left out of the medians)')
    parser.add_argument('--engines', nargs='+', choices=list(RUNS), default=list(RUNS))
    parser.add_argument('--out', default=None, help='folder for the runs and their logs (default: a temporary folder)')
    parser.add_argument('settings', nargs='*', help='KEY=value settings on top of the main job, e.g. MAX_RESPONSE_LENGTH=32')
    args = parser.parse_args()
    if args.steps < 2: parser.error('--steps must be at least 2: the first step is left out')
    out = Path(args.out or tempfile.mkdtemp(prefix='bench_ppo_step_')); out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.engines:
        results[name] = run(name, args.steps, args.settings, out)
        print(f'  {name}: {results[name]["wall"]:.0f} s', file=sys.stderr, flush=True)
    print(f'runs and logs in {out}', file=sys.stderr)
    print(f'\nmain job settings{" + " + " ".join(args.settings) if args.settings else ""}; median of steps 2-{args.steps} '
          f'(seconds, except tokens)')
    print(f"{'engine':11s} {'rollout':>8s} {'update':>7s} {'sync':>6s} {'step':>6s} {'LLM tok':>8s} {'rollout tok/s':>13s} "
          f"{'process s':>9s} {'peak GB':>7s}")
    for name, r in results.items():
        print(f"{name:11s} {r['timing/rollout']:8.1f} {r['timing/update']:7.1f} {r['timing/sync']:6.2f} {r['timing/step']:6.1f} "
              f"{r['response/llm_tokens']:8.1f} {r['perf/rollout_tokens_per_s']:13.1f} {r['wall']:9.0f} {r['rss_gb']:7.2f}")

if __name__ == '__main__': main()
