"The critic: ValueModel's values read at the previous position, zero on padding; a separate trunk or a head on the actor; no gradient to the actor."
import pytest
import torch

from ragen_nb.masking import collate, token_logprobs
from ragen_nb.critic import ValueModel, forward_values
from ragen_nb.models import tiny_model
from ragen_nb.ppo import entropy_from_logits
from tiny import episode


def test_values_read_from_previous_position_and_are_causal(tok):
    actor = tiny_model(tok)
    critic = ValueModel.from_causal_lm(actor, seed=1)
    ids = torch.randint(0, len(tok), (3, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        v = critic(ids)
        hidden = actor.model(input_ids=ids).last_hidden_state          # the actor's trunk = the critic's at the start
        expected = hidden @ critic.head.weight[0] + critic.head.bias    # independent head application
    assert v.shape == (3, 10) and v.dtype == torch.float32
    assert torch.equal(v[:, 0], torch.zeros(3))
    torch.testing.assert_close(v[:, 1:], expected[:, :-1], atol=1e-6, rtol=1e-5)
    for t in range(1, 10):
        changed = ids.clone()
        changed[:, t:] = torch.randint(0, len(tok), changed[:, t:].shape, generator=torch.Generator().manual_seed(t))
        with torch.no_grad(): w = critic(changed)
        torch.testing.assert_close(w[:, :t + 1], v[:, :t + 1], atol=1e-6, rtol=1e-5)
        if t + 1 < 10: assert (w[:, t + 1] - v[:, t + 1]).abs().min() > 1e-7   # token t is in the state of token t+1


def test_critic_is_an_independent_copy_of_the_actor_trunk(tok, tmp_path):
    actor = tiny_model(tok)
    critic = ValueModel.from_causal_lm(actor)
    with torch.no_grad(): critic.trunk.embed_tokens.weight.add_(1.)
    assert not torch.equal(critic.trunk.embed_tokens.weight, actor.model.embed_tokens.weight)
    actor.save_pretrained(tmp_path)
    loaded = ValueModel.from_pretrained(str(tmp_path), device='cpu')
    for k, p in actor.model.state_dict().items(): assert torch.equal(loaded.trunk.state_dict()[k], p), k
    assert torch.equal(loaded.head.weight, ValueModel.from_causal_lm(actor).head.weight)   # same seed, same head


def test_forward_values_zero_on_padding(tok):
    trajs = [episode(tok, 'Up', 1., 0), episode(tok, 'Down now please', -1., 1)]
    b = collate(trajs, tok.pad_token_id)
    with torch.no_grad(): v = forward_values(ValueModel.from_causal_lm(tiny_model(tok)), b)
    assert (v[b.attention_mask == 0] == 0).all() and (v[b.attention_mask == 1][1:] != 0).any()


def test_shared_critic_is_a_head_on_the_actors_final_hidden_state(tok):
    from ragen_nb.critic import policy_and_values
    actor = tiny_model(tok); critic = ValueModel.on_actor(actor, seed=3)
    b = collate([episode(tok, 'Up', 1., 0), episode(tok, 'Left', 0., 1)], tok.pad_token_id)
    logprobs, entropies, values = policy_and_values(actor, critic, b, temperature=2.0)
    hidden = actor.model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).last_hidden_state
    by_hand = hidden @ critic.head.weight[0] + critic.head.bias[0]             # value of token t read at t - 1
    torch.testing.assert_close(values[:, 1:], by_hand[:, :-1] * b.attention_mask[:, 1:])
    assert (values[:, 0] == 0).all()
    full = actor(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits / 2.0
    torch.testing.assert_close(logprobs, token_logprobs(full, b.input_ids) * b.loss_mask)   # the head ran on LLM positions only
    torch.testing.assert_close(entropies, entropy_from_logits(full) * b.loss_mask)
    assert [p for p in critic.parameters()] == [critic.head.weight, critic.head.bias]   # the critic's optimizer: the head only
    with pytest.raises(TypeError, match='policy_and_values'): critic(b.input_ids)


def test_value_loss_never_reaches_the_actors_weights_shared_critic_or_not(tok):
    from ragen_nb.critic import policy_and_values
    b = collate([episode(tok, 'Up', 1., 0)], tok.pad_token_id)
    grads = {}
    for kind in ('shared', 'separate'):
        actor = tiny_model(tok)
        critic = ValueModel.on_actor(actor) if kind == 'shared' else ValueModel.from_causal_lm(actor)
        _, _, values = policy_and_values(actor, critic, b)
        values.sum().backward()
        grads[kind] = (actor.model.layers[0].mlp.up_proj.weight.grad, bool(critic.head.weight.grad.abs().sum() > 0))
    assert grads == {'shared': (None, True), 'separate': (None, True)}       # the value loss trains the critic alone
