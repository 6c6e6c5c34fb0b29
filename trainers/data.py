"""Data order and augmentation randomness that survive resume and world-size changes.

Two pieces make a run reproducible whatever the number of ranks, DataLoader workers or
where it was resumed:

* :class:`ShardedSampler` fixes the order of samples by ``(seed, epoch)`` alone. The epoch
  permutation is ``torch.randperm(num_samples)`` drawn from a ``torch.Generator`` seeded with
  ``derive_seed(seed, epoch)``. After skipping the ``start`` samples already consumed this
  epoch, the rest is cut into *global* batches of ``B = batch_size * world_size``; rank ``r``
  takes the slice ``[r * batch_size, (r + 1) * batch_size)`` of every global batch. So a
  world of 1 with batch ``B`` and a world of 2 with batch ``B / 2`` see the same global
  batches, and a run resumed at ``start`` (possibly with another world size: the remaining
  indices are simply re-split) continues with exactly the samples not yet used.
* :class:`SeededDataset` makes augmentation depend only on ``(seed, epoch, index)``: it runs
  ``dataset[index]`` with torch's CPU generator seeded by ``derive_seed(seed, epoch, index)``
  inside ``torch.random.fork_rng``, so neither the worker layout nor the resume position nor
  the training loop's own random stream matters. **Transforms must draw their randomness
  from torch's RNG** (``torch.rand``, ``torch.randint``, ...); ``random`` and ``numpy.random``
  are not reseeded per sample.

How the epoch reaches the dataset, even inside DataLoader worker processes: the sampler is a
*batch sampler* whose items are ``(epoch, index)`` pairs, and :class:`SeededDataset` unpacks
them. The pairs travel to the workers with the indices, so no shared state is needed and
``persistent_workers=True`` is safe.

Example:
    >>> sampler = ShardedSampler(10, batch_size=2, world_size=2, rank=1, seed=0, epoch=3)
    >>> loader = torch.utils.data.DataLoader(SeededDataset(dataset, seed=0), batch_sampler=sampler)
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

__all__ = ["SeededDataset", "ShardedSampler", "derive_seed"]


def derive_seed(*values: int) -> int:
    """A 63-bit seed that depends on every value (BLAKE2b of their int64 encodings).

    Unlike ``seed + epoch`` it does not collide for ``(0, 1)`` and ``(1, 0)``.
    """
    data = struct.pack(f"<{len(values)}q", *(int(v) for v in values))
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class ShardedSampler(Sampler[list[Any]]):
    """Batch sampler: this rank's share of each global batch of one epoch.

    Args:
        num_samples: length of the dataset.
        batch_size: samples per rank per batch (the global batch is ``batch_size *
            world_size``).
        world_size: number of ranks.
        rank: this rank.
        seed: run seed; with ``epoch`` it fixes the permutation.
        epoch: the epoch to iterate (change it with :meth:`set_epoch`).
        start: global samples of this epoch already consumed (resume position); they are
            skipped and the rest is cut into global batches from there.
        drop_last: drop the final incomplete global batch. If kept, it is split into
            contiguous per-rank chunks whose sizes differ by at most one; a rank whose
            chunk is empty yields nothing for it.
        shuffle: permute the samples; ``False`` keeps dataset order (evaluation).
        with_epoch: yield ``(epoch, index)`` pairs for :class:`SeededDataset` (default);
            ``False`` yields plain indices.

    The number of batches a rank yields is ``len(sampler)``; with ``drop_last`` it is the
    same on every rank.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        batch_size: int,
        world_size: int = 1,
        rank: int = 0,
        seed: int = 0,
        epoch: int = 0,
        start: int = 0,
        drop_last: bool = True,
        shuffle: bool = True,
        with_epoch: bool = True,
    ) -> None:
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}"
            )
        self.num_samples = int(num_samples)
        self.batch_size = int(batch_size)
        self.world_size = int(world_size)
        self.rank = int(rank)
        self.seed = int(seed)
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.with_epoch = with_epoch
        self.epoch = 0
        self.start = 0
        self.set_epoch(epoch, start=start)

    @property
    def global_batch_size(self) -> int:
        """``batch_size * world_size``: samples per global batch."""
        return self.batch_size * self.world_size

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Iterate epoch ``epoch`` from global sample position ``start``."""
        if not 0 <= start <= self.num_samples:
            raise ValueError(f"start must be in [0, {self.num_samples}], got {start}")
        self.epoch = int(epoch)
        self.start = int(start)

    def permutation(self) -> torch.Tensor:
        """The epoch's sample order: an int64 tensor of ``num_samples`` indices."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        generator = torch.Generator().manual_seed(derive_seed(self.seed, self.epoch))
        return torch.randperm(self.num_samples, generator=generator)

    def global_batch_sizes(self) -> list[int]:
        """Size of every global batch still to come this epoch, in order."""
        remaining = self.num_samples - self.start
        full, rest = divmod(remaining, self.global_batch_size)
        sizes = [self.global_batch_size] * full
        if rest and not self.drop_last:
            sizes.append(rest)
        return sizes

    def _rank_slice(self, size: int) -> tuple[int, int]:
        """Offsets of this rank's chunk in a global batch of ``size`` samples."""
        if size == self.global_batch_size:
            return self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        base, extra = divmod(size, self.world_size)
        lo = self.rank * base + min(self.rank, extra)
        return lo, lo + base + (1 if self.rank < extra else 0)

    def __iter__(self) -> Iterator[list[Any]]:
        order: Sequence[int] = self.permutation()[self.start :].tolist()
        offset = 0
        for size in self.global_batch_sizes():
            lo, hi = self._rank_slice(size)
            indices = order[offset + lo : offset + hi]
            offset += size
            if not indices:
                continue
            if self.with_epoch:
                yield [(self.epoch, i) for i in indices]
            else:
                yield list(indices)

    def __len__(self) -> int:
        chunks = (self._rank_slice(size) for size in self.global_batch_sizes())
        return sum(1 for lo, hi in chunks if hi > lo)


class SeededDataset(Dataset):
    """Runs ``dataset[index]`` under a torch seed derived from ``(seed, epoch, index)``.

    Keys are ``(epoch, index)`` pairs as yielded by :class:`ShardedSampler`; a plain integer
    key means epoch 0. The caller's RNG state is untouched (``torch.random.fork_rng``), and
    only torch's CPU generator is reseeded: transforms must draw from it (see the module
    docstring).
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = int(seed)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: int | tuple[int, int]) -> Any:
        epoch, index = (0, key) if isinstance(key, int) else key
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(derive_seed(self.seed, epoch, index))
            return self.dataset[index]
