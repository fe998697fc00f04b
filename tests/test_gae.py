"GAE (token-level, through env tokens, turn-level) against plain-Python references, hand-computed values and invariances; whitening."
import pytest
import torch
from hypothesis import given, settings, strategies as st

from ragen_nb.gae import gae, gae_loop, gae_through_env, turn_level_gae, whiten


D = torch.float64


def python_gae(rewards, values, mask, gamma, lam):
    "Textbook GAE on each row's list of LLM tokens, in plain Python: the independent reference."
    adv = [[0.0] * len(r) for r in rewards]
    for i, (r, v, m) in enumerate(zip(rewards, values, mask)):
        pos = [t for t, x in enumerate(m) if x]
        last = 0.0
        for k in reversed(range(len(pos))):
            next_v = v[pos[k + 1]] if k + 1 < len(pos) else 0.0
            last = r[pos[k]] + gamma * next_v - v[pos[k]] + gamma * lam * last
            adv[i][pos[k]] = last
    return torch.tensor(adv, dtype=D)


def random_case(seed, B=5, L=17, p=0.5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, L, generator=g, dtype=D), torch.randn(B, L, generator=g, dtype=D),
            torch.rand(B, L, generator=g) < p, g)


gammas = st.sampled_from([0.0, 0.5, 0.9, 0.99, 1.0])


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 10_000), gammas, gammas, st.integers(1, 6), st.integers(1, 40), st.floats(0.0, 1.0))
def test_gae_loop_and_fast_match_python_reference(seed, gamma, lam, B, L, p):
    r, v, m, _ = random_case(seed, B, L, p)
    want = python_gae(r.tolist(), v.tolist(), m.tolist(), gamma, lam)
    for fn in (gae_loop, gae):
        adv, ret = fn(r, v, m, gamma, lam)
        torch.testing.assert_close(adv, want, atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(ret, torch.where(m, want + v, 0.), atol=1e-9, rtol=1e-9)


def test_hand_computed_two_rows_with_padding():
    # row 0: L L E E L L with gamma=0.9, lam=0.8 (worked out in 07); row 1: one LLM token then padding.
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [0, 1, 0, 0, 0, 0]])
    values = torch.tensor([[.5, .6, 9., 9., .7, .8], [3., 2., 0., 0., 0., 0.]], dtype=D)
    rewards = torch.tensor([[0., 0., 5., 5., 0., 1.], [0., 1.5, 0., 0., 0., 0.]], dtype=D)
    for fn in (gae_loop, gae):
        adv, ret = fn(rewards, values, mask, 0.9, 0.8)
        torch.testing.assert_close(adv, torch.tensor([[0.1466176, 0.14808, 0, 0, 0.164, 0.2], [0, -0.5, 0, 0, 0, 0]], dtype=D))
        torch.testing.assert_close(ret, torch.tensor([[0.6466176, 0.74808, 0, 0, 0.864, 1.0], [0, 1.5, 0, 0, 0, 0]], dtype=D))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), gammas, gammas)
def test_env_token_values_and_rewards_change_nothing(seed, gamma, lam):
    r, v, m, g = random_case(seed)
    r2 = torch.where(m, r, 1e3 * torch.randn(r.shape, generator=g, dtype=D))
    v2 = torch.where(m, v, 1e3 * torch.randn(v.shape, generator=g, dtype=D))
    for fn in (gae_loop, gae):
        torch.testing.assert_close(fn(r, v, m, gamma, lam), fn(r2, v2, m, gamma, lam), atol=1e-9, rtol=1e-9)
    tid = (torch.arange(r.shape[1]) // 4 + 1).expand(r.shape)
    torch.testing.assert_close(turn_level_gae(r, v, m, tid, gamma, lam, 0.9, 0.95),
                               turn_level_gae(r2, v2, m, tid, gamma, lam, 0.9, 0.95), atol=1e-9, rtol=1e-9)


def test_gamma_lambda_one_is_reward_to_go_minus_value():
    r, v, m, _ = random_case(3, B=6, L=30)
    to_go = torch.where(m, r, 0.).flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(gae(r, v, m, 1., 1.)[0], torch.where(m, to_go - v, 0.))


def test_lambda_zero_is_one_step_td():
    r, v, m, _ = random_case(4, B=1, L=12)
    pos = m[0].nonzero().flatten().tolist()
    want = torch.zeros_like(r)
    for k, t in enumerate(pos):
        next_v = v[0, pos[k + 1]] if k + 1 < len(pos) else 0.
        want[0, t] = r[0, t] + 0.9 * next_v - v[0, t]
    torch.testing.assert_close(gae(r, v, m, 0.9, 0.)[0], want)


def test_long_rows_stay_finite_and_exact():
    r, v, m, _ = random_case(5, B=2, L=3000, p=0.9)
    a_fast, a_loop = gae(r, v, m, 0.99, 0.95)[0], gae_loop(r, v, m, 0.99, 0.95)[0]
    assert torch.isfinite(a_fast).all()
    torch.testing.assert_close(a_fast, a_loop, atol=1e-9, rtol=1e-9)


def test_advantages_carry_no_gradient():
    r, v, m, _ = random_case(6)
    v.requires_grad_()
    for fn in (gae_loop, gae):
        adv, ret = fn(r, v, m, 0.9, 0.9)
        assert not adv.requires_grad and not ret.requires_grad


def test_gae_errors_on_shape_mismatch():
    with pytest.raises(ValueError, match='same'): gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


def test_through_env_decays_per_env_token():
    # one reward at the end, no critic: skipping discounts by (γλ) per LLM token, the wrong way per token of any kind
    mask = torch.tensor([[1, 0, 0, 0, 1]])
    rewards = torch.tensor([[0., 0., 0., 0., 1.]], dtype=D)
    zeros = torch.zeros_like(rewards)
    assert gae(rewards, zeros, mask, 0.9, 1.)[0][0, 0].item() == pytest.approx(0.9)
    assert gae_through_env(rewards, zeros, mask, 0.9, 1.)[0][0, 0].item() == pytest.approx(0.9 ** 4)
    full = torch.ones_like(mask)                               # no env tokens: both are the same
    torch.testing.assert_close(gae(rewards, zeros, full, 0.9, .8), gae_through_env(rewards, zeros, full, 0.9, .8))


def test_whiten_uses_masked_tokens_only():
    r, v, m, g = random_case(7, B=4, L=20)
    w = whiten(r, m)
    assert w[m].mean().item() == pytest.approx(0, abs=1e-9) and w[m].std().item() == pytest.approx(1, abs=1e-6)
    assert (w[~m] == 0).all()
    torch.testing.assert_close(w, whiten(torch.where(m, r, 1e6), m))
    assert whiten(r, m, shift_mean=False)[m].mean().item() == pytest.approx(r[m].mean().item())
    with pytest.raises(ValueError, match='at least 2'): whiten(r, torch.zeros_like(m))


def python_turn_gae(rewards, values, mask, turn_ids, gamma, lam, turn_gamma, turn_lam):
    "Bi-level GAE in plain Python, one row at a time."
    out = [[0.0] * len(r) for r in rewards]
    for i in range(len(rewards)):
        turns = sorted({turn_ids[i][t] for t in range(len(mask[i])) if mask[i][t]})
        pos = {k: [t for t in range(len(mask[i])) if mask[i][t] and turn_ids[i][t] == k] for k in turns}
        R = [sum(rewards[i][t] for t in pos[k]) for k in turns]
        V = [values[i][pos[k][0]] for k in turns]
        G, last = [0.0] * len(turns), 0.0
        for j in reversed(range(len(turns))):
            last = R[j] + turn_gamma * (V[j + 1] if j + 1 < len(turns) else 0.) - V[j] + turn_gamma * turn_lam * last
            G[j] = last + V[j]
        for j, k in enumerate(turns):
            p, last = pos[k], 0.0
            for q in reversed(range(len(p))):
                reward = G[j] if q == len(p) - 1 else 0.0
                next_v = values[i][p[q + 1]] if q + 1 < len(p) else 0.0
                last = reward + gamma * next_v - values[i][p[q]] + gamma * lam * last
                out[i][p[q]] = last
    return torch.tensor(out, dtype=D)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), gammas, gammas, gammas, gammas)
def test_turn_level_gae_matches_python_reference(seed, gamma, lam, turn_gamma, turn_lam):
    r, v, m, g = random_case(seed, B=4, L=24, p=0.6)
    turn_ids = torch.randint(1, 5, r.shape, generator=g).sort(-1).values
    want = python_turn_gae(r.tolist(), v.tolist(), m.tolist(), turn_ids.tolist(), gamma, lam, turn_gamma, turn_lam)
    adv, ret = turn_level_gae(r, v, m, turn_ids, gamma, lam, turn_gamma, turn_lam)
    torch.testing.assert_close(adv, want, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(ret, torch.where(m, want + v, 0.), atol=1e-9, rtol=1e-9)


def test_turn_level_gae_hand_computed_and_zero_reward_turns_count():
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 0, 1]])
    turns = torch.tensor([[0, 1, 1, 1, 2, 2, 2, 3]])
    values = torch.tensor([[7., .2, .3, 7., .4, .5, 7., .6]], dtype=D)
    rewards = torch.tensor([[0., 0., 1., 0., 0., 0., 0., 2.]], dtype=D)   # turn 2's reward is exactly 0
    adv, _ = turn_level_gae(rewards, values, mask, turns, turn_gamma=0.5)
    # G3 = 2, G2 = 0 + .5 * 2 = 1, G1 = 1 + .5 * 1 = 1.5; token advantages G_k - V_t
    torch.testing.assert_close(adv, torch.tensor([[0, 1.3, 1.2, 0, .6, .5, 0, 1.4]], dtype=D))
