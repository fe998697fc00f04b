"""Measurement, not a test: where a model's greedy episodes go wrong, turn by turn (`ragen_nb.evaluate.move_quality`).

    .venv/bin/python data/bench/bench_moves.py --model CHECKPOINT [--rooms 200] [--search_depth 30] [--max_turns 5] [--json PATH]

Plays the first `--rooms` held-out rooms once, greedily, as `ragen_nb eval` does (env replies of up to 160 tokens), and
prints for each turn how many rooms were still solvable in the moves left and the shares of optimal, no-effect and
no-action moves among them. Defaults are the seed's settings (6x6, one box, SEARCH_DEPTH=30, MAX_STEPS=5, 5 turns)."""
import argparse, json, time


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', required=True, help='checkpoint folder (or model name) to judge')
    parser.add_argument('--rooms', type=int, default=200, help='held-out rooms')
    parser.add_argument('--search_depth', type=int, default=30, help='SEARCH_DEPTH of the rooms')
    parser.add_argument('--max_turns', type=int, default=5, help='turns per episode')
    parser.add_argument('--max_response_length', type=int, default=100, help='tokens per answer')
    parser.add_argument('--json', help='write the result here')
    args = parser.parse_args()
    from ragen_nb.evaluate import heldout_seeds, move_quality, play, trajectory_metrics
    from ragen_nb.models import load_model, load_tokenizer
    from ragen_nb.engines import SharedPrefixEngine
    from ragen_nb.rollout import RolloutConfig
    from ragen_nb.sokoban import EnvSettings
    start = time.perf_counter()
    settings = EnvSettings(search_depth=args.search_depth)
    cfg = RolloutConfig(max_turns=args.max_turns, max_response_length=args.max_response_length, max_obs_length=160,
                        temperature=0.0)
    tok, model = load_tokenizer(args.model), load_model(args.model)
    trajs = play(SharedPrefixEngine(model, tok), tok, heldout_seeds(args.rooms, None, settings), settings, cfg)
    result = dict(model=args.model, rooms=args.rooms, search_depth=args.search_depth, max_turns=args.max_turns,
                  success_rate=trajectory_metrics(trajs)['success_rate'],
                  turns=move_quality(trajs, settings, args.max_turns), seconds=time.perf_counter() - start)
    print(f"success {result['success_rate']:.3f} on {args.rooms} rooms, {result['seconds']:.0f} s")
    print('turn  answers  solvable  optimal  no effect  no action')
    for r in result['turns']:
        print(f"{r['turn']:4}  {r['answers']:7}  {r['solvable']:8}  {r['optimal']:7.3f}  {r['no_effect']:9.3f}  {r['no_action']:9.3f}")
    if args.json:
        with open(args.json, 'w') as f: json.dump(result, f, indent=1)


if __name__ == '__main__':
    main()
