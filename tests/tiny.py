"""Helpers the trainer's test files share: a two-turn episode and a batch of them, a Config for n trajectories, the tiny
training run's settings, and reading its metrics (timings aside). A plain module, imported as `from tiny import ...`."""
import json
from pathlib import Path

from ragen_nb.config import Config
from ragen_nb.tokens import ENV, LLM, PROMPT, Trajectory


def episode(tok, answer, reward, seed):
    "Two LLM turns answering `answer`, env feedback between them, total reward `reward`."
    t = Trajectory(seed=seed).add(tok.encode('Push the box onto the target.'), PROMPT, 0)
    response = tok.encode(f'<answer>{answer}</answer>')
    t.add(response, LLM, 1, [-1.0] * len(response)).add(tok.encode('\nState:\n#P_O#\n'), ENV, 1)
    t.add(response, LLM, 2, [-1.0] * len(response))
    t.rewards = [0., reward]
    return t


def cfg_for(n, **kw):
    args = [f'TRAIN_BATCH_SIZE={n}', f'PPO_BATCH_SIZE={n}', f'MICRO_BATCH_SIZE={n}', 'KL_COEF=0']
    return Config.from_args(args + [f'{k}={v}' for k, v in kw.items()])


ROOT = Path(__file__).resolve().parents[1]
TINY_RUN = ['TRAIN_BATCH_SIZE=2', 'PPO_BATCH_SIZE=2', 'MICRO_BATCH_SIZE=1', 'MAX_TURNS=2', 'MAX_RESPONSE_LENGTH=6',
            'ACTOR_LR=1e-3', 'CRITIC_LR=1e-3', 'ROLLOUT_ENGINE=hf', 'VAL_ROOMS=8']   # DATA_DIR: the default, absent here


def run_args(tiny_dir, out, name, *extra):
    return [f'BASE_MODEL={tiny_dir}', f'OUTPUT_DIR={out}', f'EXPERIMENT_NAME={name}', *TINY_RUN, *extra]


def read_metrics(run):
    return [json.loads(l) for l in (Path(run)/'metrics.jsonl').read_text().splitlines()]


def untimed(record):
    return {k: v for k, v in record.items() if not k.startswith(('timing/', 'perf/'))}


def uneven_batch(tok):
    "Eight trajectories of four rooms (two each), with very different numbers of LLM tokens and rewards."
    words = ['Up', 'Down now please, quickly and carefully', 'Left', 'Right', 'Up Up', 'Down', 'Left, I think, or maybe not', 'Right']
    return [episode(tok, w, r, i // 2) for i, (w, r) in enumerate(zip(words, [1., -1., 0.5, 2., -2., 0., 3., -0.5]))]
