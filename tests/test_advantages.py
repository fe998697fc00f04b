"Outcome advantages (GRPO, BRPO, ARPO, MaxRL) against per-group references, MaxRL's expected update, and their edge cases."
import itertools, math

import pytest
import torch

from ragen_nb.advantages import outcome_advantages


D = torch.float64


def test_outcome_advantages_against_per_group_reference():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(12, generator=g, dtype=D)
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 0, 1])
    mask = torch.rand(12, 9, generator=g) < .5
    got = outcome_advantages(scores, groups, mask, 'grpo')
    for i in range(12):
        same = [scores[j].item() for j in range(12) if groups[j] == groups[i]]
        if len(same) == 1: want = 0.0
        else:
            mean = sum(same) / len(same)
            std = math.sqrt(sum((s - mean) ** 2 for s in same) / (len(same) - 1))
            want = (scores[i].item() - mean) / (std + 1e-6)
        assert torch.allclose(got[i][mask[i]], torch.tensor(want, dtype=D)), i
        assert (got[i][~mask[i]] == 0).all()
    brpo = outcome_advantages(scores, groups, mask, 'brpo')
    torch.testing.assert_close(brpo, torch.where(mask, ((scores - scores.mean()) / (scores.std() + 1e-6))[:, None], 0.))
    torch.testing.assert_close(outcome_advantages(scores, groups, mask, 'arpo'), torch.where(mask, scores[:, None], 0.))


def test_maxrl_against_per_group_reference():
    g = torch.Generator().manual_seed(1)
    success = (torch.rand(14, generator=g) < .4).to(D)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3, 4])
    mask = torch.rand(14, 5, generator=g) < .6
    got = outcome_advantages(success, groups, mask, 'maxrl')
    for i in range(14):
        same = [success[j].item() for j in range(14) if groups[j] == groups[i]]
        mean = sum(same) / len(same)
        want = 0.0 if len(same) == 1 or mean == 0 else (success[i].item() - mean) / mean
        assert torch.allclose(got[i][mask[i]], torch.tensor(want, dtype=D)), i
        assert (got[i][~mask[i]] == 0).all()
    with pytest.raises(ValueError, match='>= 0'): outcome_advantages(torch.tensor([1., -0.1]), torch.zeros(2), torch.ones(2, 1), 'maxrl')


def test_maxrl_expected_update_is_the_truncated_log_success_gradient():
    "Exact expectation over all 3**K groups, one room, a softmax over 3 actions: K * d/dθ sum_{k<K} (1 - (1 - p)**k) / k."
    logits = torch.tensor([0.4, -0.7, 0.9], dtype=D, requires_grad=True)
    logp = logits.log_softmax(-1)
    for K in (2, 3, 5):
        expected = torch.zeros(3, dtype=D)
        for group in itertools.product(range(3), repeat=K):
            s = torch.tensor([float(a == 0) for a in group], dtype=D)
            A = outcome_advantages(s, torch.zeros(K), torch.ones(K, 1), 'maxrl')[:, 0]
            chosen = logp[list(group)]
            expected += chosen.sum().exp().detach() * torch.autograd.grad((A * chosen).sum(), logits, retain_graph=True)[0]
        p = logits.softmax(-1)[0]
        objective = K * sum((1 - (1 - p) ** k) / k for k in range(1, K))
        torch.testing.assert_close(expected, torch.autograd.grad(objective, logits, retain_graph=True)[0])


def test_outcome_advantages_edge_cases():
    mask = torch.ones(3, 2)
    same = outcome_advantages(torch.tensor([1., 1., 1.]), torch.tensor([5, 5, 5]), mask, 'grpo')
    assert (same == 0).all()                                        # no spread, no signal
    with pytest.raises(ValueError, match="'grpo'"): outcome_advantages(torch.zeros(3), torch.zeros(3), mask, 'ppo')
    with pytest.raises(ValueError, match='2 scores for 3 rows of mask'): outcome_advantages(torch.zeros(2), torch.zeros(2), mask)
    with pytest.raises(ValueError, match=r'group_ids \(2,\) differ'): outcome_advantages(torch.zeros(3), torch.zeros(2), mask)
