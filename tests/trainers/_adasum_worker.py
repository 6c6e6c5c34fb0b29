"""One rank of the multi-process Adasum tests in test_adasum.py.

The four processes start as a 4-rank gloo world, then ranks 0-2 re-form a 3-rank world and
ranks 0-1 a 2-rank world, so three world sizes cost one interpreter start-up. Each rank saves
its inputs and results per world size in ``OUTDIR/w{world}_r{rank}.pt``; the test computes the
references.

Usage (torchrun's variables set for the 4-rank world):
    python -m tests.trainers._adasum_worker OUTDIR PORT3 PORT2
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from modelzoo import _native as native_loader
from tests.trainers._trainer_toys import ToyDataset, eval_step, lr_fn, make_mlp, train_step
from trainers import DistEnv, RunLogger, Trainer, TrainerConfig
from trainers.comm.adasum import AdasumCombiner, adasum_allreduce_
from trainers.comm.adasum import allreduce as adasum_module
from trainers.comm.adasum import gpu as gpu_module
from trainers.comm.adasum import native as native_module

SHAPES = [(7,), (3, 5), (64, 3, 3, 3), (1,), (1000,), (33, 17), (0,), (4, 1, 1), (20000,)]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# -- data ---------------------------------------------------------------------------------------
def random_tensors(rank: int, dtype: torch.dtype, shapes=SHAPES) -> list[torch.Tensor]:
    """Per-rank tensors sharing a common direction (so Adasum is neither sum nor mean)."""
    common = torch.Generator().manual_seed(0)
    own = torch.Generator().manual_seed(1000 + rank)
    out = []
    for shape in shapes:
        shared = torch.randn(shape, generator=common)
        mix = float(torch.rand((), generator=own)) * 2 - 0.5  # negative too
        scale = 10 ** float(torch.empty(()).uniform_(-2, 2, generator=own))
        out.append((scale * (mix * shared + torch.randn(shape, generator=own))).to(dtype))
    return out


def horovod_columns(rank: int, world: int, dtype: torch.dtype, kind: str) -> list[torch.Tensor]:
    """Horovod's test data: rank r gets column r of orthogonal (QR) or parallel columns."""
    g = torch.Generator().manual_seed(2)
    out = []
    for n in (world * 20 - 17, world * 2 + 1, world + 2, 2**12):
        a = torch.randn(n, world if kind == "orthogonal" else 1, generator=g, dtype=torch.float64)
        if kind == "orthogonal":
            q = torch.linalg.qr(a).Q
        else:  # one sign, so the mean is no cancellation (the pair tests cover signs)
            r = torch.rand(world, 1, generator=g, dtype=torch.float64) + 0.5
            q = a @ r.T
        out.append(q[:, rank].to(dtype).contiguous())
    return out


def digits_sets() -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's 1,797 real 8x8 handwritten digits: 1,437 for training, 360 held out."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, val = perm[:1437], perm[1437:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


DIGITS_RECIPES = {  # optimizer, lr (the single-worker lr: no scaling with the world size)
    "gradient": ("sgd", 0.05),
    "delta": ("adam", 2e-3),
}


def digits_fit(env: DistEnv, mode: str, combiner=None) -> tuple[float, list[torch.Tensor]]:
    """A small MLP on the digits through the Trainer; returns held-out top-1 and weights."""
    name, lr = DIGITS_RECIPES[mode]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    if name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=lr)
    train, val = digits_sets()
    trainer = Trainer(
        model,
        opt,
        TrainerConfig(epochs=6, batch_size=32, seed=1, log_interval=0, progress=False),
        env=env,
        logger=RunLogger(None, enabled=False),
        train_step=train_step,
        eval_step=eval_step,
        combiner=combiner,
    )
    trainer.fit(train, eval_dataset=val)
    return trainer.last_eval["top1"], [p.detach().clone() for p in model.parameters()]


# -- stages -------------------------------------------------------------------------------------
def allreduce_random(rank: int, **kwargs) -> dict:
    results = {}
    for name, dtype in DTYPES.items():
        inputs = random_tensors(rank, dtype)
        outputs = adasum_allreduce_([t.clone() for t in inputs], **kwargs)
        results[name] = {"in": inputs, "out": list(outputs)}
    return results


def count_messages(fn) -> int:
    """How many batched point-to-point exchanges ``fn`` makes."""
    calls = {"n": 0}
    original = dist.batch_isend_irecv

    def counting(ops):
        calls["n"] += 1
        return original(ops)

    dist.batch_isend_irecv = counting
    try:
        fn()
    finally:
        dist.batch_isend_irecv = original
    return calls["n"]


# Around the packing threshold (adasum_module._PACK_BELOW = 16384): large tensors are combined
# in their own memory, small ones in a packed buffer.
LAYOUT_SHAPES = [(5,), (40000,), (200, 300), (50,), (20000,), (17001,), (16383,), (16384,), (3, 4, 4000)]  # fmt: skip
LAYOUT_DTYPES = {"fp64": torch.float64, **DTYPES}


def layout_inputs(rank: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Large and small tensors; a zero tensor on some ranks (the guard)."""
    inputs = random_tensors(rank, dtype, LAYOUT_SHAPES)
    if rank in (0, 2):
        inputs[4].zero_()  # large: adasum(0, b) = b
    if rank == 1:
        inputs[3].zero_()  # small
    return inputs


def layout(rank: int) -> dict:
    """The in-place layout against the packed (fusion-copy) one, on awkward inputs: a
    non-contiguous large tensor, one tensor passed twice, uneven sizes, zero tensors."""
    results = {}
    for name, dtype in LAYOUT_DTYPES.items():
        inputs = layout_inputs(rank, dtype)
        work = [t.clone() for t in inputs]
        work[2] = inputs[2].t().contiguous().t()  # non-contiguous, same values
        work.append(work[1])  # the same memory twice: both slots get the Adasum
        outputs = adasum_allreduce_(work)
        pack = adasum_module._PACK_BELOW
        adasum_module._PACK_BELOW = 1 << 62  # everything through the packed buffer
        try:
            packed = adasum_allreduce_([t.clone() for t in inputs])
        finally:
            adasum_module._PACK_BELOW = pack
        results[name] = {
            "in": inputs + [inputs[1]],
            "out": [t.clone() for t in outputs],
            "packed": list(packed) + [packed[1]],
            "non_contiguous_stays": not work[2].is_contiguous(),
        }
    return results


def small_pieces(rank: int) -> dict:
    """The same data sent in many small pieces (the overlap of transfers and arithmetic)."""
    piece = adasum_module._PIECE
    adasum_module._PIECE = 257
    try:
        return allreduce_random(rank)
    finally:
        adasum_module._PIECE = piece


def kernel_paths(rank: int) -> dict:
    """The layout inputs through the four kernel paths: C kernels or torch kernels, each with
    a rank's own tensors combined as their dots complete (the default) or all after the
    level's dot allreduce. The order must not change a bit; the kernels may (summation
    order, float64 rule)."""
    results = {}
    launches = {"dots": 0, "axpby": 0}
    seg_dots, seg_axpby = gpu_module.seg_dots_, gpu_module.seg_axpby_

    def counted_dots(*args):
        launches["dots"] += 1
        return seg_dots(*args)

    def counted_axpby(*args):
        launches["axpby"] += 1
        return seg_axpby(*args)

    for name in ("fp64", "fp32", "fp16"):  # bf16 takes fp16's (torch) kernels
        inputs = layout_inputs(rank, LAYOUT_DTYPES[name])
        out = {}
        # pieces: native, 1000-element messages; triton: the CUDA kernels, interpreted on CPU
        for kernels in ("native", "torch", "pieces", "triton"):
            for early in (True, False):
                saved = (
                    dict(native_loader._LOADED),
                    adasum_module._EARLY_RULE,
                    adasum_module._PIECE,
                )
                if kernels in ("torch", "triton"):
                    native_loader._LOADED["adasum"] = None
                if kernels == "triton":
                    os.environ["MODELZOO_TRITON"] = "interpret"
                    gpu_module.seg_dots_, gpu_module.seg_axpby_ = counted_dots, counted_axpby
                adasum_module._EARLY_RULE = early
                adasum_module._PIECE = 1000 if kernels == "pieces" else adasum_module._PIECE
                try:
                    out[kernels, early] = list(adasum_allreduce_([t.clone() for t in inputs]))
                finally:
                    loaded, adasum_module._EARLY_RULE, adasum_module._PIECE = saved
                    native_loader._LOADED.clear()
                    native_loader._LOADED.update(loaded)
                    os.environ.pop("MODELZOO_TRITON", None)
                    gpu_module.seg_dots_, gpu_module.seg_axpby_ = seg_dots, seg_axpby
        results[name] = {
            "in": inputs,
            "out": out,
            "native": native_module.available(inputs[0]),
            "triton_launches": dict(launches),
        }
    return results


def world4(rank: int) -> dict:
    res: dict = {"random": allreduce_random(rank), "pieces": small_pieces(rank)}
    res["layout"] = layout(rank)
    res["kernels"] = kernel_paths(rank)
    for kind in ("orthogonal", "parallel"):
        for name in ("fp32", "fp16"):
            cols = horovod_columns(rank, 4, DTYPES[name], kind)
            res[f"{kind}_{name}"] = {
                "in": cols,
                "out": adasum_allreduce_([c.clone() for c in cols]),
            }
    # Hierarchical: 2 "nodes" of 2 ranks.
    inputs = random_tensors(rank, torch.float32)
    res["hier"] = {
        "in": inputs,
        "out": adasum_allreduce_([t.clone() for t in inputs], local_size=2),
    }
    odd = random_tensors(rank, torch.float32, [*SHAPES, (3,)])  # shards end in padding
    res["hier_odd"] = {"in": odd, "out": adasum_allreduce_([t.clone() for t in odd], local_size=2)}
    try:
        adasum_allreduce_([t.clone() for t in inputs], local_size=4)
        res["one_node_error"] = None
    except ValueError as err:
        res["one_node_error"] = str(err)
    # Thousands of small tensors.
    sizes = torch.randint(1, 41, (3000,), generator=torch.Generator().manual_seed(3)).tolist()
    small = random_tensors(rank, torch.float32, shapes=[(s,) for s in sizes])
    out_default = [t.clone() for t in small]
    out_capped = [t.clone() for t in small]
    res["small"] = {
        "in": small,
        "out": out_default,
        "out_capped": out_capped,
        "messages": count_messages(lambda: adasum_allreduce_(out_default)),
        "messages_capped": count_messages(
            lambda: adasum_allreduce_(out_capped, bucket_cap_mb=0.05)
        ),
    }
    return res


def world3(rank: int) -> dict:
    res: dict = {"random": allreduce_random(rank), "pieces": small_pieces(rank)}
    res["layout"] = layout(rank)
    res["kernels"] = kernel_paths(rank)
    env = DistEnv.from_env(device="cpu")
    # Gradient mode inside the Trainer with an odd world size: ranks stay identical.
    model = make_mlp(seed=rank)  # different on purpose: prepare() broadcasts rank 0's
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=lr_fn(0), momentum=0.9),
        TrainerConfig(epochs=1, batch_size=4, seed=3, log_interval=0, progress=False),
        env=env,
        logger=RunLogger(None, enabled=False),
        lr_schedule=lr_fn,
        train_step=train_step,
        combiner=AdasumCombiner(mode="gradient"),
    )
    trainer.fit(ToyDataset(48))
    res["grad_mode_params"] = [p.detach().clone() for p in model.parameters()]
    return res


def world2(rank: int, out: Path) -> dict:
    res: dict = {"random": allreduce_random(rank)}
    env = DistEnv.from_env(device="cpu")
    res["digits"] = {
        "gradient": digits_fit(env, "gradient", AdasumCombiner(mode="gradient")),
        "delta": digits_fit(env, "delta", AdasumCombiner(mode="delta")),
    }
    # Delta mode resumes bit-for-bit: every rank gets its own Adam moments back.
    res["resume"] = {}
    for tag, resume in (("straight", False), ("resumed", True)):
        model = make_mlp(seed=0)
        trainer = Trainer(
            model,
            torch.optim.Adam(model.parameters(), lr=1e-2),
            TrainerConfig(
                epochs=2, batch_size=4, seed=4, log_interval=0, progress=False,
                save_dir=str(out / f"ckpt_{tag}"),
            ),
            env=env,
            logger=RunLogger(None, enabled=False),
            train_step=train_step,
            combiner=AdasumCombiner(mode="delta"),
        )  # fmt: skip
        if resume:
            trainer.resume(out / "ckpt_straight" / "epoch0.pt")
        trainer.fit(ToyDataset(40))
        res["resume"][tag] = [p.detach().clone() for p in model.parameters()]
    return res


def init(rank: int, world: int, port: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_PORT=port,
    )
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )


def main(out: Path, port3: str, port2: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    init(rank, 4, os.environ["MASTER_PORT"])
    torch.save(world4(rank), out / f"w4_r{rank}.pt")
    dist.barrier()  # no rank leaves while a peer still talks to it
    dist.destroy_process_group()
    if rank < 3:
        init(rank, 3, port3)
        torch.save(world3(rank), out / f"w3_r{rank}.pt")
        dist.barrier()  # no rank leaves while a peer still talks to it
        dist.destroy_process_group()
    if rank < 2:
        init(rank, 2, port2)
        torch.save(world2(rank, out), out / f"w2_r{rank}.pt")
        dist.barrier()  # no rank leaves while a peer still talks to it
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
