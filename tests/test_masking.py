"Collate rules on random trajectories (Hypothesis), logprob shifts, padding and the env-token invariance."
from dataclasses import fields, replace

import pytest
import torch
from hypothesis import given, settings, strategies as st

import re

from ragen_nb.masking import (Batch, SharedStart, collate, env_mask, forward_logprobs, llm_forward, mask_table, masked_mean,
                              packed_forward, token_logprobs)
from ragen_nb.models import tiny_model
from ragen_nb.tokens import ENV, LLM, PROMPT, Trajectory

VOCAB = 23


@st.composite
def trajectories(draw, seed=None):
    "A random multi-turn trajectory: a prompt, then per turn LLM tokens and (maybe) env tokens."
    t = Trajectory(seed=draw(st.integers(0, 5)) if seed is None else seed)
    t.add(draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=5)), PROMPT, 0)
    for k in range(1, draw(st.integers(1, 4)) + 1):
        ids = draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=6))
        t.add(ids, LLM, k, draw(st.lists(st.floats(-5, 0), min_size=len(ids), max_size=len(ids))))
        env = draw(st.lists(st.integers(1, VOCAB - 1), max_size=6))
        if env: t.add(env, ENV, k)
        t.rewards.append(draw(st.sampled_from([-0.1, 0.9, 10.9, -1.1, 0.0])))
    return t


def reference_row(t: Trajectory, per_turn: bool):
    "What one row must hold, written out token by token from the trajectory."
    llm = [s == LLM for s in t.sources]
    rewards = [0.0] * len(t.ids)
    if per_turn:
        for k, r in enumerate(t.rewards, start=1):
            last = max(i for i, (m, turn) in enumerate(zip(llm, t.turns)) if m and turn == k)
            rewards[last] += r
    else: rewards[max(i for i, m in enumerate(llm) if m)] = sum(t.rewards)
    return dict(loss_mask=[float(m) for m in llm], token_rewards=rewards, turn_ids=list(t.turns),
                sampled_logprobs=[lp if m else 0.0 for lp, m in zip(t.logprobs, llm)], input_ids=list(t.ids),
                position_ids=list(range(len(t.ids))), attention_mask=[1] * len(t.ids))


@settings(max_examples=60, deadline=None)
@given(st.lists(trajectories(), min_size=1, max_size=4), st.booleans())
def test_collate_matches_token_by_token_reference(trajs, per_turn):
    b = collate(trajs, pad_id=0, per_turn_rewards=per_turn)
    L = max(len(t) for t in trajs)
    assert b.input_ids.shape == (len(trajs), L)
    for i, t in enumerate(trajs):
        n = len(t)
        for name, want in reference_row(t, per_turn).items():
            torch.testing.assert_close(getattr(b, name)[i, :n].double(), torch.tensor(want, dtype=torch.double), msg=name)
        assert (b.input_ids[i, n:] == 0).all() and (b.attention_mask[i, n:] == 0).all()
        assert (b.loss_mask[i, n:] == 0).all() and (b.token_rewards[i, n:] == 0).all() and (b.turn_ids[i, n:] == -1).all()
        assert b.token_rewards[i].sum().item() == pytest.approx(t.total_reward, abs=1e-5)
    assert b.seeds.tolist() == [t.seed for t in trajs]


@settings(max_examples=40, deadline=None)
@given(trajectories(), st.integers(1, VOCAB - 1))
def test_env_ids_change_nothing_but_ids(t, shift):
    swapped = replace(t, ids=[(i + shift) % VOCAB if s == ENV else i for i, s in zip(t.ids, t.sources)])
    for per_turn in (False, True):
        b1, b2 = collate([t], 0, per_turn), collate([swapped], 0, per_turn)
        for f in fields(Batch):
            x, y = getattr(b1, f.name), getattr(b2, f.name)
            if f.name == 'input_ids': continue
            if x is None: assert y is None, f.name   # the fields only score_batch (18) fills
            else: assert torch.equal(x, y), f.name
        assert torch.equal(b1.input_ids != b2.input_ids, env_mask(b1))


def test_env_mask_picks_env_tokens_only():
    t = Trajectory(seed=0).add([1, 2], PROMPT, 0).add([3, 4], LLM, 1, [-1., -1.]).add([5], ENV, 1).add([6], LLM, 2, [-1.])
    b = collate([t, Trajectory(seed=1).add([1], PROMPT, 0).add([2], LLM, 1, [-1.])], pad_id=0)
    assert env_mask(b).tolist() == [[False, False, False, False, True, False], [False] * 6]


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64, torch.bfloat16])
def test_token_logprobs_against_categorical(dtype):
    g = torch.Generator().manual_seed(0)
    logits, ids = torch.randn(3, 7, 13, generator=g).to(dtype), torch.randint(0, 13, (3, 7), generator=g)
    want = torch.zeros(3, 7)
    for i in range(3):
        for t in range(1, 7):
            want[i, t] = torch.distributions.Categorical(logits=logits[i, t - 1].float()).log_prob(ids[i, t])
    got = token_logprobs(logits, ids)
    assert got.dtype == torch.float32                       # computed in float32 even from bf16 logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_token_logprobs_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match='must share'): token_logprobs(torch.randn(2, 5, 7), torch.zeros(2, 4, dtype=torch.long))


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 5), st.integers(1, 9), st.integers(0, 10_000))
def test_masked_mean_is_mean_over_valid_tokens(B, L, seed):
    g = torch.Generator().manual_seed(seed)
    x, m = torch.randn(B, L, generator=g, dtype=torch.float64), torch.rand(B, L, generator=g) < .5
    x_dirty = torch.where(m, x, torch.tensor(float('nan'), dtype=torch.float64))   # junk off the mask must not leak
    want = x[m].mean() if m.any() else torch.tensor(0., dtype=torch.float64)
    torch.testing.assert_close(masked_mean(x_dirty, m), want)
    rows = torch.stack([x[i][m[i]].mean() if m[i].any() else torch.tensor(0., dtype=torch.float64) for i in range(B)])
    torch.testing.assert_close(masked_mean(x_dirty, m, dim=1), rows)


class _Vocab:
    "Just enough of a tokenizer for `tiny_model`: a size and three special ids."
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0
    def __len__(self): return VOCAB


def _two_rows():
    a = Trajectory(seed=0).add([1, 5, 6], PROMPT, 0).add([7, 8, 2], LLM, 1, [-1.] * 3).add([9, 10], ENV, 1).add([11, 2], LLM, 2, [-1.] * 2)
    b = Trajectory(seed=1).add([1, 5], PROMPT, 0).add([12, 2], LLM, 1, [-1.] * 2)
    return collate([a, b], pad_id=0)


@pytest.mark.parametrize('temperature', [1.0, 0.7])
def test_forward_logprobs_ignores_padding(temperature):
    model, b = tiny_model(_Vocab(), seed=1), _two_rows()
    with torch.no_grad():
        lp = forward_logprobs(model, b, temperature)
        for i in range(len(b)):
            n = int(b.attention_mask[i].sum())
            row = b.input_ids[i:i + 1, :n]
            torch.testing.assert_close(lp[i, :n], token_logprobs(model(row).logits / temperature, row)[0], atol=1e-5, rtol=1e-5)
            assert (lp[i, n:] == 0).all()


def test_forward_logprobs_uses_attention_mask_and_position_ids():
    "A left-padded row (as an engine might hand over) must score like the row alone: only true if both are passed."
    model = tiny_model(_Vocab(), seed=2)
    row = torch.tensor([[5, 6, 7, 8]])
    padded = Batch(input_ids=torch.tensor([[0, 0, 5, 6, 7, 8]]), attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1]]),
                   position_ids=torch.tensor([[0, 0, 0, 1, 2, 3]]), loss_mask=torch.zeros(1, 6), token_rewards=torch.zeros(1, 6),
                   sampled_logprobs=torch.zeros(1, 6), turn_ids=torch.zeros(1, 6, dtype=torch.long), seeds=torch.tensor([0]))
    with torch.no_grad():
        torch.testing.assert_close(forward_logprobs(model, padded)[0, 3:], token_logprobs(model(row).logits, row)[0, 1:],
                                   atol=1e-5, rtol=1e-5)


def _pg_loss_and_grad(b, logits, mask):
    lg = logits.clone().requires_grad_()
    adv = torch.linspace(-1, 2, b.input_ids.shape[1]).expand(b.input_ids.shape)
    loss = -masked_mean(token_logprobs(lg, b.input_ids) * adv, mask)
    loss.backward()
    return loss.detach(), lg.grad


@pytest.mark.parametrize('mask_name, invariant', [('loss_mask', True), ('inverted (RAGEN #62)', False),
                                                  ('attention', False), ('loss mask shifted left', False)])
def test_env_swap_invariance_catches_wrong_masks(mask_name, invariant):
    "The loss under the loss mask ignores env ids; the bugs people shipped do not."
    masks = {'loss_mask': lambda b: b.loss_mask, 'inverted (RAGEN #62)': lambda b: env_mask(b).float(),
             'attention': lambda b: b.attention_mask.float(),
             'loss mask shifted left': lambda b: torch.nn.functional.pad(b.loss_mask[:, 1:], (0, 1))}
    b = _two_rows()
    g = torch.Generator().manual_seed(0)
    shift = torch.randint(1, VOCAB, b.input_ids.shape, generator=g)
    swapped = replace(b, input_ids=torch.where(env_mask(b), (b.input_ids + shift) % VOCAB, b.input_ids))
    logits = torch.randn(*b.input_ids.shape, VOCAB, generator=g)
    (l1, g1), (l2, g2) = (_pg_loss_and_grad(x, logits, masks[mask_name](x)) for x in (b, swapped))
    same = torch.allclose(l1, l2) and torch.allclose(g1, g2)
    assert same == invariant


def test_batch_rows_and_device():
    b = _two_rows()
    one = b[1]
    assert len(one) == 1 and one.seeds.tolist() == [1] and torch.equal(one.input_ids, b.input_ids[1:2])
    assert torch.equal(b[torch.tensor([1, 0])].seeds, torch.tensor([1, 0]))
    assert b.to('cpu').loss_mask.device.type == 'cpu'


def test_collate_errors_say_what_to_do():
    with pytest.raises(ValueError, match='at least one'): collate([], 0)
    with pytest.raises(ValueError, match='no LLM tokens'): collate([Trajectory().add([1], PROMPT, 0)], 0)
    broken = Trajectory().add([1], PROMPT, 0).add([2], LLM, 1, [-1.])
    broken.logprobs.append(0.)
    with pytest.raises(ValueError, match='Trajectory.add'): collate([broken], 0)
    gap = Trajectory().add([1], PROMPT, 0).add([2], LLM, 1, [-1.]).add([3], ENV, 2)
    gap.rewards += [0.0, 1.0]                                     # a reward for turn 2, which has no LLM token
    with pytest.raises(ValueError, match='turn 2'): collate([gap], 0, per_turn_rewards=True)


@settings(max_examples=30, deadline=None)
@given(st.lists(trajectories(), min_size=1, max_size=3))
def test_mask_table_colours_each_column_by_who_wrote_it(trajs):
    "One cell per column and line, classed by its writer (prompt, LLM, env, pad), bold exactly on loss-mask 1s."
    b = collate(trajs, pad_id=0)
    for row, t in enumerate(trajs):
        page = mask_table(b, row).data
        lines = re.findall(r'<tr><th>([^<]*)</th>(.*?)</tr>', page)
        assert [name for name, _ in lines] == ['token', 'turn', 'position', 'attention', 'loss mask', 'reward', 'sampled logprob']
        kinds = [('prompt', 'LLM', 'env')[s] for s in t.sources] + ['pad'] * (b.input_ids.shape[1] - len(t))
        for name, cells in lines:
            classes = re.findall(r'<td class="([^"]*)">', cells)
            assert [c.split()[0] for c in classes] == kinds
            assert [c.endswith(' on') for c in classes] == ([k == 'LLM' for k in kinds] if name == 'loss mask' else [False] * len(kinds))
        assert len(re.findall(r'<td ', mask_table(b, row, start=2, end=5).data)) == 7 * len(kinds[2:5])


@st.composite
def room_groups(draw):
    "Two room groups of 1-3 rollouts each: every rollout of a group shares its group's prompt, every prompt the first ids of the other's."
    start = draw(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=4))
    groups = []
    for g in range(2):
        prompt = start + draw(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=4))
        group = []
        for _ in range(draw(st.integers(1, 3))):
            t = Trajectory(seed=g).add(prompt, PROMPT, 0)
            for k in range(1, draw(st.integers(1, 3)) + 1):
                t.add(draw(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=4)), LLM, k)
                env = draw(st.lists(st.integers(3, VOCAB - 1), max_size=4))
                if env: t.add(env, ENV, k)
            group.append(t)
        groups.append(group)
    return groups


@settings(max_examples=25, deadline=None)
@given(room_groups(), st.sampled_from([1.0, 0.7]))
def test_packed_forward_gives_the_plain_logprobs_entropies_and_gradients(groups, temperature):
    "Each room group packed into one sequence after a start run once for both: the logprobs and entropies of the padded plain pass (and the reference, `forward_logprobs`), and its gradients, the start's included."
    model = tiny_model(_Vocab(), seed=2)
    b = collate([t for g in groups for t in g], pad_id=0)
    model.zero_grad()
    lp, ent, _ = llm_forward(model, b, temperature, entropy=True)
    (lp.sum() + ent.sum()).backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    start = SharedStart(model, b, grad=True)
    rows = [list(range(len(groups[0]))), list(range(len(groups[0]), len(b)))]
    fast = [packed_forward(model, b[r], temperature, True, start) for r in rows]
    (sum(l.sum() + e.sum() for l, e in fast)).backward(); start.backward()
    torch.testing.assert_close(torch.cat([l for l, _ in fast]).detach(), lp.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat([e for _, e in fast]).detach(), ent.detach(), atol=1e-5, rtol=0)
    with torch.no_grad(): torch.testing.assert_close(lp, forward_logprobs(model, b, temperature) * b.loss_mask, atol=1e-5, rtol=0)
    for p, g in zip(model.parameters(), plain): torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-4)
