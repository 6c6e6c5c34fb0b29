"""One rank's share of a tensor-parallel layer, timed as it really runs.

The cut copy that profiling used to time (a plain module with ``1 / t`` of the heads and
units) leaves out what DTensor costs on every call: the dispatch of each operation on
sharded parameters and the layouts the layer redistributes. Measured here (small BERT layer,
hidden 256, sequence 64, CPU, one thread) the real sharded layer took 0.75-1.37 of the whole
layer's time where the cut copy took 0.30-0.55: most of the planner's under-prediction of
tensor-parallel plans.

:func:`time_sharded` runs in a child process (``python -m trainers.parallel.plan._tp_probe
DIR``) so that the caller's own process group is left alone: for each degree ``t`` the child
joins a *fake* process group of ``t`` ranks (``torch.testing``'s ``FakeProcessGroup``: every
collective returns at once), shards the layer with ``parallelize_module`` exactly as
:func:`trainers.parallel.tensor.parallelize_bert` does, and times forward and backward at the
profile's batch and at the fit batch. What it measures is therefore the local compute and
DTensor's overhead; the all-reduces are the planner's network model.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

SPEC = "spec.pt"
RESULT = "times.json"
READY = "ready"  # the child's line once it can time: the parent then answers "go"


def time_sharded(
    block: nn.Module,
    path: str,
    plan: Mapping[str, str],
    attention: str | None,
    inputs: Sequence[torch.Tensor],
    fit_inputs: Sequence[torch.Tensor] | None,
    degrees: Sequence[int],
    *,
    repeats: int,
    warmup: int,
    timeout: float = 600.0,
    sync: Callable[[], None] | None = None,
) -> dict[str, dict[str, Any]] | None:
    """Per degree (a string key): ``{"batch": {forward_s, backward_s}, "fit": {...} | None,
    "local_params": n}`` of ``block`` with its layer at ``path`` sharded; ``None`` when the
    child could not run (no fake process group in this torch: the caller falls back).

    ``sync`` (e.g. a barrier of the ranks profiling at once) is called twice on every call,
    whatever happens to the child: once the child has imported torch and loaded the block,
    before it times anything, and once it has finished. So no rank times while another
    rank's child starts (measured on 2 lab nodes, one rank per core: a whole layer then timed
    11.4 ms in one profile and 18.9 ms in the next)."""
    with tempfile.TemporaryDirectory(prefix="tp_probe_") as tmp:
        folder = Path(tmp)
        torch.save(
            {
                "block": block, "path": path, "plan": dict(plan), "attention": attention,
                "inputs": [t.detach() for t in inputs],
                "fit_inputs": None if fit_inputs is None else [t.detach() for t in fit_inputs],
                "degrees": list(degrees), "repeats": repeats, "warmup": warmup,
                "threads": torch.get_num_threads(),
            },
            folder / SPEC,
        )  # fmt: skip
        child = subprocess.Popen(
            [sys.executable, "-m", "trainers.parallel.plan._tp_probe", str(folder)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        try:
            # imported, spec loaded (a child that cannot start says nothing and exits)
            started, _, _ = select.select([child.stdout], [], [], timeout)
            ready = bool(started) and child.stdout.readline().strip() == READY
            if sync is not None:  # every rank's child started before any of them times
                sync()
            if ready:
                child.stdin.write("go\n")
                child.stdin.flush()
            child.stdin.close()
            child.wait(timeout=timeout)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        if sync is not None:  # no rank goes on while another's child still times
            sync()
        if child.returncode != 0 or not (folder / RESULT).is_file():
            return None
        return json.loads((folder / RESULT).read_text())


def _probe(folder: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainers.parallel.plan.profiling import _time_block
    from trainers.parallel.tensor import _linear_styles

    spec = torch.load(folder / SPEC, weights_only=False)
    torch.set_num_threads(int(spec["threads"]))
    print(READY, flush=True)
    if sys.stdin.readline().strip() != "go":  # the parent gave up
        return
    results: dict[str, dict[str, Any]] = {}
    for degree in spec["degrees"]:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=degree)
        block = torch.load(folder / SPEC, weights_only=False)["block"]  # a fresh copy
        layer = block.get_submodule(spec["path"])
        parallelize_module(layer, init_device_mesh("cpu", (degree,)), _linear_styles(spec["plan"]))
        if spec["attention"] is not None:
            layer.get_submodule(spec["attention"]).num_heads //= degree
        block.train()
        times = {"batch": _time_block(block, spec["inputs"], spec["repeats"], spec["warmup"],
                                      optimizer=False)}  # fmt: skip
        times["fit"] = (
            _time_block(block, spec["fit_inputs"], spec["repeats"], spec["warmup"], optimizer=False)
            if spec["fit_inputs"] is not None
            else None
        )
        local = 0
        for p in layer.parameters():
            local += (p.to_local() if hasattr(p, "to_local") else p).numel()
        times["local_params"] = local
        results[str(degree)] = times
        dist.destroy_process_group()
    (folder / RESULT).write_text(json.dumps(results))


if __name__ == "__main__":
    _probe(Path(sys.argv[1]))
