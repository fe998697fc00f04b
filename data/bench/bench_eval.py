"""Benchmark, not a test: wall time and peak memory of a model evaluation (`ragen_nb.evaluate.play`) per chunk size.

    .venv/bin/python data/bench/bench_eval.py [--rooms 200] [--chunks 200 32 8] [--temperature 0] [--samples 1] [--json PATH]

The embedded SmolLM2-135M on the CPU with HF `generate` (`SharedPrefixEngine`, as `ragen_nb eval`), the main job's rooms (SEARCH_DEPTH=4, 2 turns), answers of at
most 24 tokens. `--chunks 200` with 200 rooms is what `rollout` does alone: every room in one batch. Each chunk size
runs in a fresh process, so its peak RSS (ru_maxrss) is its own; loading the model is timed apart from playing. On a
shared machine wall time depends on the other load; CPU seconds (user + system) of the playing process depend less on it."""
import argparse, json, resource, subprocess, sys, time


def measure(rooms: int, chunk: int, temperature: float, samples: int) -> dict:
    "Load the model, play `rooms` held-out rooms `samples` times in chunks of `chunk`; seconds, peak RSS and outcome."
    start = time.perf_counter()
    from ragen_nb.evaluate import heldout_seeds, play, trajectory_metrics
    from ragen_nb.models import load_model, load_tokenizer
    from ragen_nb.engines import SharedPrefixEngine
    from ragen_nb.rollout import RolloutConfig
    from ragen_nb.sokoban import EnvSettings
    tok, model = load_tokenizer(), load_model()
    loaded, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    cfg = RolloutConfig(max_turns=2, max_response_length=24, temperature=temperature)
    trajs = play(SharedPrefixEngine(model, tok), tok, heldout_seeds(rooms), EnvSettings(search_depth=4), cfg, samples, chunk,
                 progress=False)
    played, used = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    m = trajectory_metrics(trajs)
    return dict(rooms=rooms, samples=samples, temperature=temperature, chunk_size=chunk, load_s=loaded - start,
                play_s=played - loaded, play_cpu_s=used.ru_utime + used.ru_stime - cpu.ru_utime - cpu.ru_stime, peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                success_rate=m['success_rate'], valid_action_rate=m['valid_action_rate'],
                first_actions=[t.actions[0] if t.actions else None for t in trajs])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--rooms', type=int, default=200, help='held-out rooms')
    parser.add_argument('--chunks', type=int, nargs='+', default=[200, 32, 8], help='chunk sizes to compare')
    parser.add_argument('--temperature', type=float, default=0.0, help='0: greedy')
    parser.add_argument('--samples', type=int, default=1, help='episodes per room (needs temperature > 0 for more than 1)')
    parser.add_argument('--json', help='write the results here')
    parser.add_argument('--one', type=int, help=argparse.SUPPRESS)  # internal: measure one chunk size, print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.rooms, args.one, args.temperature, args.samples)))
        return
    results = []
    for chunk in args.chunks:
        command = [sys.executable, __file__, '--one', str(chunk), '--rooms', str(args.rooms),
                   '--temperature', str(args.temperature), '--samples', str(args.samples)]
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
        if done.returncode: sys.exit(f'chunk size {chunk} failed (exit {done.returncode}); its error is above')
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        r = results[-1]
        print(f"chunk {chunk:4d}: play {r['play_s']:6.1f} s ({r['play_cpu_s']:.0f} CPU s), peak RSS {r['peak_rss_gb']:.2f} GB, success {r['success_rate']:.3f}, "
              f"valid {r['valid_action_rate']:.3f} (model load {r['load_s']:.1f} s)", flush=True)
    same = all(r['first_actions'] == results[0]['first_actions'] for r in results)
    print(f'first actions identical across chunk sizes: {same}')
    if args.json:
        with open(args.json, 'w') as f: json.dump(dict(results=results, identical_first_actions=same), f, indent=1)


if __name__ == '__main__': main()
