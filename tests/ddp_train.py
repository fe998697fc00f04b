"Run by test_trainer.py under `accelerate launch --multi_gpu --num_processes 2` (gloo on a CPU): train, then write what this rank holds and the rooms it played."
import hashlib, json, sys
from pathlib import Path

import torch
from accelerate import PartialState

import ragen_nb.trainer as trainer
from ragen_nb.config import Config
from ragen_nb.trainer import train

played, real_rollout = [], trainer.rollout
def recording_rollout(engine, tok, seeds, settings, cfg, seed=None, rooms=None):
    if cfg.temperature > 0: played.append(list(seeds))   # training batches (validation is greedy)
    return real_rollout(engine, tok, seeds, settings, cfg, seed=seed, rooms=rooms)
trainer.rollout = recording_rollout

cfg = Config.from_args(sys.argv[1:])
out = train(cfg, progress=False)
state = PartialState()
params = torch.nn.utils.parameters_to_vector(out['actor'].parameters()).detach()
report = dict(rank=state.process_index, world=state.num_processes, steps=out['steps'], played=played,
              sha=hashlib.sha256(params.numpy().tobytes()).hexdigest())
(Path(cfg.output_dir)/f'rank{state.process_index}.json').write_text(json.dumps(report))
