"""The generated docs stay in step with the registry."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_model_zoo_table_is_current():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_model_zoo_docs.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_combiner_table_is_current():
    """docs/communication.md lists every registered --grad-combine mode and its options."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_comm_docs.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    from trainers import list_combiners

    text = (ROOT / "docs" / "communication.md").read_text(encoding="utf-8")
    for mode in list_combiners():
        assert f"| `{mode}` |" in text


def test_optimizer_options_table_is_current():
    """docs/optimizers.md lists every option flag of trainers.optim.OptimizerOptions."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_optim_docs.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    from trainers.optim import option_fields

    text = (ROOT / "docs" / "optimizers.md").read_text(encoding="utf-8")
    for field in option_fields():
        assert f"| `{field.flag}" in text


def test_readme_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = [b.split("```", 1)[0].strip() for b in text.split("```bash")[1:3]]
    assert "scripts/train_imagenet.py" in blocks[0]
    assert "pytest" in blocks[1]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert blocks[1] in ci, ".ci/run must run the README's test command verbatim"


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+\s+(.+)$", path.read_text(encoding="utf-8"), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_relative_links_in_the_docs_resolve():
    broken = []
    for page in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", link):  # https:, mailto:
                continue
            name, _, anchor = link.partition("#")
            target = page.parent / name if name else page
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link}")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such heading)")
    assert not broken, broken


def test_benchmarks_doc_names_every_benchmark():
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    for script in sorted((ROOT / "benchmarks").glob("[!_]*.py")):  # _report.py: a module
        assert f"python benchmarks/{script.name}" in text, f"docs/benchmarks.md: no {script.name}"


def _make_doc():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_doc", ROOT / "benchmarks" / "make_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmarks_results_table_is_the_rendering_of_the_stored_results():
    make_doc = _make_doc()
    assert make_doc.main(["--check"]) == 0, "run python benchmarks/make_doc.py"


def test_a_stored_result_whose_ratio_is_not_its_rounds_is_refused(tmp_path):
    import json
    import statistics

    make_doc = _make_doc()
    ours, peer = [1.0, 1.2, 0.9, 1.1, 1.0], [2.0, 2.2, 1.8, 2.1, 2.4]
    good = {"benchmark": "bench_x", "ours": "a", "peer": "b", "unit": "s", "ours_rounds": ours,
            "peer_rounds": peer, "ratio": statistics.median(peer) / statistics.median(ours),
            "target": 1.5, "machine": {"cpu": "c", "cpu_capability": "AVX2", "threads": 1,
            "load_average": 0.5}, "date": "2026-12-03"}  # fmt: skip
    path = tmp_path / "bench_x.json"
    path.write_text(json.dumps(good))
    assert make_doc.load(path)["ratio"] == 2.1
    row = make_doc.render({"bench_x": make_doc.load(path)})
    assert (
        "| `bench_x.py` | a | b | 0.9 / 1 / 1.2 s | 1.8 / 2.1 / 2.4 s | 2.100 (met) | ≥ 1.5 |"
        in row
    )
    for change, message in (({"ratio": 2.0}, "is not the rounds'"),
                            ({"ours_rounds": ours[:4]}, "fewer than 5")):  # fmt: skip
        path.write_text(json.dumps({**good, **change}))
        with pytest.raises(SystemExit, match=message):
            make_doc.load(path)
    path.write_text(json.dumps({k: v for k, v in good.items() if k != "machine"}))
    with pytest.raises(SystemExit, match="missing field.*machine"):
        make_doc.load(path)
