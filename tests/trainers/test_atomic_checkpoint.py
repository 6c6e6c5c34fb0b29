"""Atomic checkpoint writes and clear load errors."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import trainers.checkpoint as ckpt
from trainers import CheckpointError, load_checkpoint, save_checkpoint


def test_roundtrip_under_weights_only(tmp_path):
    _, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "model": {"w": torch.arange(4.0)},
        "rng": torch.get_rng_state(),
        "numpy": {"keys": keys.tolist(), "pos": int(pos), "gauss": (has_gauss, float(cached))},
        "python": list(random.getstate()[1]),
        "step": 3,
        "lr": 0.1,
        "name": "x",
        "none": None,
    }
    path = save_checkpoint(tmp_path / "sub" / "a.pt", state)
    back = load_checkpoint(path)
    assert torch.equal(back["model"]["w"], state["model"]["w"])
    assert torch.equal(back["rng"], state["rng"])
    assert back["numpy"] == {"keys": keys.tolist(), "pos": int(pos), "gauss": (has_gauss, cached)}
    assert back["python"] == state["python"] and back["step"] == 3 and back["none"] is None


def test_failure_mid_save_keeps_previous_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "latest.pt"
    save_checkpoint(path, {"step": 1})
    real_save = torch.save

    def crash(obj, f, *args, **kwargs):
        real_save({"step": 2, "pad": torch.zeros(1000)}, f)
        f.truncate(100)  # a partial write, then the crash
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(ckpt.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, {"step": 2})
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    assert load_checkpoint(path) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.pt"]


def test_missing_file_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="nope.pt"):
        load_checkpoint(tmp_path / "nope.pt")


def test_truncated_file_is_named(tmp_path):
    path = save_checkpoint(tmp_path / "c.pt", {"w": torch.zeros(100)})
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(CheckpointError, match="c.pt.*corrupt"):
        load_checkpoint(path)


class _Custom:
    pass


def test_arbitrary_objects_are_refused(tmp_path):
    path = save_checkpoint(tmp_path / "evil.pt", {"obj": _Custom()})
    with pytest.raises(CheckpointError, match="evil.pt.*weights_only"):
        load_checkpoint(path)
    assert isinstance(load_checkpoint(path, weights_only=False)["obj"], _Custom)
