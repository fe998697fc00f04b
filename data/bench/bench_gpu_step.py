"""Benchmark, not a test: a few PPO steps of the `ragen-6x6-first` recipe on a random-init model of a real model's shape.

    python data/bench/bench_gpu_step.py [--shape qwen2.5-0.5b] [--steps 4] [--variants lora full] [--tokenizer DIR] [KEY=value ...]

For a GPU machine with no model hub: it builds a model of the shape's size with random weights (what a step costs does
not depend on what the weights know), saves it with a tokenizer (default: the embedded SmolLM2's, whose 49152 ids fit in
the shape's vocabulary; sampled ids beyond them decode to nothing) and trains it with `RECIPE=ragen-6x6-first CURRICULUM_STEPS=0`
(RAGEN's setting from the first step: 6x6, SEARCH_DEPTH=30, 5 turns) for `--steps` steps per variant, in this process:
`lora` is the recipe (LoRA rank 16), `full` trains every weight (LORA_RANK=0). A random policy rarely answers with an
action, so its turns and tokens differ from a trained one's; the figures are throughput and memory, not learning.
It prints, per variant, the median over the steps after the first of each phase's seconds, steps per second, tokens per
second of rollout (LLM tokens sampled) and of update (all batch tokens), and the peak GPU memory that torch allocated
and reserved (on a CPU: the process's peak resident memory). `--shape tiny` is a smoke test that runs on a laptop."""
import argparse, gc, json, resource, statistics, sys, tempfile, time
from pathlib import Path
import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
from ragen_nb.config import Config
from ragen_nb.models import load_tokenizer
from ragen_nb.trainer import train

SHAPES = {   # Qwen2.5-0.5B-Instruct's config.json, and a small one of the same family for a smoke test
    'qwen2.5-0.5b': dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True),
    'tiny': dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True),
}
VARIANTS = {'lora': [], 'full': ['LORA_RANK=0']}
PHASES = ('timing/rollout', 'timing/update', 'timing/step', 'perf/rollout_tokens_per_s', 'perf/update_tokens_per_s', 'response/llm_tokens')

def random_model(shape: str, tokenizer: str | None, folder: Path) -> Path:
    "Save a random-init (seed 0) model of `shape` in bf16, with `tokenizer`'s files (default: the embedded model's), to `folder`."
    tok = AutoTokenizer.from_pretrained(tokenizer) if tokenizer else load_tokenizer()
    config = Qwen2Config(**SHAPES[shape], bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if len(tok) > config.vocab_size: raise ValueError(f"the tokenizer has {len(tok)} ids, more than the shape's {config.vocab_size}")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder); tok.save_pretrained(folder)
    print(f"{shape}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, saved to {folder}", file=sys.stderr, flush=True)
    return folder

def run(name: str, model: Path, steps: int, extra: list[str], out: Path) -> dict:
    "One variant's training run; the median of each phase over steps 2..steps, and its peak memory."
    cfg = Config.from_args(['RECIPE=ragen-6x6-first', 'CURRICULUM_STEPS=0', f'BASE_MODEL={model}', f'EXPERIMENT_NAME={name}',
                            f'OUTPUT_DIR={out}', f'TOTAL_STEPS={steps}', 'TEST_FREQ=0', 'SAVE_FREQ=0', 'LOG_IMAGES=False',
                            *VARIANTS[name], *extra])
    gpu = torch.cuda.is_available()
    if gpu: torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    result = train(cfg, progress=False)
    wall = time.perf_counter() - start
    if result['error']: sys.exit(f"{name} stopped: {result['error']}")
    rows = [json.loads(line) for line in open(out/name/'metrics.jsonl')][1:]
    peak = (dict(gpu_allocated_gb=torch.cuda.max_memory_allocated() / 2**30, gpu_reserved_gb=torch.cuda.max_memory_reserved() / 2**30)
            if gpu else dict(rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20))
    del result; gc.collect()
    return dict(wall=wall, **peak, **{k: statistics.median(r[k] for r in rows) for k in PHASES})

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--shape', choices=list(SHAPES), default='qwen2.5-0.5b')
    parser.add_argument('--steps', type=int, default=4, help='training steps per variant (the first is left out of the medians)')
    parser.add_argument('--variants', nargs='+', choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument('--tokenizer', default=None, help='a folder holding a tokenizer (default: the embedded SmolLM2 model)')
    parser.add_argument('--out', default=None, help='folder for the model and the runs (default: a temporary folder)')
    parser.add_argument('--json', default=None, help='also write the figures to this file')
    parser.add_argument('settings', nargs='*', help='KEY=value settings on top of the recipe, e.g. TRAIN_BATCH_SIZE=128')
    args = parser.parse_args()
    if args.steps < 2: parser.error('--steps must be at least 2: the first step is left out')
    out = Path(args.out or tempfile.mkdtemp(prefix='bench_gpu_step_')); out.mkdir(parents=True, exist_ok=True)
    model = random_model(args.shape, args.tokenizer, out/'model')
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'
    results = {}
    for name in args.variants:
        results[name] = run(name, model, args.steps, args.settings, out)
        print(f'  {name}: {results[name]["wall"]:.0f} s', file=sys.stderr, flush=True)
    if args.json: Path(args.json).write_text(json.dumps(dict(device=device, shape=args.shape, steps=args.steps, settings=args.settings,
                                                             results=results), indent=1))
    memory = 'GPU GB alloc/resv' if torch.cuda.is_available() else 'peak RSS GB'
    print(f'\n{device}; random-init {args.shape}; RECIPE=ragen-6x6-first CURRICULUM_STEPS=0{" " + " ".join(args.settings) if args.settings else ""}; '
          f'median of steps 2-{args.steps}')
    print(f"{'variant':8s} {'rollout s':>9s} {'update s':>8s} {'step s':>6s} {'steps/s':>7s} {'LLM tok':>7s} {'rollout tok/s':>13s} "
          f"{'update tok/s':>12s} {'run s':>6s} {memory:>17s}")
    for name, r in results.items():
        mem = f"{r['gpu_allocated_gb']:.1f}/{r['gpu_reserved_gb']:.1f}" if 'gpu_allocated_gb' in r else f"{r['rss_gb']:.2f}"
        print(f"{name:8s} {r['timing/rollout']:9.2f} {r['timing/update']:8.2f} {r['timing/step']:6.2f} {1 / r['timing/step']:7.3f} "
              f"{r['response/llm_tokens']:7.1f} {r['perf/rollout_tokens_per_s']:13.0f} {r['perf/update_tokens_per_s']:12.0f} "
              f"{r['wall']:6.0f} {mem:>17s}")

if __name__ == '__main__': main()
