"Run by test_trainer.py under `accelerate launch --multi_gpu --num_processes 2` (gloo): one ppo_step on this rank's half of a fixed batch, SGD at lr 1; writes the weights."
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

from ragen_nb.models import load_tokenizer, tiny_model
from ragen_nb.config import Config
from ragen_nb.critic import ValueModel
from ragen_nb.trainer import Processes, ppo_step
from tiny import uneven_batch

out, *args = sys.argv[1:]
acc = Accelerator(cpu=True)
tok = load_tokenizer()
trajs = uneven_batch(tok)
n = len(trajs) // acc.num_processes
cfg = Config.from_args(args)
local = Config.from_args(args + [f'TRAIN_BATCH_SIZE={cfg.train_batch_size // acc.num_processes}',
                                 f'PPO_BATCH_SIZE={cfg.ppo_batch_size // acc.num_processes}'])
actor = tiny_model(tok); critic = None if cfg.critic_free else ValueModel.from_causal_lm(actor)
opts = [torch.optim.SGD(m.parameters(), lr=1.) for m in (actor, critic) if m is not None]
prepared = acc.prepare(*[m for m in (actor, critic) if m is not None], *opts)
models, opts = prepared[:len(opts)], prepared[len(opts):]
ppo_step(trajs[acc.process_index * n:(acc.process_index + 1) * n], models[0], models[1] if len(models) > 1 else None,
         opts[0], opts[1] if len(opts) > 1 else None, local, tok.pad_token_id, procs=Processes(acc))
if acc.is_main_process:
    torch.save([acc.unwrap_model(m).state_dict() for m in models], out)
