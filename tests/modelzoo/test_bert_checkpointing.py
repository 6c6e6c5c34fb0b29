"""BERT gradient checkpointing (``--gradient-checkpointing``).

Oracle: the same model without checkpointing. In training mode with dropout on and the same
seed, the loss and every gradient must be the same (the recomputation replays the RNG, so
dropout draws the same masks), and each layer must really run its forward twice.
"""

from __future__ import annotations

import pytest
import torch

from modelzoo.nlp.bert import BertConfig, BertLayer, build_bert

CONFIG = BertConfig(
    vocab_size=60, hidden_size=32, num_layers=3, num_heads=2, intermediate_size=64,
    max_position_embeddings=32, hidden_dropout=0.3, attention_dropout=0.3,
)  # fmt: skip


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG.vocab_size, (4, 12), generator=g)
    types = torch.randint(0, 2, (4, 12), generator=g)
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[1, 9:] = 0  # padding: the attention mask goes through the checkpoint too
    positions = torch.randint(0, 12, (4, 3), generator=g)
    return ids, types, mask, positions


def _count_layer_forwards(model) -> list[int]:
    calls = [0] * len(model.bert.layers)
    for i, layer in enumerate(model.bert.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def _loss_and_grads(checkpointing: bool):
    torch.manual_seed(0)
    model = build_bert(CONFIG, head="pretraining").train()
    model.bert.set_gradient_checkpointing(checkpointing)
    calls = _count_layer_forwards(model)
    torch.manual_seed(123)  # the dropout masks
    out = model(*_inputs())
    loss = out.mlm_logits.logsumexp(-1).mean() + out.nsp_logits.pow(2).mean()
    loss.backward()
    after = torch.rand(3)  # the RNG continues where it would have without checkpointing
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, calls, after


def test_gradients_equal_without_checkpointing_with_dropout():
    loss, grads, calls, after = _loss_and_grads(False)
    loss_c, grads_c, calls_c, after_c = _loss_and_grads(True)
    assert calls == [1, 1, 1]
    assert calls_c == [2, 2, 2]  # forward, and again in the backward
    assert torch.equal(loss, loss_c)
    assert grads.keys() == grads_c.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, grads_c[name]), name
    assert torch.equal(after, after_c)
    # the masks matter: another seed gives other gradients (dropout is really on)
    torch.manual_seed(0)
    model = build_bert(CONFIG, head="pretraining").train()
    torch.manual_seed(7)
    out = model(*_inputs())
    (out.mlm_logits.logsumexp(-1).mean() + out.nsp_logits.pow(2).mean()).backward()
    assert not torch.equal(model.bert.layers[0].fc1.weight.grad, grads["bert.layers.0.fc1.weight"])


@pytest.mark.parametrize("mode", ["eval", "no_grad"])
def test_no_recomputation_outside_training(mode):
    torch.manual_seed(0)
    model = build_bert(CONFIG, head="qa")
    model.bert.set_gradient_checkpointing(True)
    calls = _count_layer_forwards(model)
    ids, types, mask, _ = _inputs()
    if mode == "eval":
        model.eval()
        out = model(ids, types, mask)
        out.start.sum().backward()
    else:
        with torch.no_grad():
            model.train()(ids, types, mask)
    assert calls == [1, 1, 1]


def test_off_by_default_and_the_state_dict_is_unchanged():
    torch.manual_seed(0)
    plain = build_bert(CONFIG, head="qa")
    torch.manual_seed(0)
    switched = build_bert(CONFIG, head="qa")
    assert plain.bert.gradient_checkpointing is False
    assert switched.bert.set_gradient_checkpointing() is switched.bert
    assert switched.bert.gradient_checkpointing is True
    a, b = plain.state_dict(), switched.state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(isinstance(layer, BertLayer) for layer in switched.bert.layers)
    switched.bert.set_gradient_checkpointing(False)
    assert switched.bert.gradient_checkpointing is False
