"""The portable exact mode's square root (``MODELZOO_PORTABLE=2``, trainers._portable_ops).

The oracle is IEEE 754: a square root has one correctly rounded result, numpy's ``np.sqrt``
(the processor's ``sqrtps``/``sqrtpd``) and, independently, the float64 root rounded to
float32 (exact for float32 inputs: a float32's root is never that close to a rounding
midpoint). ATen's own CPU ``sqrt`` (MKL's vector math, within one ulp) is not that on every
processor (measured on an AMD EPYC: 20 % of float32 roots one ulp off), which is why the mode
replaces it. Each check runs in a fresh process: the replacement is process-wide.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECK = textwrap.dedent(
    """
    import math, numpy as np, torch, trainers
    from trainers import _portable_ops
    assert _portable_ops.installed()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    # every binade from 1e-30 to 1e30, and values near 1 (where ATen's roots were off)
    x32 = (10.0 ** rng.uniform(-30, 30, 300_000)).astype(np.float32)
    x32 = np.concatenate([x32, rng.random(300_000, dtype=np.float32)])
    t = torch.from_numpy(x32)
    ieee = np.sqrt(x32)
    via64 = np.sqrt(x32.astype(np.float64)).astype(np.float32)  # the second oracle
    assert np.array_equal(ieee, via64)
    def same(a, b):
        a = a.detach().numpy() if isinstance(a, torch.Tensor) else a
        return a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))
    assert same(torch.sqrt(t), ieee), "torch.sqrt"
    assert same(t.sqrt(), ieee), "Tensor.sqrt"
    y = t.clone(); y.sqrt_(); assert same(y, ieee), "sqrt_"
    out = torch.empty(0); torch.sqrt(t, out=out); assert same(out, ieee), "out="
    wide = torch.empty(9, dtype=torch.float64); torch.sqrt(t[:9], out=wide)
    assert same(wide, ieee[:9].astype(np.float64)), "out= of a wider dtype: the float32 root"
    assert same(torch._foreach_sqrt([t, t[:7]])[1], ieee[:7]), "_foreach_sqrt"
    x64 = x32[:20000].astype(np.float64) * 1.000000001
    libm = np.array([math.sqrt(v) for v in x64])  # C's sqrt, apart from numpy's
    assert same(torch.sqrt(torch.from_numpy(x64)), libm), "float64"
    # strides kept, as ATen keeps them
    m = torch.from_numpy(x32[:600].reshape(20, 30)).t()
    r = m.sqrt()
    assert r.stride() == m.stride()
    assert same(r.contiguous(), np.ascontiguousarray(via64[:600].reshape(20, 30).T))
    # float16 and bfloat16: the correctly rounded root (ATen rounds the float32 root, which
    # rounds the same as the float64 one: both have more than twice the bits plus two)
    h = t[:4096].to(torch.float16)
    assert same(h.sqrt(), np.sqrt(h.numpy().astype(np.float64)).astype(np.float16)), "float16"
    b = t[:4096].to(torch.bfloat16)
    root64 = torch.from_numpy(np.sqrt(b.double().numpy()))
    assert torch.equal(b.sqrt(), root64.to(torch.bfloat16)), "bfloat16"
    # integers promote to the default dtype
    i = torch.arange(0, 1000)
    assert i.sqrt().dtype == torch.float32
    assert same(i.sqrt(), np.sqrt(np.arange(0, 1000, dtype=np.float64)).astype(np.float32))
    # autograd is untouched (the kernel sits below it)
    w = torch.from_numpy(x32[:50].copy()).requires_grad_()
    w.sqrt().sum().backward()
    assert torch.allclose(w.grad, 0.5 / torch.from_numpy(ieee[:50]))
    # torch.optim's Adam step reaches the replacement (its denominator is exp_avg_sq.sqrt()):
    # count the roots the replacement takes
    calls = []
    numpy_sqrt = np.sqrt
    np.sqrt = lambda *a, **k: calls.append(1) or numpy_sqrt(*a, **k)
    p = torch.nn.Parameter(torch.ones(3)); p.grad = torch.full((3,), 0.5)
    torch.optim.Adam([p], lr=0.1).step()
    np.sqrt = numpy_sqrt
    assert calls, "Adam's step did not take the replacement's root"
    print("ok")
    """
)


def _run(code: str, version: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MODELZOO_PORTABLE"}
    if version is not None:
        env["MODELZOO_PORTABLE"] = version
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def test_version_2_computes_correctly_rounded_square_roots_everywhere():
    done = _run(CHECK, "2")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.parametrize(
    "version, installed, onednn",
    [(None, False, True), ("1", False, False), ("2", True, False), ("2-onednn", True, True)],
)
def test_version_2_replaces_the_kernel_and_only_the_onednn_variant_keeps_onednn(
    version, installed, onednn
):
    code = (
        "import torch, trainers; from trainers import _portable_ops; "
        "print(_portable_ops.installed(), torch.backends.mkldnn.enabled)"
    )
    done = _run(code, version)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(installed), str(onednn)]


def test_an_unknown_version_is_one_line_and_exit_2():
    done = _run("import trainers", "3")
    assert done.returncode == 2
    assert "MODELZOO_PORTABLE='3'" in done.stderr and "Traceback" not in done.stderr
