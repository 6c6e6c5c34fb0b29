"""get_model(pretrained=...) end to end: store, archive, hash, conversion, strict load."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import modelzoo
from modelzoo.registry import load_pretrained
from modelzoo.store import DownloadError
from modelzoo.vision.resnest import ResNeSt

from ..loopback import LocalServer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gluoncv_resnest"
PRETRAINED = [
    (name, tag) for name in modelzoo.list_models(pretrained=True)
    for tag in modelzoo.registry.get_model_entry(name).weights
]  # fmt: skip


pytestmark = pytest.mark.usefixtures("isolated_home")  # tests/conftest.py


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("name", "tag"), PRETRAINED)
def test_unreachable_server_gives_a_clear_error(name, tag, monkeypatch):
    if modelzoo.get_weights(name, tag).url.startswith("package://"):
        pytest.skip(
            "shipped in an installed package: never downloaded (tests/modelzoo/test_bert.py)"
        )
    monkeypatch.setenv("MODELZOO_REPO_URL", f"http://127.0.0.1:{_closed_port()}/mirror")
    weights = modelzoo.get_weights(name, tag)
    with pytest.raises(DownloadError) as info:
        modelzoo.get_model(name, pretrained=tag, progress=False)
    message = str(info.value)
    assert weights.url.rsplit("/", 1)[1] in message
    assert "MODELZOO_REPO_URL" in message


def test_gluoncv_zip_served_over_http_gives_gluoncv_logits(monkeypatch):
    """The full GluonCV path: zip download, sha1 of the member, numpy reader, name mapping."""
    cfg = json.loads((FIXTURES / "tiny_a_config.json").read_text())
    body = (FIXTURES / "tiny_a.zip").read_bytes()
    with zipfile.ZipFile(FIXTURES / "tiny_a.zip") as zf:
        member_bytes = zf.read("tiny_a.params")
    sha1 = hashlib.sha1(member_bytes).hexdigest()
    server = LocalServer()
    try:
        # Publisher-style names: {name}-{hash8}.zip holding {name}-{hash8}.params.
        renamed = Path(server.url("x")).parent  # unused; routes are served by name
        del renamed
        import io

        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as zf:
            zf.writestr(f"tiny-{sha1[:8]}.params", member_bytes)
        url = server.serve(f"gluon/models/tiny-{sha1[:8]}.zip", buffer.getvalue())
        weights = dataclasses.replace(
            modelzoo.get_weights("resnest14", "gluoncv"),
            url=url,
            archive_member=f"tiny-{sha1[:8]}.params",
            hash_prefix=sha1[:8],
            num_classes=cfg["classes"],
            labels=None,  # a tiny fixture model, not ImageNet's 1000 classes
        )
        model = ResNeSt(
            cfg["layers"], num_classes=cfg["classes"], radix=cfg["radix"],
            cardinality=cfg["cardinality"], bottleneck_width=cfg["bottleneck_width"],
            stem_width=cfg["stem_width"], avd_first=cfg["avd_first"],
        )  # fmt: skip
        load_pretrained(model, weights, progress=False)
        assert server.total_hits == 1
        load_pretrained(model, weights, progress=False)  # cached: no second request
        assert server.total_hits == 1
    finally:
        server.close()
    assert len(body) > 0
    x = torch.from_numpy(np.load(FIXTURES / "input.npy"))
    expected = torch.from_numpy(np.load(FIXTURES / "tiny_a_logits.npy"))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), expected, rtol=0, atol=1e-4)


def test_official_pth_through_mirror_variable(tmp_path, monkeypatch):
    """An official-format .pth on a mirror (MODELZOO_REPO_URL) loads strictly."""
    torch.manual_seed(0)
    source = modelzoo.get_model("resnest14", num_classes=10)
    path = tmp_path / "src.pth"
    torch.save(source.state_dict(), path)
    data = path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    server = LocalServer()
    try:
        server.serve(f"mirror/resnest14-{sha[:8]}.pth", data)
        monkeypatch.setenv("MODELZOO_REPO_URL", server.url("mirror"))
        weights = modelzoo.Weights(
            url=f"https://example.invalid/releases/resnest14-{sha[:8]}.pth", hash_prefix=sha[:8],
            num_params=0, num_classes=10, metrics={}, source="test", license="CC0",
        )  # fmt: skip
        model = load_pretrained(
            modelzoo.get_model("resnest14", num_classes=10), weights, progress=False
        )
    finally:
        server.close()
    for key, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
