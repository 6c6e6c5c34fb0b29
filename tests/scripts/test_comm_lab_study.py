"""scripts/comm_lab_study.py: the study covers the modes issue 38 names, each mode's flags
build that combiner, and the chosen caps give the lab the real settings' ratio.

Oracles: the ring all-reduce floor 2 (N - 1) / N x bytes / bandwidth (Patarasuk & Yuan), the
published per-GPU throughputs (NVIDIA DeepLearningExamples, A100, AMP) and parameter counts
(torchvision's ResNet-50: 25,557,032; BERT-Large: 335,141,888), and the registered
combiners.
"""

from __future__ import annotations

import pytest

from tests.scripts._scripts import load_script
from trainers.cli import build_combiner


@pytest.fixture(scope="module")
def study():
    return load_script("comm_lab_study")


@pytest.fixture(scope="module")
def train():
    return load_script("train_imagenet", "lab_study")


def test_every_mode_of_the_issue_is_in_the_study(study):
    # averaging, fp16, top-k and QSGD with error feedback, PowerSGD, local SGD, SlowMo, CSER,
    # Adasum, the sparse allreduce, SGP, AD-PSGD, Pipe-SGD
    combiners = {flags[flags.index("--grad-combine") + 1] for flags in study.MODES.values()}
    assert combiners == {"average", "fp16", "ef", "powersgd", "localsgd", "slowmo", "cser",
                         "adasum", "sgp", "adpsgd", "pipesgd"}  # fmt: skip
    compressors = {
        f[f.index("--compressor") + 1] for f in study.MODES.values() if "--compressor" in f
    }
    assert compressors == {"topk", "qsgd"}
    sparse = {
        f[f.index("--sparse-allreduce") + 1]
        for f in study.MODES.values()
        if "--sparse-allreduce" in f
    }
    assert sparse == {"allgather", "auto"}  # top-k gathered against top-k summed sparsely
    assert study.MODES["adpsgd_async"].count("--adpsgd-async") == 1  # the paper's algorithm


@pytest.mark.parametrize("mode", sorted(load_script("comm_lab_study", "modes").MODES))
def test_each_mode_builds_its_combiner_from_the_study_flags(study, train, mode):
    args = train.parse_args([*study.BASE[1:], *study.MODES[mode], "--seed", "0"])
    assert args.target_top1 == study.TARGET
    combiner = build_combiner(args)
    flags = study.MODES[mode]
    assert combiner.name == flags[flags.index("--grad-combine") + 1]


def test_the_caps_give_the_lab_the_real_settings_ratio(study):
    rows = {r["setting"]: r for r in study.cap_arithmetic()}
    resnet = rows["resnet50_a100_10gbe"]
    # ResNet-50 v1.5: 256 images at 2470/s per A100; 25,557,032 fp32 gradients; 8 nodes, 10 GbE
    compute = 256 / 2470
    comm = 2 * 7 / 8 * 25_557_032 * 4 * 8 / 10e9
    assert resnet["ratio"] == pytest.approx(comm / compute, rel=1e-12)
    bert = rows["bertlarge_a100_25gbe"]
    assert bert["ratio"] == pytest.approx((2 * 7 / 8 * 335_141_888 * 4 * 8 / 25e9) / (64 / 580))
    for row in rows.values():
        assert row["ratio"] >= 1  # communication at least as long as computation
        lab = 2 * 3 / 4 * study.LAB_GRADIENT_BYTES * 8 / study.parse_cap(row["cap"])
        assert row["lab_ratio"] == pytest.approx(lab / study.LAB_COMPUTE_S)
        assert row["lab_ratio"] == pytest.approx(row["ratio"], rel=0.03)  # the cap matches
        assert study.parse_cap(row["cap"]) <= 1e9  # where the lab is faithful


def test_the_lab_gradient_is_the_recipes_model():
    import modelzoo

    model = modelzoo.get_model("resnest14", num_classes=10, last_gamma=True)
    study = load_script("comm_lab_study", "grad")
    assert 4 * sum(p.numel() for p in model.parameters()) == study.LAB_GRADIENT_BYTES
