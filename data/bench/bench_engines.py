"""Benchmark, not a test: rollout tokens/s of HF `generate` against the vLLM engine, on the same model and prompts.

    .venv/bin/python data/bench/bench_engines.py [--sizes 32 128] [--tokens 64] [--engines hf hf-plain vllm-eager vllm-compiled]

The embedded SmolLM2-135M in fp32, real first Sokoban prompts (notebook 02's `render_prompt`), T = 1, top_p = 1, no
stop at `</answer>`, stopping only at eos or `--tokens`; the count is the tokens each engine returned. `hf` is
`SharedPrefixEngine` (14), which runs the prompt start that every prompt shares once (the trainer's and `ragen_nb eval`'s
HF engine); `hf-plain` is `HFEngine` (04), plain left padding.
Each engine runs in a fresh process of its own, one after another: vLLM's CPU threads spin and would slow anything
beside them, and an eager and a compiled engine do not fit in one process's memory here. `vllm-compiled` compiles with
torch.compile first (minutes on a CPU); its start-up time is printed. `--seeded` gives every request a seed, as the
trainer does; vLLM then samples each seeded request with its own generator. Run it on an otherwise idle machine."""
import argparse, json, subprocess, sys, time

ENGINES = ('hf', 'hf-plain', 'vllm-eager', 'vllm-compiled')

def measure(engine_name: str, sizes: list[int], tokens: int, seeded: bool) -> dict:
    "Start one engine, warm it up, and time one `generate` call per size; also time a weight sync for vLLM."
    import torch
    from ragen_nb.models import load_model, load_tokenizer, resolve, EMBEDDED
    from ragen_nb.sokoban import SokobanEnv, EnvSettings
    from ragen_nb.data import render_prompt
    from ragen_nb.rollout import HFEngine
    from ragen_nb.engines import SharedPrefixEngine
    tok, actor = load_tokenizer(), load_model()
    env = SokobanEnv(EnvSettings(dim_x=6, dim_y=6, num_boxes=1, max_steps=5, search_depth=30))
    prompts = [tok.encode(render_prompt(tok, env.reset(seed=s)), add_special_tokens=False) for s in range(max(sizes))]
    start = time.perf_counter()
    if engine_name.startswith('hf'): engine = (SharedPrefixEngine if engine_name == 'hf' else HFEngine)(actor, tok)
    else:
        from ragen_nb.engines import VLLMEngine
        engine = VLLMEngine(resolve(EMBEDDED), tok, dtype='float32', enforce_eager=engine_name == 'vllm-eager', max_model_len=2048)
    result = dict(engine=engine_name, start_s=time.perf_counter() - start, threads=torch.get_num_threads(),
                  prompt_tokens=sum(map(len, prompts)) / len(prompts), rows=[])
    engine.generate(prompts[:2], 4)  # warm-up
    for n in sizes:
        start = time.perf_counter()
        outs = engine.generate(prompts[:n], tokens, temperature=1.0, seed=0 if seeded else None, stop_at_answer=False)
        seconds = time.perf_counter() - start
        result['rows'].append(dict(prompts=n, tokens=sum(len(ids) for ids, _ in outs), seconds=seconds))
        print(f'  {engine_name} on {n} prompts: {result["rows"][-1]["tokens"]} tokens in {seconds:.1f} s', file=sys.stderr, flush=True)
    if not engine_name.startswith('hf'): result['sync_s'] = engine.sync(actor)
    return result

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--sizes', type=int, nargs='+', default=[32, 128], help='concurrent prompts per call')
    parser.add_argument('--tokens', type=int, default=64, help='new tokens per prompt at most')
    parser.add_argument('--engines', nargs='+', choices=ENGINES, default=list(ENGINES))
    parser.add_argument('--seeded', action='store_true', help='a seed on every request, as in training')
    parser.add_argument('--one', choices=ENGINES, help=argparse.SUPPRESS)  # internal: measure one engine, print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.sizes, args.tokens, args.seeded)))
        return
    results = {}
    for name in args.engines:
        command = [sys.executable, __file__, '--one', name, '--tokens', str(args.tokens), '--sizes', *map(str, args.sizes)]
        done = subprocess.run(command + (['--seeded'] if args.seeded else []), stdout=subprocess.PIPE, text=True)
        if done.returncode: sys.exit(f'{name} failed (exit {done.returncode}); its error is above')
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    hf = {row['prompts']: row['tokens'] / row['seconds'] for row in results['hf']['rows']} if 'hf' in results else {}
    first = next(iter(results.values()))
    print(f'\nSmolLM2-135M fp32, prompts of {first["prompt_tokens"]:.0f} tokens on average, up to {args.tokens} new tokens, '
          f'T=1, {"seeded" if args.seeded else "unseeded"} requests, torch threads {first["threads"]}')
    print(f"{'engine':14s} {'prompts':>7s} {'tokens':>7s} {'seconds':>8s} {'tokens/s':>9s} {'vs HF':>6s}")
    for name, result in results.items():
        for row in result['rows']:
            rate = row['tokens'] / row['seconds']
            ratio = f"{rate / hf[row['prompts']]:6.2f}" if row['prompts'] in hf else '     -'
            print(f"{name:14s} {row['prompts']:7d} {row['tokens']:7d} {row['seconds']:8.1f} {rate:9.1f} {ratio}")
    for name, result in results.items():
        print(f"{name}: start {result['start_s']:.1f} s" + (f", one weight sync {result['sync_s']:.2f} s" if 'sync_s' in result else ''))

if __name__ == '__main__': main()
