"""Small files in the official SQuAD JSON layout (``train-v1.1.json``, ``dev-v2.0.json``...),
for serving from a local HTTP server in place of the SQuAD site: a few articles, each answer
an exact span of its paragraph (its ``answer_start`` computed from the text)."""

from __future__ import annotations

import dataclasses
import hashlib
import json

OFFICIAL = "https://rajpurkar.github.io/SQuAD-explorer/dataset"

ARTICLES = {
    "Python_(programming_language)": [
        (
            "Python is a high-level programming language. Guido van Rossum began working on "
            "Python in the late 1980s, and it was first released in 1991.",
            [
                ("Who began working on Python?", "Guido van Rossum"),
                ("When was Python first released?", "1991"),
            ],
        ),
    ],
    "Zachary's_karate_club": [
        (
            "Zachary's karate club is a social network of a university karate club, described "
            "by Wayne W. Zachary in 1977. A conflict split the club into two.",
            [
                ("Who described the karate club network?", "Wayne W. Zachary"),
                ("What split the club into two?", "A conflict"),
            ],
        ),
        (
            "The network has 34 members and 78 friendships between members who interacted "
            "outside the club.",
            [("How many members does the network have?", "34")],
        ),
    ],
    "SQuAD": [
        (
            "The Stanford Question Answering Dataset was released by Pranav Rajpurkar and "
            "colleagues in 2016; its questions were posed by crowdworkers on Wikipedia articles.",
            [("Who posed the questions?", "crowdworkers")],
        ),
    ],
}
# v2.0 adds questions the paragraph cannot answer (with a plausible but wrong span).
UNANSWERABLE = {
    "Python_(programming_language)": ("When was Python last released?", "1991"),
    "SQuAD": ("Who posed the answers?", "crowdworkers"),
}


def squad_json(version: str = "1.1", split: str = "train") -> bytes:
    """The bytes of a small ``{split}-v{version}.json`` in the official layout."""
    articles = []
    for n, (title, paragraphs) in enumerate(ARTICLES.items()):
        out = []
        for p, (context, qas) in enumerate(paragraphs):
            questions = []
            for q, (question, answer) in enumerate(qas):
                entry = {
                    "id": f"{split}-{n}-{p}-{q}",
                    "question": question,
                    "answers": [{"text": answer, "answer_start": context.index(answer)}],
                }
                if version == "2.0":
                    entry["is_impossible"] = False
                questions.append(entry)
            if version == "2.0" and p == 0 and title in UNANSWERABLE:
                question, plausible = UNANSWERABLE[title]
                questions.append(
                    {
                        "id": f"{split}-{n}-{p}-none",
                        "question": question,
                        "answers": [],
                        "plausible_answers": [
                            {"text": plausible, "answer_start": context.index(plausible)}
                        ],
                        "is_impossible": True,
                    }
                )
            out.append({"context": context, "qas": questions})
        articles.append({"title": title, "paragraphs": out})
    official = "1.1" if version == "1.1" else "v2.0"  # as the two official files spell it
    return json.dumps({"version": official, "data": articles}).encode("utf-8")


def num_questions(version: str = "1.1") -> int:
    answerable = sum(len(qas) for paragraphs in ARTICLES.values() for _, qas in paragraphs)
    return answerable + (len(UNANSWERABLE) if version == "2.0" else 0)


def pin_small_squad(monkeypatch, version: str, base: str = OFFICIAL) -> dict[str, bytes]:
    """Pin the sha256 of the small files in place of the official ones for SQuAD ``version``
    (the registry entry and :data:`modelzoo.nlp.squad.SQUAD_DATASETS`), at the official URLs
    or at ``base``; returns the small files' bytes by official file name."""
    from modelzoo import data
    from modelzoo.data import DataFile
    from modelzoo.nlp import squad

    bodies = {f"{split}-v{version}.json": squad_json(version, split) for split in ("train", "dev")}
    files = {
        split: DataFile(
            url=f"{base}/{split}-v{version}.json",
            hash_prefix=hashlib.sha256(bodies[f"{split}-v{version}.json"]).hexdigest(),
            hash_source="the test's own bytes",
        )
        for split in ("train", "dev")
    }
    replaced = dataclasses.replace(squad.SQUAD_DATASETS[version], files=files)
    monkeypatch.setitem(squad.SQUAD_DATASETS, version, replaced)
    monkeypatch.setitem(data._REGISTRY, replaced.name, replaced)
    return bodies
