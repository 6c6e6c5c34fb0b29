"""Language models and data: BERT (:mod:`.bert`), WordPiece tokenization (:mod:`.tokenizer`),
SQuAD reading, features, post-processing and the official metric (:mod:`.squad`)."""

# BERT's answers to the model-family protocol (export, pipeline and tensor parallelism):
# registered whenever any of modelzoo.nlp is imported, so modelzoo.nlp.bert has its family.
from . import bert_family  # noqa: E402, F401
