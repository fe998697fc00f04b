"""Benchmark, not a test: rollout tokens/s of HF `generate` against the vLLM engine, on the same model and prompts.

    .venv/bin/python tests/bench_engines.py [--sizes 32 128] [--tokens 64] [--compiled]

The embedded SmolLM2-135M in fp32, real first Sokoban prompts (notebook 01's `render_prompt`), T = 1, top_p = 1, no
stop at `</answer>` and eos kept, so each engine writes the same kind of text; the count is the tokens each returned.
vLLM runs in eager mode (no torch.compile); `--compiled` also times a compiled engine (a start of minutes on a CPU).
Also printed: vLLM's start-up time and one weight sync. Run once, on an otherwise idle machine if you can."""
import argparse, time
import torch
from ragen_nb.models import load_model, load_tokenizer, resolve, EMBEDDED
from ragen_nb.sokoban import SokobanEnv, EnvSettings
from ragen_nb.data import render_prompt
from ragen_nb.rollout import HFEngine
from ragen_nb.engines import VLLMEngine

parser = argparse.ArgumentParser()
parser.add_argument('--sizes', type=int, nargs='+', default=[32, 128])
parser.add_argument('--tokens', type=int, default=64)
parser.add_argument('--compiled', action='store_true')
args = parser.parse_args()

tok, actor = load_tokenizer(), load_model()
env = SokobanEnv(EnvSettings(dim_x=6, dim_y=6, num_boxes=1, max_steps=5, search_depth=30))
prompts = [tok.encode(render_prompt(tok, env.reset(seed=s)), add_special_tokens=False) for s in range(max(args.sizes))]

def rate(engine, n: int) -> tuple[float, int, float]:
    "tokens/s, tokens and seconds of one call on the first `n` prompts."
    start = time.perf_counter()
    outs = engine.generate(prompts[:n], args.tokens, temperature=1.0, seed=0, stop_at_answer=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(ids) for ids, _ in outs)
    print(f'  {type(engine).__name__} on {n} prompts: {tokens} tokens in {seconds:.1f} s', flush=True)
    return tokens / seconds, tokens, seconds

rows, starts = {}, {}
for name, eager in [('vLLM eager', True)] + ([('vLLM compiled', False)] if args.compiled else []):
    start = time.perf_counter()
    engine = VLLMEngine(resolve(EMBEDDED), tok, dtype='float32', enforce_eager=eager, max_model_len=2048)
    starts[name] = time.perf_counter() - start
    print(f'  {name} engine started in {starts[name]:.1f} s', flush=True)
    engine.generate(prompts[:2], 4)  # first call: warm-up
    for n in args.sizes: rows[(name, n)] = rate(engine, n)
    starts[name + ' sync'] = engine.sync(actor)
    del engine
for n in args.sizes: rows[('HF generate', n)] = rate(HFEngine(actor, tok), n)

print(f'\nSmolLM2-135M fp32, {args.tokens} new tokens per prompt, T=1, torch threads {torch.get_num_threads()}')
print(f"{'engine':15s} {'prompts':>7s} {'tokens':>7s} {'seconds':>8s} {'tokens/s':>9s} {'vs HF':>6s}")
for (name, n), (r, tokens, seconds) in rows.items():
    print(f'{name:15s} {n:7d} {tokens:7d} {seconds:8.1f} {r:9.1f} {r / rows[("HF generate", n)][0]:6.2f}')
for name, seconds in starts.items(): print(f'{name}: {seconds:.1f} s')
