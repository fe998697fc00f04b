"""Benchmark, not a test: a five-turn rollout with and without each turn's keys and values kept (`TurnCacheEngine`, 12).

    .venv/bin/python data/bench/bench_turns.py [--rooms 64] [--max_turns 5] [--temperature 1.0]

The embedded SmolLM2-135M (untrained, fp32), the first `--rooms` held-out rooms at RAGEN's setting (6x6, one box,
SEARCH_DEPTH=30, MAX_STEPS=5), answers of at most 8 tokens, the env's replies as the trainer sends them. The same
`rollout` runs with `SharedPrefixEngine` (each turn runs its whole context again, the shared prompt start excepted)
and with `TurnCacheEngine`, same seed; it prints, per turn, the rows, the longest prompt, the tokens each engine ran
through the model (padding included) and the seconds, checks that both played the same episodes, and prints the
keys and values `TurnCacheEngine` still holds after the rollout (what the trainer's `forget` frees before an update)."""
import argparse, time


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--rooms', type=int, default=64, help='held-out rooms, all in one batch')
    parser.add_argument('--max_turns', type=int, default=5, help='turns per episode')
    parser.add_argument('--temperature', type=float, default=1.0, help='sampling temperature (0: greedy)')
    args = parser.parse_args()
    import torch
    from ragen_nb.models import load_model, load_tokenizer
    from ragen_nb.engines import SharedPrefixEngine, TurnCacheEngine
    from ragen_nb.rollout import rollout, RolloutConfig, episode_metrics
    from ragen_nb.sokoban import EnvSettings
    from ragen_nb.evaluate import heldout_seeds
    tok, model = load_tokenizer(), load_model().eval()
    settings = EnvSettings(search_depth=30, max_steps=5)
    seeds = heldout_seeds(args.rooms, settings=settings)
    cfg = RolloutConfig(max_turns=args.max_turns, max_response_length=8, temperature=args.temperature, format_penalty=-1)
    played = {}
    for engine in (SharedPrefixEngine(model, tok), TurnCacheEngine(model, tok)):
        calls, ran = [], []
        hook = model.register_forward_pre_hook(lambda m, a, kw: ran.append(kw['input_ids'].numel()), with_kwargs=True)
        generate = engine.generate
        def timed(prompts, *a, **kw):
            start, before = time.perf_counter(), len(ran)
            out = generate(prompts, *a, **kw)
            calls.append((len(prompts), max(map(len, prompts)), sum(ran[before:]), time.perf_counter() - start))
            return out
        engine.generate = timed
        start = time.perf_counter()
        played[type(engine).__name__] = trajs = rollout(engine, tok, seeds, settings, cfg, seed=0)
        total = time.perf_counter() - start
        hook.remove()
        print(f'{type(engine).__name__}: {total:.1f} s, {sum(c[2] for c in calls)} tokens run; {episode_metrics(trajs)}')
        for turn, (rows, longest, tokens, seconds) in enumerate(calls, 1):
            print(f'  turn {turn}: {rows} rows, longest prompt {longest}, {tokens} tokens run, {seconds:.1f} s')
        if isinstance(engine, TurnCacheEngine):   # what the trainer's forget() frees before each update
            held = sum(t.numel() * t.element_size() for layers in engine.kept.values() for kv in layers for t in kv)
            print(f'  held after the rollout: {held / 1e6:.0f} MB of keys and values, {len(engine.kept)} rows')
    a, b = played.values()
    same = sum(x.ids == y.ids for x, y in zip(a, b))
    print(f'episodes with identical ids: {same} of {len(a)}; torch threads {torch.get_num_threads()}')


if __name__ == '__main__': main()
