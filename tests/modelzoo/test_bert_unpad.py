"""BERT without the padding's work (``BertModel.set_unpadding``).

Oracles: our own model run padded
(the same weights, in float64: every real token's output, the loss and every gradient to
1e-12, the padding masked out of the padded model's span loss the way the unpadded one
scores it). The layers must really run on the real tokens only. Against Hugging Face
``transformers`` on the real MiniLM weights: ``test_bert.py``.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from modelzoo.nlp.bert import PAD_SPAN_LOGIT, BertConfig, build_bert

CONFIG = BertConfig(
    vocab_size=60, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
    max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0,
)  # fmt: skip


def _inputs(pad: bool = True):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, CONFIG.vocab_size, (3, 14), generator=g)
    types = torch.randint(0, 2, (3, 14), generator=g)
    mask = torch.ones(3, 14, dtype=torch.long)
    if pad:
        mask[1, 9:] = 0
        mask[2, 4:] = 0
    return ids, types, mask


def _pair(head: str, **config):
    torch.manual_seed(0)
    padded = build_bert(CONFIG if not config else BertConfig(**{**CONFIG.to_dict(), **config}),
                        head=head).double()  # fmt: skip
    unpadded = copy.deepcopy(padded)
    unpadded.bert.set_unpadding(True)
    return padded, unpadded


def _span_loss(out, mask, spans, *, mask_padding: bool):
    start, end = out.start, out.end
    if mask_padding:  # what the unpadded model scores the padding
        start = start.masked_fill(mask == 0, PAD_SPAN_LOGIT)
        end = end.masked_fill(mask == 0, PAD_SPAN_LOGIT)
    return F.cross_entropy(start, spans[:, 0]) + F.cross_entropy(end, spans[:, 1])


def test_real_tokens_outputs_loss_and_gradients_equal_the_padded_model():
    padded, unpadded = _pair("qa")
    ids, types, mask = _inputs()
    spans = torch.tensor([[1, 3], [2, 8], [0, 3]])
    a, b = padded(ids, types, mask), unpadded(ids, types, mask)
    real = mask.bool()
    for x, y in ((a.start, b.start), (a.end, b.end)):
        assert (x - y)[real].abs().max().item() < 1e-12
        assert torch.all(y[~real] == PAD_SPAN_LOGIT)  # the padding: never a start or end
    loss_a = _span_loss(a, mask, spans, mask_padding=True)
    loss_b = _span_loss(b, mask, spans, mask_padding=False)
    assert abs(loss_a.item() - loss_b.item()) < 1e-12
    loss_a.backward()
    loss_b.backward()
    for (name, p), q in zip(padded.named_parameters(), unpadded.parameters(), strict=True):
        assert p.grad.abs().max() > 0, name
        assert (p.grad - q.grad).abs().max().item() < 1e-12, name


def test_pretraining_heads_and_hidden_states_equal_the_padded_model():
    padded, unpadded = _pair("pretraining")
    ids, types, mask = _inputs()
    positions = torch.tensor([[0, 5, 7], [1, 2, 8], [0, 1, 3]])  # real tokens only
    a, b = padded(ids, types, mask, positions), unpadded(ids, types, mask, positions)
    assert (a.mlm_logits - b.mlm_logits).abs().max().item() < 1e-12
    assert (a.nsp_logits - b.nsp_logits).abs().max().item() < 1e-12
    (a.mlm_logits.sum() + a.nsp_logits.sum()).backward()
    (b.mlm_logits.sum() + b.nsp_logits.sum()).backward()
    for p, q in zip(padded.parameters(), unpadded.parameters(), strict=True):
        assert (p.grad - q.grad).abs().max().item() < 1e-12
    out_a = padded.bert(ids, types, mask, output_hidden_states=True)
    out_b = unpadded.bert(ids, types, mask, output_hidden_states=True)
    real = mask.bool()
    for x, y in zip(out_a.hidden_states, out_b.hidden_states, strict=True):
        assert (x - y)[real].abs().max().item() < 1e-12
        assert torch.all(y[~real] == 0)  # the padding's hidden states: zero


def test_layers_run_on_the_real_tokens_only():
    _, unpadded = _pair("qa")
    ids, types, mask = _inputs()
    rows = []
    for layer in unpadded.bert.layers:
        layer.fc1.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
        layer.attn.qkv.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
    unpadded(ids, types, mask)
    assert rows == [int(mask.sum())] * 4  # 23 of 42 positions, in every linear layer


def test_no_padding_or_no_mask_runs_the_padded_path_unchanged():
    padded, unpadded = _pair("qa")
    ids, types, mask = _inputs(pad=False)
    for m in (mask, None):
        a, b = padded(ids, types, m), unpadded(ids, types, m)
        assert torch.equal(a.start, b.start) and torch.equal(a.end, b.end)


def test_gradient_checkpointing_replays_the_unpadded_dropout():
    """Dropout on: the checkpointed unpadded model recomputes the same masks (RNG replay), so
    its loss and gradients are the unpadded model's."""
    runs = []
    for checkpointing in (False, True):
        _, model = _pair("qa", hidden_dropout=0.3, attention_dropout=0.3)
        model.bert.set_gradient_checkpointing(checkpointing)
        model.train()
        ids, types, mask = _inputs()
        torch.manual_seed(5)
        loss = _span_loss(model(ids, types, mask), mask, torch.tensor([[1, 3], [2, 8], [0, 3]]),
                          mask_padding=False)  # fmt: skip
        loss.backward()
        runs.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    for g0, g1 in zip(runs[0][1], runs[1][1], strict=True):
        assert torch.equal(g0, g1)
