"PPO loss terms against plain formulas, where their gradients go, and one PPO step on a tiny model."
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ragen_nb.masking import collate, forward_logprobs, masked_mean, token_logprobs
from ragen_nb.models import tiny_model
from ragen_nb.ppo import (entropy_from_logits, explained_variance, kl_in_reward, kl_loss, kl_penalty, policy_loss, value_loss)
from ragen_nb.tokens import ENV, LLM, PROMPT, Trajectory

D = torch.float64


def reference_pg(new, old, adv, mask, lo, hi, c):
    "The papers' objective −min(ρA, clip(ρ)A) (dual: −max(that, cA) for A < 0), token by token."
    losses = []
    for n, o, a, m in zip(new.flatten().tolist(), old.flatten().tolist(), adv.flatten().tolist(), mask.flatten().tolist()):
        if not m: continue
        r = math.exp(n - o)
        objective = min(r * a, min(max(r, 1 - lo), 1 + hi) * a)
        if c is not None and a < 0: objective = max(objective, c * a)
        losses.append(-objective)
    return sum(losses) / max(len(losses), 1)


def random_tokens(seed, B=6, L=30, spread=0.6):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, L, generator=g, dtype=D) * spread, torch.randn(B, L, generator=g, dtype=D) * 0.1,
            torch.randn(B, L, generator=g, dtype=D), torch.rand(B, L, generator=g) < .5)


clip = st.sampled_from([0.1, 0.2, 0.28, 0.4])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), clip, clip, st.sampled_from([None, 1.5, 3.0]))
def test_policy_loss_value_and_zero_gradient_set(seed, lo, hi, c):
    new, old, adv, mask = random_tokens(seed)
    new.requires_grad_()
    loss, stats = policy_loss(new, old, adv, mask, lo, hi, c)
    assert loss.item() == pytest.approx(reference_pg(new, old, adv, mask, lo, hi, c), abs=1e-10)
    loss.backward()
    ratio = (new - old).exp().detach()
    clipped = ((adv > 0) & (ratio > 1 + hi)) | ((adv < 0) & (ratio < 1 - lo))
    dual = (adv < 0) & (ratio > c) if c is not None else torch.zeros_like(clipped)
    zero = new.grad == 0
    assert zero[~mask].all()                                   # only LLM tokens get a gradient
    assert torch.equal(zero[mask], (clipped | dual)[mask])       # and among them, zero exactly where clipping bites
    assert stats['clipfrac'] == pytest.approx(clipped[mask].double().mean().item())
    assert stats['dual_clipfrac'] == pytest.approx(dual[mask].double().mean().item())
    assert stats['approx_kl'] >= 0


def test_clip_direction_matters():
    "Out of range on the side PPO leaves alone keeps its gradient; on the other side it loses it."
    ratio = torch.tensor([[0.5, 1.5, 0.5, 1.5]], dtype=D)
    adv = torch.tensor([[1., 1., -1., -1.]], dtype=D)
    new = ratio.log().requires_grad_()
    loss, stats = policy_loss(new, torch.zeros_like(ratio), adv, torch.ones_like(ratio), 0.2, 0.2)
    loss.backward()
    assert (new.grad[0] != 0).tolist() == [True, False, False, True]
    assert stats['clipfrac'] == 0.5


def test_on_policy_gradient_is_plain_policy_gradient():
    new, _, adv, mask = random_tokens(1)
    new.requires_grad_()
    loss, stats = policy_loss(new, new.detach(), adv, mask)
    loss.backward()
    assert loss.item() == pytest.approx(-adv[mask].mean().item())
    torch.testing.assert_close(new.grad, torch.where(mask, -adv / mask.sum(), 0.))
    assert stats['approx_kl'] == 0 and stats['clipfrac'] == 0


def test_dual_clip_must_exceed_one():
    new, old, adv, mask = random_tokens(2)
    with pytest.raises(ValueError, match='> 1'): policy_loss(new, old, adv, mask, dual_clip=1.0)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([None, 0.1, 0.5]))
def test_value_loss_formula_and_gradient(seed, c):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(4, 20, generator=g, dtype=D).requires_grad_()
    old, returns = torch.randn(4, 20, generator=g, dtype=D), torch.randn(4, 20, generator=g, dtype=D)
    mask = torch.rand(4, 20, generator=g) < .5
    loss, stats = value_loss(values, old, returns, mask, clip=c)
    per = []
    for v, o, r, m in zip(values.detach().flatten().tolist(), old.flatten().tolist(), returns.flatten().tolist(), mask.flatten().tolist()):
        if not m: continue
        vc = v if c is None else min(max(v, o - c), o + c)
        per.append(0.5 * max((v - r) ** 2, (vc - r) ** 2))
    assert loss.item() == pytest.approx(sum(per) / len(per), abs=1e-10)
    loss.backward()
    assert (values.grad[~mask] == 0).all()
    if c is None: assert (values.grad[mask] != 0).all() and stats['vf_clipfrac'] == 0
    else:
        vc = torch.clamp(values.detach(), old - c, old + c)
        active = (vc - returns) ** 2 > (values.detach() - returns) ** 2
        assert torch.equal(values.grad[mask] == 0, active[mask])
        assert stats['vf_clipfrac'] == pytest.approx(active[mask].double().mean().item())


def test_explained_variance():
    g = torch.Generator().manual_seed(0)
    returns, mask = torch.randn(3, 10, generator=g, dtype=D), torch.rand(3, 10, generator=g) < .6
    junk = torch.where(mask, returns, 1e3)                       # off-mask values must not count
    assert explained_variance(junk, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.where(mask, returns.mean(), 1e3), torch.where(mask, returns, 0.), mask) < 0.2
    values = torch.randn(3, 10, generator=g, dtype=D)
    y, v = returns[mask], values[mask]
    assert explained_variance(values, returns, mask) == pytest.approx(1 - ((y - v).var() / y.var()).item())
    assert math.isnan(explained_variance(values, torch.ones_like(returns), mask))
    assert math.isnan(explained_variance(values, returns, torch.zeros_like(mask)))


def test_explained_variance_is_nan_when_returns_hardly_vary():
    "The main job's step 2: every episode scored the same and a KL penalty left crumbs; the plain formula gave -9.4e6."
    g = torch.Generator().manual_seed(1)
    values, mask = torch.randn(2, 64, generator=g, dtype=D), torch.ones(2, 64, dtype=torch.bool)
    crumbs = torch.randn(2, 64, generator=g, dtype=D)
    flat = -2 + 3e-4 * crumbs                                    # std / RMS = 1.5e-4, below the default rtol 1e-3
    assert 1 - (flat - values).var() / flat.var() < -1e5       # what the formula alone says
    assert math.isnan(explained_variance(values, flat, mask))
    assert math.isnan(explained_variance(values, flat.float(), mask))
    assert math.isnan(explained_variance(values, torch.zeros_like(flat), mask))
    spread = -2 + 3e-2 * crumbs                                  # std / RMS = 1.5e-2: a real, if small, spread
    got = explained_variance(values, spread, mask)
    assert got == pytest.approx(1 - ((spread - values).var() / spread.var()).item())
    assert explained_variance(values, flat, mask, rtol=1e-5) == pytest.approx(1 - ((flat - values).var() / flat.var()).item())
    tiny = 1e-9 * values + 1e-11 * crumbs                      # a tiny scale is not "hardly varying"
    assert explained_variance(1e-9 * values, tiny, mask) == pytest.approx(1 - ((tiny - 1e-9 * values).var() / tiny.var()).item())


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_entropy_against_categorical(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 7, 50, generator=g) * 3).to(dtype)
    want = torch.distributions.Categorical(logits=logits.float()).entropy()
    got = entropy_from_logits(logits)
    assert got.dtype == torch.float32 and (got[:, 0] == 0).all()
    torch.testing.assert_close(got[:, 1:], want[:, :-1], atol=1e-5, rtol=1e-5)
    assert entropy_from_logits(torch.zeros(1, 2, 50))[0, 1].item() == pytest.approx(math.log(50))


def test_kl_estimators():
    g = torch.Generator().manual_seed(0)
    lp, ref = torch.randn(4, 9, generator=g, dtype=D), torch.randn(4, 9, generator=g, dtype=D)
    torch.testing.assert_close(kl_penalty(lp, ref, 'k1'), lp - ref)
    torch.testing.assert_close(kl_penalty(lp, ref, 'k3'), ((ref - lp).exp() - (ref - lp) - 1).clamp(-10, 10))
    assert (kl_penalty(lp, ref, 'k3') >= 0).all() and (kl_penalty(lp, lp, 'k3') == 0).all()
    # both estimate KL(p || q) when tokens are drawn from p
    p, q = torch.softmax(torch.randn(20, generator=g) * .7, 0), torch.softmax(torch.randn(20, generator=g) * .7, 0)
    tokens = torch.multinomial(p, 400_000, replacement=True, generator=g)
    exact = (p * (p / q).log()).sum().item()
    for kind in ('k1', 'k3'):
        assert kl_penalty(p.log()[tokens], q.log()[tokens], kind).mean().item() == pytest.approx(exact, abs=0.01)
    torch.testing.assert_close(kl_penalty(lp, ref, 'k2'), 0.5 * (lp - ref) ** 2)
    with pytest.raises(ValueError, match="'k1'"): kl_penalty(lp, ref, 'mse')


def test_kl_loss_is_the_masked_mean():
    g = torch.Generator().manual_seed(2)
    lp, ref = torch.randn(3, 7, generator=g, dtype=D), torch.randn(3, 7, generator=g, dtype=D)
    mask = torch.rand(3, 7, generator=g) < .5
    for kind in ('k1', 'k2', 'k3'):
        want = sum(kl_penalty(lp, ref, kind)[mask].tolist()) / mask.sum().item()
        assert kl_loss(lp, ref, mask, kind).item() == pytest.approx(want)
    assert kl_loss(lp, ref, mask).item() == pytest.approx(kl_loss(lp, ref, mask, 'k3').item())


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_kl_gradients_through_sampled_tokens(seed):
    "Exact expectations over a 5-token softmax: k1 in the reward and k2 follow grad KL(pi||ref), k1 as a loss 0, k3 grad KL(ref||pi)."
    g = torch.Generator().manual_seed(seed)
    theta0, ref = 0.5 * torch.randn(5, generator=g, dtype=D), (0.5 * torch.randn(5, generator=g, dtype=D)).log_softmax(-1)
    def grad(f):
        theta = theta0.clone().requires_grad_()
        f(theta.log_softmax(-1)).backward()
        return theta.grad
    def expected(per_token): return grad(lambda lp: (lp.exp().detach() * per_token(lp)).sum())   # sum_x pi(x) grad loss(x)
    forward = grad(lambda lp: (lp.exp() * (lp - ref)).sum())
    reverse = grad(lambda lp: (ref.exp() * (ref - lp)).sum())
    one = torch.ones(5)
    in_reward = expected(lambda lp: -kl_in_reward(torch.zeros_like(lp), lp, ref, one, 1.0) * (lp - lp.detach()).exp())
    torch.testing.assert_close(in_reward, forward)
    torch.testing.assert_close(expected(lambda lp: kl_penalty(lp, ref, 'k2')), forward)
    torch.testing.assert_close(expected(lambda lp: kl_penalty(lp, ref, 'k1')), torch.zeros(5, dtype=D))
    torch.testing.assert_close(expected(lambda lp: kl_penalty(lp, ref, 'k3')), reverse)
    assert (forward - reverse).abs().max() > 1e-2                # the two KLs' gradients really differ here
    # the same through kl_loss on sampled tokens, within 5 standard errors
    tokens = torch.multinomial(theta0.softmax(-1), 100_000, replacement=True, generator=g)[None]
    theta = theta0.clone().requires_grad_()
    lp = theta.log_softmax(-1)[tokens]
    kl_loss(lp, ref[tokens], torch.ones_like(tokens), 'k3').backward()
    r = (ref - theta0.log_softmax(-1)).exp()
    terms = (1 - r)[tokens[0], None] * (torch.nn.functional.one_hot(tokens[0], 5) - theta0.softmax(-1))
    assert ((theta.grad - reverse).abs() <= 5 * terms.std(0) / math.sqrt(tokens.numel()) + 1e-12).all()


def test_kl_in_reward_only_on_llm_tokens():
    g = torch.Generator().manual_seed(1)
    rewards, lp, ref = (torch.randn(2, 8, generator=g) for _ in range(3))
    mask = torch.rand(2, 8, generator=g) < .5
    out = kl_in_reward(rewards, lp.requires_grad_(), ref, mask, 0.05)
    torch.testing.assert_close(out, torch.where(mask, rewards - 0.05 * (lp.detach() - ref), rewards))
    assert not out.requires_grad


class _Vocab:
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0
    def __len__(self): return 32


def test_one_ppo_step_moves_logprobs_with_the_advantage():
    "On a tiny model: after one step, sampled tokens with A > 0 got likelier, those with A < 0 less likely, env tokens untouched by the loss."
    model = tiny_model(_Vocab(), seed=0)
    g = torch.Generator().manual_seed(0)
    def traj(seed):
        ids = lambda n: torch.randint(3, 32, (n,), generator=g).tolist()
        t = Trajectory(seed=seed).add(ids(5), PROMPT, 0).add(ids(6), LLM, 1, [-1.] * 6).add(ids(4), ENV, 1).add(ids(6), LLM, 2, [-1.] * 6)
        t.rewards += [0., 1. if seed % 2 else -1.]
        return t
    b = collate([traj(s) for s in range(6)], pad_id=0)
    adv = torch.where(b.loss_mask.bool(), b.token_rewards.sum(-1, keepdim=True), 0.)
    with torch.no_grad(): old = forward_logprobs(model, b)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids)
    lp = token_logprobs(out.logits, b.input_ids)
    pg_loss, _ = policy_loss(lp, old, adv, b.loss_mask)
    loss = pg_loss - 0.001 * masked_mean(entropy_from_logits(out.logits), b.loss_mask)
    loss.backward()
    opt.step()
    model.eval()
    with torch.no_grad(): new = forward_logprobs(model, b)
    delta = new - old
    assert masked_mean(delta, adv > 0).item() > 0 > masked_mean(delta, adv < 0).item()
