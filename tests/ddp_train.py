"Run by test_trainer.py under `accelerate launch --multi_gpu --num_processes 2` (gloo on a CPU): train, then write what this rank holds."
import hashlib, json, sys
from pathlib import Path

import torch
from accelerate import PartialState

from ragen_nb.trainer import Config, train

cfg = Config.from_args(sys.argv[1:])
out = train(cfg, progress=False)
state = PartialState()
params = torch.nn.utils.parameters_to_vector(out['actor'].parameters()).detach()
report = dict(rank=state.process_index, world=state.num_processes, steps=out['steps'],
              sha=hashlib.sha256(params.numpy().tobytes()).hexdigest())
(Path(cfg.output_dir)/f'rank{state.process_index}.json').write_text(json.dumps(report))
