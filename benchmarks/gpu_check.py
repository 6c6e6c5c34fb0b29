"""The prepared GPU check: CUDA-only tests and the GPU figures, in one run of under 8 minutes.

Run it on a machine with one CUDA GPU (``python benchmarks/gpu_check.py``). In order, each
part with its own time budget so that the whole stays under ``--budget`` seconds (480):

1. **CUDA-only tests**: ``pytest -m gpu`` (LAMB and LANS against their references on CUDA,
   GNN layer-wise inference on the GPU, SGP across two devices where there are two, the
   backward overlap's CUDA events).
2. **Optimizers**: one step of our LAMB and LANS on ResNeSt-50's 263 parameter tensors
   (27.5 M, fp32) against ``torch.optim.AdamW(fused=True)``, min/median/max over rounds, with
   the Triton passes (the CUDA default) and on the torch path (``MODELZOO_TRITON=0``), and the
   two paths' weights after the same steps compared.
3. **ResNeSt-50 training**: images/s of a training step (forward, loss, backward, SGD) at
   224x224, bf16 autocast, channels-last, batch ``--image-batch``.
4. **BERT-Base SQuAD training**: sequences/s of a span-QA training step (AdamW) at 384
   tokens, ours against ``transformers`` (``sdpa``) on the same weights and batch, bf16
   autocast, paired rounds.
5. **Adasum on CUDA**: the pairwise rule on ResNet-50's gradient shapes on the GPU, per
   tensor (``trainers.comm.adasum.adasum_pair``) and on a fused buffer as the allreduce
   applies it (the Triton kernels, and the torch path), against the float64 CPU rule (largest
   relative difference) and timed against ``a + b`` (per tensor, and of the whole buffers).
6. **Compiled** (the training scripts' ``--compile``, ``auto`` on CUDA): parts 3 and 4 again
   through ``torch.compile`` (of ResNeSt-50; of our BERT, against eager ``transformers``),
   with the first step's seconds (the compilation). Targets of issue 41: ResNeSt-50 at least
   2,300 images/s and BERT-Base at least 1.3x ``transformers`` on an H200.

It prints each figure, writes them to ``benchmarks/results/gpu/gpu_check.json`` (not beside
the peer benchmarks' results, which ``make_doc.py`` renders as a table) and to the
section between ``<!-- gpu: python benchmarks/gpu_check.py -->`` and ``<!-- /gpu -->`` of
docs/benchmarks.md, next to NVIDIA's published per-GPU figures. ``--device cpu --quick``
runs every part at toy sizes on the CPU (what the test suite does to keep this script
working); its figures mean nothing and it writes only where ``--doc``/``--json`` say.

    python benchmarks/gpu_check.py [--budget 480] [--rounds 5] [--json FILE] [--doc FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _report import check_rounds, machine, machine_line, spread, write_json

ROOT = Path(__file__).resolve().parents[1]
BEGIN = "<!-- gpu: python benchmarks/gpu_check.py -->"
END = "<!-- /gpu -->"

# NVIDIA DeepLearningExamples, A100-80GB, AMP, per GPU (shared/specs/performance.md); other
# models and sizes than ours, set beside them for scale only.
NVIDIA = {
    "resnet50_train_images_per_s": "ResNet-50 v1.5 training, A100-80GB AMP: about 2470 images/s",
    "bert_large_squad_seq_per_s": "BERT-Large SQuAD fine-tuning, A100-80GB AMP: about 110 "
    "sequences/s",
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_rounds(fn: Callable[[], None], rounds: int, device: torch.device) -> list[float]:
    """Seconds of ``fn`` in each of ``rounds`` rounds, after one warm-up call."""
    fn()
    out = []
    for _ in range(rounds):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - start)
    return out


# ---- 1. the CUDA-only tests ------------------------------------------------------------------
def run_gpu_tests(timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rs",
           "tests/trainers/test_lamb.py", "tests/trainers/test_lans.py",
           "tests/trainers/test_optim_triton.py", "tests/trainers/test_decentralized.py", "tests/modelzoo/test_graph_inference.py",
           "tests/trainers/test_overlap.py"]  # fmt: skip
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"summary": f"timed out after {timeout:.0f} s", "returncode": None}
    lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(lines) if " passed" in ln or " failed" in ln
                    or " skipped" in ln or "no tests ran" in ln), lines[-1] if lines else "")  # fmt: skip
    return {"summary": summary.strip("= "), "returncode": done.returncode,
            "skipped": [ln for ln in lines if ln.startswith("SKIPPED")]}  # fmt: skip


# ---- 2. optimizers ---------------------------------------------------------------------------
def _switched(value: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run with ``MODELZOO_TRITON=value`` (read at every step)."""

    def run() -> Any:
        before = os.environ.get("MODELZOO_TRITON")
        os.environ["MODELZOO_TRITON"] = value
        try:
            return fn()
        finally:
            if before is None:
                os.environ.pop("MODELZOO_TRITON", None)
            else:
                os.environ["MODELZOO_TRITON"] = before

    return run


def optimizer_steps(device: torch.device, rounds: int, quick: bool) -> dict[str, Any]:
    """AdamW against LAMB and LANS as they run (the Triton passes on CUDA) and on the torch
    path (``MODELZOO_TRITON=0``); the two paths' weights after the same steps compared."""
    from bench_optim import make_params, resnest50_shapes

    from trainers.optim import Lamb, Lans
    from trainers.optim import _triton as optim_triton

    shapes = resnest50_shapes()[:20] if quick else resnest50_shapes()
    dev = str(device)
    hp = dict(lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-6)
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opts = {
        "adamw": torch.optim.AdamW(make_params(shapes, dev, 0), **fused, **hp),
        "lamb": Lamb(make_params(shapes, dev, 0), **hp),
        "lans": Lans(make_params(shapes, dev, 0), **hp),
        "lamb_torch": Lamb(make_params(shapes, dev, 0), **hp),
        "lans_torch": Lans(make_params(shapes, dev, 0), **hp),
    }
    steps = {n: _switched("0", o.step) if n.endswith("_torch") else o.step
             for n, o in opts.items()}  # fmt: skip
    times = {name: timed_rounds(step, rounds, device) for name, step in steps.items()}
    med = {n: statistics.median(t) for n, t in times.items()}
    diff = {}
    for name in ("lamb", "lans"):  # the same steps on the same problem, both paths
        a, b = (opts[k].param_groups[0]["params"] for k in (name, f"{name}_torch"))
        diff[name] = max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))
                         for x, y in zip(a, b, strict=True))  # fmt: skip
    first = opts["lamb"].param_groups[0]["params"]
    kernels = "triton" if optim_triton.available(first, first) else "torch"
    return {
        "peer": "torch.optim.AdamW(fused=True)" if device.type == "cuda" else "AdamW(foreach)",
        "tensors": len(shapes),
        "kernels": kernels,
        "ms": {n: [t * 1e3 for t in ts] for n, ts in times.items()},
        "x_adamw": {n: med[n] / med["adamw"] for n in opts if n != "adamw"},
        "max_rel_diff_vs_torch_path": diff,
    }


# ---- 3. ResNeSt-50 training images/s -----------------------------------------------------------
def resnest_images_per_s(device: torch.device, rounds: int, batch: int, quick: bool,
                         compiled: bool = False) -> dict:  # fmt: skip
    """``compiled``: through ``torch.compile`` of the model, as the trainer's ``--compile``
    trains (the first, warm-up call compiles: its seconds are ``compile_s``)."""
    import modelzoo

    size = 32 if quick else 224
    name = "resnest14" if quick else "resnest50"
    model = modelzoo.get_model(name, num_classes=1000).to(device)
    model = model.to(memory_format=torch.channels_last).train()
    forward = torch.compile(model) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, size, size, generator=g).to(device)
    x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), generator=g).to(device)
    dtype = torch.bfloat16

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype):
            loss = F.cross_entropy(forward(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    steps = 1 if quick else 10
    sync(device)
    begin = time.perf_counter()
    step()  # compiles when compiled
    sync(device)
    first = time.perf_counter() - begin

    def many() -> None:
        for _ in range(steps):
            step()

    seconds = timed_rounds(many, rounds, device)
    per_s = [batch * steps / s for s in seconds]
    out = {"model": name, "image_size": size, "batch": batch, "precision": "bf16 autocast",
           "channels_last": True, "images_per_s": per_s}  # fmt: skip
    if compiled:
        out["compile_s"] = first
    return out


# ---- 4. BERT-Base SQuAD training sequences/s, ours vs transformers ---------------------------
def bert_sequences_per_s(device: torch.device, rounds: int, batch: int, quick: bool,
                         compiled: bool = False) -> dict:  # fmt: skip
    """``compiled``: ours through ``torch.compile`` (the trainer's ``--compile``), against
    eager ``transformers`` (the peer as its users run it); ``compile_s``: our warm-up step."""
    import bench_bert

    seq = 128 if quick else 384
    config = None  # BERT-Base
    if quick:  # a toy BERT: the code path, not the figure
        from modelzoo.nlp.bert import BertConfig

        config = BertConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
    ours, hf = bench_bert.make_models(device, config)
    data = bench_bert.make_batch(batch, seq, device)
    opts = {"ours": torch.optim.AdamW(ours.parameters(), lr=1e-5),
            "hf": torch.optim.AdamW(hf.parameters(), lr=1e-5)}  # fmt: skip
    sides = {"ours": (bench_bert.ours_step, torch.compile(ours) if compiled else ours),
             "hf": (bench_bert.hf_step, hf)}  # fmt: skip

    def run(name: str) -> None:
        step, model = sides[name]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            step(model, opts[name], data)

    warmup = {}
    for name in sides:  # warm-up (ours compiles when compiled)
        warmup[name] = timed_rounds(lambda n=name: run(n), 1, device)[0]
    seconds: dict[str, list[float]] = {"ours": [], "hf": []}
    for r in range(rounds):
        for name in ("ours", "hf") if r % 2 == 0 else ("hf", "ours"):
            seconds[name] += timed_rounds(lambda n=name: run(n), 1, device)
    out = {"batch": batch, "seq_len": seq, "precision": "bf16 autocast, AdamW",
           "sequences_per_s": {n: [batch / s for s in ts] for n, ts in seconds.items()},
           "ratio": statistics.median(seconds["hf"]) / statistics.median(seconds["ours"])}  # fmt: skip
    if compiled:
        out["compile_s"] = warmup["ours"]
    return out


# ---- 5. Adasum on the GPU ----------------------------------------------------------------------
def adasum_cuda(device: torch.device, rounds: int, quick: bool) -> dict[str, Any]:
    """The pairwise rule per tensor (``adasum_pair``) and as the allreduce applies it to a
    fused buffer (one level's local step: the dots, the coefficients, ``p a + q b``), with the
    Triton kernels (the CUDA default) and on the torch path, against ``a + b``."""
    from bench_adasum import resnet50_shapes

    from trainers.comm.adasum import EPS, adasum_pair
    from trainers.comm.adasum import allreduce as adasum_allreduce

    shapes = resnet50_shapes()[:12] if quick else resnet50_shapes()
    g = torch.Generator().manual_seed(0)
    a = [torch.randn(s, generator=g) * 1e-2 for s in shapes]
    b = [torch.randn(s, generator=g) * 1e-2 + 0.5 * x for s, x in zip(shapes, a, strict=True)]
    refs = [adasum_pair(x.double(), y.double()) for x, y in zip(a, b, strict=True)]
    worst = 0.0
    for x, y, ref in zip(a, b, refs, strict=True):
        got = adasum_pair(x.to(device), y.to(device)).double().cpu()
        worst = max(worst, float((got - ref).norm() / ref.norm().clamp_min(1e-300)))
    da, db = [x.to(device) for x in a], [y.to(device) for y in b]
    bounds = [0]
    for x in a:
        bounds.append(bounds[-1] + x.numel())
    flat_a = torch.cat([x.reshape(-1) for x in da])
    flat_b = torch.cat([y.reshape(-1) for y in db])

    def fused_rule(x: torch.Tensor) -> None:
        segments = adasum_allreduce._Segments.flat(x)
        adasum_allreduce._combine_(segments, flat_b, 0, bounds, True, adasum_allreduce._SELF, EPS)

    from trainers.comm.adasum import gpu as adasum_gpu
    from trainers.comm.adasum import native as adasum_native

    kernels = ("C" if adasum_native.available(flat_a)
               else "triton" if adasum_gpu.available(flat_a) else "torch")  # fmt: skip
    fused_worst = {}
    for path, switch in ((kernels, os.environ.get("MODELZOO_TRITON", "1")), ("torch", "0")):
        x = flat_a.clone()
        _switched(switch, lambda x=x: fused_rule(x))()
        fused_worst[path] = max(
            float((x[lo:hi].double().cpu() - ref.reshape(-1)).norm()
                  / ref.norm().clamp_min(1e-300))
            for lo, hi, ref in zip(bounds, bounds[1:], refs, strict=False)
        )  # fmt: skip
    work = flat_a.clone()

    def rule() -> None:
        for x, y in zip(da, db, strict=True):
            adasum_pair(x, y)

    def add() -> None:
        for x, y in zip(da, db, strict=True):
            x + y  # noqa: B018 (the work being timed)

    return {"tensors": len(shapes), "max_rel_diff_vs_cpu_float64": worst, "kernels": kernels,
            "fused_max_rel_diff_vs_cpu_float64": fused_worst,
            "rule_ms": [t * 1e3 for t in timed_rounds(rule, rounds, device)],
            "fused_ms": [t * 1e3 for t in timed_rounds(lambda: fused_rule(work), rounds, device)],
            "fused_torch_ms": [t * 1e3 for t in timed_rounds(
                _switched("0", lambda: fused_rule(work)), rounds, device)],
            "add_ms": [t * 1e3 for t in timed_rounds(add, rounds, device)],
            "add_flat_ms": [t * 1e3 for t in timed_rounds(
                lambda: flat_a + flat_b, rounds, device)]}  # fmt: skip


# ---- the report --------------------------------------------------------------------------------
def render(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [BEGIN, f"Measured {res['date']} by `python benchmarks/gpu_check.py` on "
             f"{m.get('cuda') or 'no GPU'} ({m['cpu']}, torch {m['torch']}), "
             f"{res['seconds']:.0f} s in all.", ""]  # fmt: skip
    t = res.get("tests")
    if t:
        lines.append(f"- CUDA-only tests (`pytest -m gpu`): {t['summary']}.")
    o = res.get("optimizers")
    if o:
        lines.append(
            f"- Optimizer step, ResNeSt-50's {o['tensors']} tensors, ms min / median / max: "
            + "; ".join(f"{n} {_mmm(ts)}" for n, ts in o["ms"].items())
            + f" ({o['peer']} is `adamw`; `_torch`: the torch path, `MODELZOO_TRITON=0`): "
            f"LAMB {o['x_adamw']['lamb']:.2f}x and LANS {o['x_adamw']['lans']:.2f}x AdamW's "
            f"time with the {o['kernels']} kernels ({o['x_adamw']['lamb_torch']:.2f}x and "
            f"{o['x_adamw']['lans_torch']:.2f}x on the torch path); weights after the same "
            f"steps within {max(o['max_rel_diff_vs_torch_path'].values()):.1e} (relative) of "
            "the torch path's."
        )
    r = res.get("resnest")
    if r:
        lines.append(
            f"- {r['model']} training, {r['image_size']}x{r['image_size']}, batch {r['batch']}, "
            f"{r['precision']}, channels-last: {_mmm(r['images_per_s'])} images/s "
            f"(NVIDIA: {NVIDIA['resnet50_train_images_per_s']}; ResNeSt-50 has about 1.3x "
            "ResNet-50's FLOPs)."
        )
    bb = res.get("bert")
    if bb:
        s = bb["sequences_per_s"]
        lines.append(
            f"- BERT-Base span-QA training, batch {bb['batch']} x {bb['seq_len']}, "
            f"{bb['precision']}: ours {_mmm(s['ours'])}, transformers (sdpa) {_mmm(s['hf'])} "
            f"sequences/s, ratio {bb['ratio']:.3f} (NVIDIA: "
            f"{NVIDIA['bert_large_squad_seq_per_s']}; BERT-Large is about 3x BERT-Base's work)."
        )
    rc = res.get("resnest_compiled")
    if rc:
        eager = f" ({statistics.median(rc['images_per_s']) / statistics.median(r['images_per_s']):.2f}x eager)" if r else ""  # fmt: skip
        lines.append(
            f"- {rc['model']} training as above, compiled (`--compile`: `torch.compile`, "
            f"first step {rc['compile_s']:.0f} s): {_mmm(rc['images_per_s'])} images/s{eager}."
        )
    bc = res.get("bert_compiled")
    if bc:
        s = bc["sequences_per_s"]
        lines.append(
            f"- BERT-Base span QA, ours compiled (first step {bc['compile_s']:.0f} s) against "
            f"eager transformers: {_mmm(s['ours'])} against {_mmm(s['hf'])} sequences/s, "
            f"ratio {bc['ratio']:.3f}."
        )
    a = res.get("adasum")
    if a:
        lines.append(
            f"- Adasum's rule on the GPU, {a['tensors']} ResNet-50 tensors: per tensor "
            f"(`adasum_pair`) {_mmm(a['rule_ms'])} ms against {_mmm(a['add_ms'])} ms for "
            f"`a + b` per tensor; on the fused buffer as the allreduce applies it "
            f"{_mmm(a['fused_ms'])} ms with the {a['kernels']} kernels "
            f"({_mmm(a['fused_torch_ms'])} ms on the torch path, `MODELZOO_TRITON=0`) against "
            f"{_mmm(a['add_flat_ms'])} ms for one `a + b` of the buffers. Largest relative "
            f"difference from the float64 CPU rule: {a['max_rel_diff_vs_cpu_float64']:.1e} per "
            f"tensor, {a['fused_max_rel_diff_vs_cpu_float64'][a['kernels']]:.1e} fused "
            f"({a['kernels']}), {a['fused_max_rel_diff_vs_cpu_float64']['torch']:.1e} fused "
            "(torch)."
        )
    for part, why in res.get("skipped", {}).items():
        lines.append(f"- {part}: not run ({why}).")
    lines.append(END)
    return "\n".join(lines)


def _mmm(values: list[float]) -> str:
    return f"{min(values):.4g} / {statistics.median(values):.4g} / {max(values):.4g}"


def write_doc(doc: Path, section: str) -> None:
    text = doc.read_text(encoding="utf-8") if doc.is_file() else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n## GPU figures\n\n" + section + "\n"
    tmp = doc.with_name(f".{doc.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(doc)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for the whole check")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--image-batch", type=int, default=128)
    p.add_argument("--bert-batch", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="toy sizes (a smoke test of this script)")
    p.add_argument("--skip-tests", action="store_true", help="leave out the pytest part")
    p.add_argument(
        "--json", default=str(ROOT / "benchmarks" / "results" / "gpu" / "gpu_check.json")
    )
    p.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"))
    args = p.parse_args(argv)
    check_rounds(args.rounds)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check.py: no CUDA device here; it runs on a GPU machine "
                         "(--device cpu --quick only smoke-tests the script)")  # fmt: skip
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    print(machine_line(), flush=True)
    start = time.perf_counter()
    res: dict[str, Any] = {"machine": machine(), "date": time.strftime("%Y-%m-%d"),
                           "device": str(device), "skipped": {}}  # fmt: skip
    image_batch = 4 if args.quick else args.image_batch
    bert_batch = 2 if args.quick else args.bert_batch

    def training(compiled: bool) -> list[tuple[str, float, Callable[[], Any]]]:
        suffix, share = ("_compiled", 0.15) if compiled else ("", 0.20)
        return [
            (f"resnest{suffix}", share, lambda: resnest_images_per_s(
                device, args.rounds, image_batch, args.quick, compiled=compiled)),
            (f"bert{suffix}", share, lambda: bert_sequences_per_s(
                device, args.rounds, bert_batch, args.quick, compiled=compiled)),
        ]  # fmt: skip

    # the compiled parts last: they take the longest, and a spent budget skips them first
    parts: list[tuple[str, float, Callable[[], Any]]] = [
        ("optimizers", 0.10, lambda: optimizer_steps(device, args.rounds, args.quick)),
        *training(compiled=False),
        ("adasum", 0.05, lambda: adasum_cuda(device, args.rounds, args.quick)),
        *training(compiled=True),
    ]
    if not args.skip_tests:
        left = args.budget * 0.35
        res["tests"] = run_gpu_tests(left)
        print(f"tests: {res['tests']['summary']}", flush=True)
    for name, share, run in parts:
        elapsed = time.perf_counter() - start
        if elapsed > args.budget * 0.9:
            res["skipped"][name] = f"the {args.budget:.0f} s budget was spent"
            continue
        try:
            res[name] = run()
        except Exception as err:  # noqa: BLE001 (one failing part must not lose the others)
            res["skipped"][name] = f"{type(err).__name__}: {err}"
        print(f"{name}: {json.dumps(res.get(name), default=str)[:400]}"
              f" ({time.perf_counter() - start:.0f} s; share {share:.0%})", flush=True)  # fmt: skip
        if device.type == "cuda":
            torch.cuda.empty_cache()
    res["seconds"] = time.perf_counter() - start
    if "resnest" in res:
        print(f"resnest images/s: {spread(res['resnest']['images_per_s'], 'images/s')}")
    write_json(args.json, res)
    section = render(res)
    write_doc(Path(args.doc), section)
    print(section)
    return (
        1 if res["skipped"] or (res.get("tests") or {}).get("returncode") not in (0, None, 5) else 0
    )


if __name__ == "__main__":
    sys.exit(main())
