"""Language models and data: BERT (:mod:`.bert`), WordPiece tokenization (:mod:`.tokenizer`),
SQuAD reading, features, post-processing and the official metric (:mod:`.squad`)."""
