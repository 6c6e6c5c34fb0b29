"""ShardedSampler partitions, world-size invariance, resume; SeededDataset determinism."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from trainers import SeededDataset, ShardedSampler, derive_seed


def global_batches(n, batch, world, **kw):
    """Zip the ranks' batches back into global batches of plain indices."""
    per_rank = [
        list(ShardedSampler(n, batch_size=batch, world_size=world, rank=r, **kw))
        for r in range(world)
    ]
    assert len({len(b) for b in per_rank}) == 1 or not kw.get("drop_last", True)
    out = []
    for k in range(max(len(b) for b in per_rank)):
        out.append([i for r in range(world) if k < len(per_rank[r]) for _, i in per_rank[r][k]])
    return out


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_sample_once_per_epoch(world, drop_last):
    n, batch = 23, 2
    batches = global_batches(n, batch, world, seed=1, epoch=4, drop_last=drop_last)
    flat = [i for b in batches for i in b]
    assert len(flat) == len(set(flat))
    if drop_last:
        assert len(flat) == (n // (batch * world)) * batch * world
    else:
        assert sorted(flat) == list(range(n))


def test_ranks_get_equal_slices_and_len():
    samplers = [
        ShardedSampler(20, batch_size=3, world_size=2, rank=r, seed=0, drop_last=False)
        for r in range(2)
    ]
    sizes = [[len(b) for b in s] for s in samplers]
    assert sizes == [[3, 3, 3, 1], [3, 3, 3, 1]]  # last global batch of 2 split 1 + 1
    assert [len(s) for s in samplers] == [4, 4]


def test_world_one_and_two_see_the_same_global_batches():
    one = global_batches(50, 8, 1, seed=9, epoch=2)
    two = global_batches(50, 4, 2, seed=9, epoch=2)
    assert one == two and len(one) == 6


def test_permutation_is_a_function_of_seed_and_epoch():
    def perm(seed, epoch):
        return ShardedSampler(100, batch_size=1, seed=seed, epoch=epoch).permutation()

    assert torch.equal(perm(0, 1), perm(0, 1))
    assert not torch.equal(perm(0, 1), perm(1, 0))
    assert not torch.equal(perm(0, 1), perm(0, 2))
    g = torch.Generator().manual_seed(derive_seed(0, 1))
    assert torch.equal(perm(0, 1), torch.randperm(100, generator=g))
    assert derive_seed(0, 1) != derive_seed(1, 0)


def test_start_resumes_exactly_even_with_another_world_size():
    n = 40
    full = global_batches(n, 4, 2, seed=3, epoch=1)
    resumed = global_batches(n, 4, 2, seed=3, epoch=1, start=16)
    assert resumed == full[2:]
    # After 16 samples, a world of 4 with batch 2 re-splits the remaining 24 samples.
    perm = ShardedSampler(n, batch_size=1, seed=3, epoch=1).permutation().tolist()
    rescaled = global_batches(n, 2, 4, seed=3, epoch=1, start=16)
    assert [i for b in rescaled for i in b] == perm[16:]
    assert sorted(i for b in full[:2] + rescaled for i in b) == list(range(n))


def test_set_epoch_and_epoch_in_items():
    s = ShardedSampler(6, batch_size=2, seed=0)
    s.set_epoch(5, start=2)
    batches = list(s)
    assert len(batches) == 2 and all(e == 5 for b in batches for e, _ in b)
    plain = ShardedSampler(6, batch_size=2, shuffle=False, with_epoch=False)
    assert list(plain) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="start"):
        s.set_epoch(0, start=7)


class Noisy(torch.utils.data.Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.rand(2) + i


def test_seeded_dataset_depends_only_on_seed_epoch_index():
    ds = SeededDataset(Noisy(), seed=4)
    torch.manual_seed(0)
    outer = torch.get_rng_state()
    a = ds[(1, 3)]
    assert torch.equal(torch.get_rng_state(), outer)  # caller's stream untouched
    torch.rand(5)
    assert torch.equal(ds[(1, 3)], a)
    assert not torch.equal(ds[(2, 3)], a)
    assert not torch.equal(SeededDataset(Noisy(), seed=5)[(1, 3)], a)
    g = torch.Generator().manual_seed(derive_seed(4, 1, 3))
    assert torch.equal(a, torch.rand(2, generator=g) + 3)


def test_same_batches_with_and_without_workers():
    def run(workers):
        sampler = ShardedSampler(12, batch_size=3, seed=2, epoch=1)
        loader = DataLoader(
            SeededDataset(Noisy(), seed=2), batch_sampler=sampler, num_workers=workers
        )
        return torch.cat(list(loader))

    assert torch.equal(run(0), run(2))
