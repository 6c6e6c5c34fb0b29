"""Numbers quoted from logs/claims.json in the docs' prose: inline claim markers
(``<!--claim RECIPE FIELD-->TEXT<!--/claim-->``), filled and checked by scripts/publish.py."""

from __future__ import annotations

import json
import re
import shutil
import statistics
from pathlib import Path

import pytest

from tests.scripts._scripts import ROOT, load_script
from trainers.claims import ClaimsError, load_claims

publish = load_script("publish", "doc_claims")
CLAIMS_PATH = ROOT / "logs" / "claims.json"
CLAIMS = load_claims(CLAIMS_PATH)
# the metrics that are fractions (shown in percent); F1 is shown as it is
FRACTIONS = {"top1", "best_test_acc", "test_accuracy", "mlm_accuracy"}


def _seed_value(log: Path, metric: str, source: str) -> float:
    """A seed's headline value read straight from its log (not through trainers.claims)."""
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    kind = "eval" if source == "last_eval" else "end"
    return float([r for r in records if r["kind"] == kind][-1][metric])


def _expected(entry: dict) -> dict[str, str]:
    """What each marker field must show, computed here from the recipe's logs."""
    values = [_seed_value(ROOT / p, entry["metric"], entry["source"]) for p in entry["logs"]]
    mean, lo, hi = statistics.mean(values), min(values), max(values)
    std = statistics.stdev(values) if len(values) > 1 else None
    pct = entry["metric"] in FRACTIONS

    def show(v, unit=True):
        if v is None:
            return "-"
        return (f"{100 * v:.2f}" + (" %" if unit else "")) if pct else f"{v:.2f}"

    if entry["status"] == "negative":
        claim = max(entry["documented_minimum"], hi if std is None else mean + 3 * std)
    else:
        claim = (
            entry["documented_minimum"]
            if std is None
            else max(entry["documented_minimum"], mean - 3 * std)
        )
    return {
        "mean": show(mean),
        "std": show(std),
        "mean±std": show(mean) if std is None else f"{show(mean)} ± {show(std)}",
        "min": show(lo),
        "max": show(hi),
        "range": show(lo) if lo == hi else f"{show(lo, unit=False)}-{show(hi)}",
        "n": str(len(values)),
        "claim": show(claim),
        "minimum": show(entry["documented_minimum"]),
        "trivial": show(entry["trivial"]["value"]),
        "values": ", ".join(show(v) for v in values),
    }


@pytest.mark.parametrize(
    "name",
    [
        "digits_comm_ef_randblock_4proc",  # a negative result, accuracy in %: "9.75-10.03 %"
        "squad_minilm_6ep",  # F1: no unit
        "sbm_gat",  # five seeds
        "digits_lab4_160mbit_sgp",  # one seed: no std
    ],
)
def test_marker_text_is_the_seeds_statistics_computed_from_the_logs(name):
    expected = _expected(CLAIMS["recipes"][name])
    assert set(expected) == set(publish.MARKER_FIELDS)
    for field, text in expected.items():
        assert publish.claim_text(CLAIMS, name, field) == text, field
        line = f"x <!--claim {name} {field}-->stale<!--/claim--> y\n"
        assert publish.render_markers(CLAIMS, line) == line.replace("stale", text)


def test_the_range_and_the_spread_read_as_the_issue_quotes_them():
    assert publish.claim_text(CLAIMS, "digits_comm_ef_randblock_4proc", "range") == "9.75-10.03 %"
    fake = {"recipes": {"r": {"metric": "top1", "mean": 0.98789, "std": 0.00321, "min": 0.9861,
                              "max": 0.9916, "n": 3}}}  # fmt: skip
    assert publish.claim_text(fake, "r", "mean±std") == "98.79 % ± 0.32 %"


def _entry(values: list[float], **extra) -> dict:
    return {
        "description": "d", "metric": "top1", "source": "last_eval", "documented_minimum": 0.85,
        "min_seeds": len(values), "logs": [], "seeds": list(range(len(values))),
        "values": values, "n": len(values), "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else None, "min": min(values),
        "max": max(values), "claim": 0.85, "status": "published",
        "trivial": {"value": 0.1, "how": "majority class"}, "baseline": None, "diagnosis": None,
        **extra,
    }  # fmt: skip


@pytest.fixture
def tiny_repo(tmp_path, monkeypatch):
    """A repository with docs/page.md, README.md and a claims file of one recipe, ``fake``
    (seeds at 0.90, 0.91, 0.92)."""
    (tmp_path / "docs").mkdir()
    claims = tmp_path / "claims.json"
    claims.write_text(json.dumps({"recipes": {"fake": _entry([0.90, 0.91, 0.92])}}))
    monkeypatch.setattr(publish, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(publish, "DOCS", tmp_path / "docs")
    return tmp_path, claims


PAGE = """# A page
The method ends at <!--claim fake mean-->91.00 %<!--/claim--> over <!--claim fake n-->3<!--/claim--> seeds,
at least <!--claim fake min-->97.00 %<!--/claim--> on every seed (a stale copy).
Code is text: `<!--claim nothing here-->x<!--/claim-->`, and so is a fenced block:
```
<!--claim fake mean-->left alone<!--/claim-->
```
Spread: <!--claim fake mean±std-->91 ± 1 %<!--/claim-->.
"""


def test_docs_rewrites_every_marker_and_check_names_file_line_recipe_and_field(tiny_repo, capsys):
    root, claims = tiny_repo
    (root / "docs" / "page.md").write_text(PAGE)
    (root / "README.md").write_text("Top-1 <!--claim fake max-->0.92<!--/claim-->.\n")
    assert publish.main(["--claims", str(claims), "docs", "--check"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "docs/page.md:3: fake min: the marker reads '97.00 %', logs/claims.json gives "
        "'90.00 %' (run scripts/publish.py docs)",
        "docs/page.md:8: fake mean±std: the marker reads '91 ± 1 %', logs/claims.json gives "
        "'91.00 % ± 1.00 %' (run scripts/publish.py docs)",
        "README.md:1: fake max: the marker reads '0.92', logs/claims.json gives '92.00 %' "
        "(run scripts/publish.py docs)",
    ]
    assert (root / "docs" / "page.md").read_text() == PAGE  # --check changes nothing
    assert publish.main(["--claims", str(claims), "docs"]) == 0
    page = (root / "docs" / "page.md").read_text()
    assert "at least <!--claim fake min-->90.00 %<!--/claim--> on every seed" in page
    assert "Spread: <!--claim fake mean±std-->91.00 % ± 1.00 %<!--/claim-->." in page
    assert "`<!--claim nothing here-->x<!--/claim-->`" in page  # code: untouched
    assert "<!--claim fake mean-->left alone<!--/claim-->" in page
    assert (root / "README.md").read_text() == (
        "Top-1 <!--claim fake max-->92.00 %<!--/claim-->.\n"
    )
    assert publish.main(["--claims", str(claims), "docs", "--check"]) == 0
    # the claims change (a republication): the markers follow on the next run
    claims.write_text(json.dumps({"recipes": {"fake": _entry([0.80, 0.84])}}))
    assert publish.main(["--claims", str(claims), "docs", "--check"]) == 1
    assert publish.main(["--claims", str(claims), "docs"]) == 0
    assert "over <!--claim fake n-->2<!--/claim--> seeds" in (root / "docs/page.md").read_text()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("<!--claim nope mean-->1<!--/claim-->",
         "docs/page.md:2: marker names recipe 'nope', which logs/claims.json does not list"),
        ("<!--claim fake median-->1<!--/claim-->",
         "docs/page.md:2: marker names field 'median' of fake: a marker shows one of mean, "),
        ("<!--claim fake mean-->1 (never closed)", "docs/page.md:2: a malformed claim marker"),
        ("<!--claim fake-->1<!--/claim-->", "docs/page.md:2: a malformed claim marker"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("mode", [["docs"], ["docs", "--check"]])
def test_an_unknown_recipe_or_field_or_a_broken_marker_is_refused(
    tiny_repo, capsys, line, message, mode
):
    root, claims = tiny_repo
    text = f"# Page\nIt reads {line} here.\n"
    (root / "docs" / "page.md").write_text(text)
    assert publish.main(["--claims", str(claims), *mode]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"publish.py: error: {message}") and err.count("\n") == 1, err
    assert (root / "docs" / "page.md").read_text() == text  # nothing written
    with pytest.raises(ClaimsError, match="page.md:2"):
        publish.doc_problems(load_claims(claims), root / "docs", root=root)


def test_a_mutated_marker_in_the_real_docs_fails_the_check_naming_its_line(tmp_path):
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs, ignore=shutil.ignore_patterns("*.png"))
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    assert publish.doc_problems(CLAIMS, docs) == []
    page = docs / "decentralized.md"
    lines = page.read_text().splitlines(keepends=True)
    number = next(i for i, x in enumerate(lines, 1) if "<!--claim digits_resnest14_4proc" in x)
    true = publish.claim_text(CLAIMS, "digits_resnest14_4proc", "mean±std")
    lines[number - 1] = lines[number - 1].replace(true, "98.80 % ± 0.32 %", 1)
    page.write_text("".join(lines))
    problems = publish.doc_problems(CLAIMS, docs)
    assert len(problems) == 1
    assert re.search(
        rf"decentralized\.md:{number}: digits_resnest14_4proc mean±std: the marker reads "
        rf"'98\.80 % ± 0\.32 %', logs/claims\.json gives '{re.escape(true)}'",
        problems[0],
    ), problems


def test_every_marker_in_the_docs_and_the_readme_is_up_to_date_with_the_claims():
    assert publish.doc_problems(CLAIMS) == [], "run scripts/publish.py docs"
    per_file = {
        path.name: len(publish.markers(path.read_text(encoding="utf-8"), str(path)))
        for path in publish.doc_files()
    }
    assert per_file["README.md"] >= 1 and sum(per_file.values()) > 100, per_file


# -- no hand-written copy of a recipe's mean ---------------------------------------------------
# Files that are no prose: docs/model_zoo.md is generated from the model registry by
# scripts/make_model_zoo_docs.py (its numbers are the weights' metadata: parameter counts and
# seed 0's metrics; the MiniLM weights' F1 is pinned to squad_minilm's mean by
# tests/scripts/test_published_logs.py::test_the_minilm_weights_quote_the_squad_recipe_over_its_seeds).
NOT_PROSE = {"model_zoo.md"}
# (file, text around the number): a number that equals some recipe's mean but quotes no claim.
# The digits held-out set has 359 images, so accuracies are multiples of 1/359 and the means of
# 1-3 seeds coincide often.
COINCIDENCES = {
    # Adasum seeds made with earlier kernels and rules (unpublished, superseded)
    ("adasum.md", "ended at 98.05 % ±\n0.56 % (min 97.49 %)"),
    ("adasum.md", "at 98.44 % ± 0.32 % (min 98.05 %)"),
    # Local AdaAlter's earlier rule, before its republication (not in the claims any more)
    ("communication.md", "They ended at 97.77 % ± 0.44 % (min\n97.21 %)"),
    # cser-update's old log, kept in the git history only (commit 3264b7b)
    ("communication.md", "period 8: 98.72 % ± 0.15 %, 5 seeds"),
    # LANS's earlier runs (--no-adapt-no-wd), superseded
    ("optimizers.md", "ended at 98.94 ± 0.60 % (min 98.33 %)"),
    # NAG's and LAMB's digits seeds made on the Intel Xeon, before their portable republication
    ("optimizers.md", "they had ended at 98.77 % ± 0.54 % (NAG) and\n98.50 % ± 0.51 % (LAMB)"),
    ("run_logs.md", "NAG from 98.77 % ± 0.54 % to"),
    ("run_logs.md", "LAMB from 98.50 % ± 0.51 % to"),
    # unpublished native-kernel seeds of the digits recipe (per-seed values, not a mean)
    ("training.md", "held-out top-1 98.89, 99.44, 98.89, 98.61, 98.61 %"),
    ("training.md", "min 98.61 %"),
}


def _prose(text: str) -> str:
    """``text`` with the claims tables, the markers and the code blanked (lines kept)."""

    def blank(m: re.Match) -> str:  # the same length, so that offsets and lines stay
        return re.sub(r"[^\n]", " ", m.group(0))

    for pattern in (publish.BLOCK, publish.MARKER, re.compile(r"```.*?```", re.S), r"`[^`\n]*`"):
        text = re.sub(pattern, blank, text)
    return text


def _mean_as_written(entry: dict) -> str:
    """A recipe's mean as the tables write it, without the unit ("98.79", "29.67")."""
    return publish._fmt(entry["mean"], publish._is_fraction(entry), unit=False)


def hand_written_means(docs: Path, readme: Path, claims: dict) -> list[str]:
    """Every place where a recipe's mean is written outside markers, tables and code."""
    means: dict[str, list[str]] = {}
    for name, entry in claims["recipes"].items():
        means.setdefault(_mean_as_written(entry), []).append(name)
    numbers = "|".join(re.escape(n) for n in sorted(means, key=len, reverse=True))
    pattern = re.compile(rf"(?<![\d.])(?:{numbers})(?![\d])")
    found = []
    for path in sorted(docs.glob("*.md")) + [readme]:
        if path.name in NOT_PROSE:
            continue
        text = path.read_text(encoding="utf-8")
        prose = _prose(text)
        allowed = [
            (m.start(), m.end())
            for file, around in COINCIDENCES
            if file == path.name
            for m in re.finditer(re.escape(around), text)
        ]
        for m in pattern.finditer(prose):
            if not any(a <= m.start() < b for a, b in allowed):
                line = prose.count("\n", 0, m.start()) + 1
                for name in means[m.group(0)]:
                    found.append(f"{path.name}:{line}: {m.group(0)} is {name}'s mean")
    return found


def test_no_recipe_mean_is_written_by_hand_outside_markers_and_tables():
    found = hand_written_means(ROOT / "docs", ROOT / "README.md", CLAIMS)
    assert not found, (
        "write these as <!--claim RECIPE mean-->...<!--/claim--> (docs/run_logs.md), or list a "
        "genuine coincidence in COINCIDENCES:\n" + "\n".join(found)
    )


def test_the_scan_finds_a_hand_written_mean(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    readme = tmp_path / "README.md"
    readme.write_text("Averaging ends at <!--claim fake mean-->91.00 %<!--/claim-->.\n")
    claims = {"recipes": {"fake": _entry([0.90, 0.91, 0.92])}}
    (docs / "page.md").write_text("Intro.\nAveraging ends at 91.00 % here.\n`91.00` in code.\n")
    assert hand_written_means(docs, readme, claims) == ["page.md:2: 91.00 is fake's mean"]
    (docs / "page.md").write_text("<!-- claims: fake -->\n| 91.00 % |\n<!-- /claims -->\n")
    assert hand_written_means(docs, readme, claims) == []
