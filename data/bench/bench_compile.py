"""Benchmark, not a test: does torch.compile pay for the main job's update pass? The policy (bf16 trunk, LoRA r=16) forward + backward on one
micro-batch of 4 rows x 120 tokens, eager against torch.compile (inductor), compile time counted; median of 8 calls.

    .venv/bin/python data/bench/bench_compile.py

One fixed shape: a run's packed micro-batches change length every call, and each new shape compiles again."""
import statistics, time, torch
from peft import LoraConfig, get_peft_model
from ragen_nb.models import load_model
torch.manual_seed(0)
def policy():
    m = load_model('smollm2-135m', dtype=torch.bfloat16)
    m = get_peft_model(m, LoraConfig(r=16, lora_alpha=32, target_modules='all-linear', lora_dropout=0.0))
    return m
ids = torch.randint(0, 49152, (4, 120))
def step(m):
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = m(input_ids=ids).logits.float()
    loss = torch.log_softmax(out, -1).gather(-1, ids[..., None]).mean()
    loss.backward()
    m.zero_grad(set_to_none=True)
def timed(m, n=8):
    t0 = time.perf_counter(); step(m); first = time.perf_counter() - t0
    runs = []
    for _ in range(n):
        t = time.perf_counter(); step(m); runs.append(time.perf_counter() - t)
    return first, statistics.median(runs)
eager = policy(); f_e, e = timed(eager)
comp = policy(); comp = torch.compile(comp); f_c, c = timed(comp)
print(f'threads {torch.get_num_threads()}; eager: first {f_e:.2f} s, median {e:.3f} s; compiled: first (compiling) {f_c:.1f} s, '
      f'median {c:.3f} s; speedup {e / c:.2f}x; compile pays back after {max(f_c - f_e, 0) / max(e - c, 1e-9):.0f} calls')
