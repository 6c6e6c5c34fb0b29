"""GraphSAGE mini-batch training: our pipeline vs PyG's two loops, same graph.

All three train GraphSAGE-mean (2 layers, hidden 256, dropout 0.5, Adam lr 3e-3) with fan-outs
25,10 and 1024 seeds a batch on the same synthetic SBM graph (100k nodes, 10k training
nodes, about 1M edges), in one process; each round runs one epoch of each, in an order that
rotates with the round, so that machine noise hits all alike.

* ours: ``scripts/train_gnn.py``'s pipeline — :class:`modelzoo.graph.GraphSAGE` on
  :class:`trainers.Trainer` (per-sample seeding, metric sums, step records), batches from
  :class:`modelzoo.graph.sampler.NeighborSampler`; each layer computes only the nodes the
  next one reads (``layer_sizes``, DGL's message-flow graphs).
* PyG, trimmed (the fair peer): PyG's own hierarchical path
  (``examples/hierarchical_sampling.py``): its ``GraphSAGE`` model (``BasicGNN``) given the
  batch's ``num_sampled_nodes`` / ``num_sampled_edges``, so that ``trim_to_layer`` drops the
  outer hops layer by layer; the bare ``zero_grad/forward/backward/step`` loop.
* PyG, plain (``--plain``): the loop of PyG's ``examples/reddit.py``: its ``SAGE`` model of
  ``SAGEConv`` layers run on the whole sampled subgraph.

Both PyG loops read ``NeighborLoader(num_neighbors=[25, 10], batch_size=1024, shuffle=True)``,
which needs the compiled ``pyg-lib`` or ``torch-sparse``. Where neither is installed (no
wheels for torch 2.13 on CPU), they are fed by our sampler instead (with the per-hop counts
``NeighborLoader`` would attach: :meth:`SampledSubgraph.hop_counts`), and the output says so:
the ratios then measure the rest of the pipeline (model, trainer, loss, optimizer), not the
samplers.

    python benchmarks/bench_gnn.py [--nodes 100000] [--rounds 5] [--plain]

Prints min/median/max seconds per epoch for each side, the CPU capability, and
``ratio=<pyg_trimmed / ours>`` (medians) last, after ``ratio_plain=`` with ``--plain``;
target: ``ratio >= 1`` against the trimmed PyG path.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from _report import add_args, check_rounds, finish, spread

from modelzoo.graph import GraphSAGE
from modelzoo.graph.datasets import sbm_graph
from modelzoo.graph.sampler import NeighborSampler
from trainers import DistEnv, RunLogger, Trainer, TrainerConfig

FANOUTS = [25, 10]
BATCH = 1024
HIDDEN = 256


class PyGSAGE(torch.nn.Module):
    """PyG's example model (examples/reddit.py), verbatim apart from the names."""

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int) -> None:
        super().__init__()
        from torch_geometric.nn import SAGEConv

        self.convs = torch.nn.ModuleList()
        self.convs.append(SAGEConv(in_channels, hidden_channels))
        self.convs.append(SAGEConv(hidden_channels, out_channels))

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = x.relu_()
                x = F.dropout(x, p=0.5, training=self.training)
        return x


def pyg_trimmed_model(in_channels: int, hidden_channels: int, out_channels: int) -> torch.nn.Module:
    """PyG's ``GraphSAGE`` (BasicGNN: SAGEConv, ReLU, dropout 0.5 between the layers), which
    trims the outer hops when given the per-hop counts (examples/hierarchical_sampling.py)."""
    from torch_geometric.nn.models import GraphSAGE as PyGGraphSAGE

    return PyGGraphSAGE(in_channels, hidden_channels, num_layers=2, out_channels=out_channels,
                        dropout=0.5)  # fmt: skip


class _OurSamplerBatches:
    """Stands in for NeighborLoader where it cannot run: same batches, PyG ``Data`` items
    with the per-hop counts NeighborLoader attaches (``num_sampled_nodes/edges``)."""

    def __init__(self, data: Any, seeds: torch.Tensor) -> None:
        self.data, self.seeds = data, seeds
        self.sampler = NeighborSampler(data.edge_index, data.num_nodes, FANOUTS)

    def __iter__(self):
        from torch_geometric.data import Data

        perm = self.seeds[torch.randperm(self.seeds.numel())]
        for start in range(0, perm.numel(), BATCH):
            sub = self.sampler.sample(perm[start : start + BATCH])
            nodes, edges = sub.hop_counts()
            yield Data(x=self.data.x[sub.n_id], y=self.data.y[sub.n_id],
                       edge_index=sub.edge_index, batch_size=sub.batch_size,
                       num_sampled_nodes=nodes, num_sampled_edges=edges)  # fmt: skip


def pyg_loader(data: Any, seeds: torch.Tensor) -> tuple[Any, str]:
    from torch_geometric.loader import NeighborLoader

    try:
        loader = NeighborLoader(data, num_neighbors=FANOUTS, batch_size=BATCH,
                                input_nodes=seeds, shuffle=True)  # fmt: skip
        next(iter(loader))
        return loader, "PyG NeighborLoader"
    except ImportError as e:
        return _OurSamplerBatches(data, seeds), (
            f"NeighborLoader unavailable ({e}); the PyG loop is fed by our sampler"
        )


def pyg_epoch(
    model: torch.nn.Module, opt: torch.optim.Optimizer, loader: Any, trim: bool = False
) -> float:
    model.train()
    start = time.perf_counter()
    for batch in loader:
        opt.zero_grad()
        if trim:
            out = model(batch.x, batch.edge_index,
                        num_sampled_nodes_per_hop=batch.num_sampled_nodes,
                        num_sampled_edges_per_hop=batch.num_sampled_edges)[: batch.batch_size]  # fmt: skip
        else:
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
        loss = F.cross_entropy(out, batch.y[: batch.batch_size])
        loss.backward()
        opt.step()
    return time.perf_counter() - start


class OurRun:
    """One Trainer that trains one more epoch per call (as train_gnn.py does)."""

    def __init__(self, data: Any, seeds: torch.Tensor) -> None:
        self.data = data
        self.sampler = NeighborSampler(data.edge_index, data.num_nodes, FANOUTS)
        torch.manual_seed(0)
        self.model = GraphSAGE(data.num_node_features, 8, hidden_channels=HIDDEN, dropout=0.5)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=3e-3)
        self.seeds = seeds
        self.epochs = 0

    def collate(self, items: list[int]) -> dict[str, Any]:
        sub = self.sampler.sample(torch.tensor(items))
        return {"n_id": sub.n_id, "edge_index": sub.edge_index, "batch_size": sub.batch_size,
                "layer_sizes": sub.layer_sizes}  # fmt: skip

    def train_step(self, model: torch.nn.Module, batch: dict[str, Any]):
        n_id, size = batch["n_id"], batch["batch_size"]
        logits = model(self.data.x[n_id], batch["edge_index"], batch["layer_sizes"])[:size]
        labels = self.data.y[n_id[:size]]
        loss = F.cross_entropy(logits, labels)
        return loss, {"accuracy": (logits.argmax(1) == labels).sum(), "count": size}

    def epoch(self) -> float:
        self.epochs += 1
        config = TrainerConfig(epochs=self.epochs, batch_size=BATCH, log_interval=2,
                               eval_interval=0, drop_last=False, progress=False)  # fmt: skip
        trainer = Trainer(self.model, self.opt, config, env=DistEnv(),
                          logger=RunLogger(None, enabled=False), train_step=self.train_step)  # fmt: skip
        trainer.epoch = self.epochs - 1
        start = time.perf_counter()
        trainer.fit(self.seeds.tolist(), collate_fn=self.collate)
        return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=100_000)
    p.add_argument("--plain", action="store_true", help="also PyG's untrimmed example loop")
    add_args(p, rounds=5)
    args = p.parse_args()
    check_rounds(args.rounds)

    data = sbm_graph(args.nodes, seed=0)
    seeds = data.train_mask.nonzero().view(-1)
    print(f"graph: {data.num_nodes} nodes, {data.edge_index.size(1)} edges, "
          f"{seeds.numel()} training nodes, fan-outs {FANOUTS}, batch {BATCH}; "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    loader, how = pyg_loader(data, seeds)
    torch.manual_seed(0)
    sides: dict[str, Any] = {}
    trimmed = pyg_trimmed_model(data.num_node_features, HIDDEN, 8)
    trimmed_opt = torch.optim.Adam(trimmed.parameters(), lr=3e-3)
    sides["pyg_trimmed"] = lambda: pyg_epoch(trimmed, trimmed_opt, loader, trim=True)
    if args.plain:
        torch.manual_seed(0)
        plain = PyGSAGE(data.num_node_features, HIDDEN, 8)
        plain_opt = torch.optim.Adam(plain.parameters(), lr=3e-3)
        sides["pyg_plain"] = lambda: pyg_epoch(plain, plain_opt, loader)
    ours = OurRun(data, seeds)
    sides["ours"] = ours.epoch
    for run in sides.values():  # warm-up
        run()
    names = list(sides)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            times[name].append(sides[name]())
        print(f"round {r}: " + ", ".join(f"{n} {times[n][-1]:.3f} s" for n in names))
    for name in names:
        print(f"{name:12s} {spread(times[name], 's/epoch')}")
    print(f"peer batches: {how}")
    med = {n: statistics.median(t) for n, t in times.items()}
    extra: dict[str, Any] = {"peer_batches": how}
    if args.plain:
        extra.update(pyg_plain_rounds=times["pyg_plain"],
                     ratio_plain=med["pyg_plain"] / med["ours"])  # fmt: skip
        print(f"ratio_plain={med['pyg_plain'] / med['ours']:.3f}")
    finish(args.json, "bench_gnn", times["ours"], times["pyg_trimmed"],
           ours_label="train_gnn.py's GraphSAGE epoch",
           peer_label="PyG GraphSAGE with trim_to_layer, same sampler", unit="s/epoch",
           target=1.0, extra=extra)  # fmt: skip


if __name__ == "__main__":
    main()
