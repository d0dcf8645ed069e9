"""swin.batch_ring: loader workers send batches through a ring of shared buffers; every batch arrives intact, in
order, and every slot comes back, also when an epoch is abandoned half-way."""
from __future__ import annotations

import gc
import pickle
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from swin.batch_ring import BatchRing, ReceivedBatch, RingSlot
from swin.data import DeviceLoader, ResumableDistributedSampler, _Normalize


class _Images(Dataset):
    """Image i: uint8 noise drawn from a generator seeded by i (the same in any process), label i % 7."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.seed * 10_000 + i)
        return torch.randint(0, 256, (3, 6, 5), generator=g, dtype=torch.uint8), i % 7


class _RingCollate:
    """What swin.gpu_data.DeviceCollate does with a ring in a worker, minus the decoding."""

    def __init__(self, ring: BatchRing):
        self.ring = ring

    def __call__(self, samples: list) -> tuple:
        images = torch.stack([s[0] for s in samples])
        return self.ring.put(images, torch.tensor([s[1] for s in samples])), None, 0


def _free_slots(ring: BatchRing, timeout_s: float = 10.0) -> int:
    """How many slots are in the ring's free queue, once its feeder thread has put them there."""
    deadline = time.monotonic() + timeout_s
    while ring.free.qsize() < ring.slots and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    return ring.free.qsize()


@pytest.fixture
def ring_loader():
    seed = torch.randint(0, 1000, ()).item()
    ds = _Images(41, seed)
    workers = 2
    # as few slots as swin.data gives a loader: the DataLoader's batches in flight plus the consumer's limit
    ring = BatchRing(workers * 2 + BatchRing.in_flight_limit + 1, 4, (3, 6, 5))
    sampler = ResumableDistributedSampler(ds, 1, 0, shuffle=True, seed=seed)
    dl = DataLoader(ds, batch_size=4, sampler=sampler, drop_last=True, num_workers=workers,
                    collate_fn=_RingCollate(ring), persistent_workers=True, prefetch_factor=2)
    return ds, ring, DeviceLoader(dl, torch.device("cpu"), _Normalize(torch.device("cpu"), None, None), sampler)


def test_ring_batches_arrive_intact_in_order_and_every_slot_returns(ring_loader):
    ds, ring, loader = ring_loader
    for epoch in range(3):  # more batches than slots: slots are reused
        loader.set_epoch(epoch)
        order = list(loader.sampler)
        batches = list(loader)
        assert len(batches) == 10
        for k, (x, y, skipped) in enumerate(batches):
            want = [ds[i] for i in order[4 * k:4 * k + 4]]
            assert torch.equal(x, torch.stack([w[0] for w in want]).float())
            assert torch.equal(y, torch.tensor([w[1] for w in want])) and skipped == 0
        assert _free_slots(ring) == ring.slots
    # an epoch abandoned after two batches: the batches the DataLoader had fetched give their slots back
    loader.set_epoch(3)
    it = iter(loader)
    next(it), next(it)
    del it
    loader.set_epoch(4)
    assert len(list(loader)) == 10
    assert _free_slots(ring) == ring.slots


def test_ring_refuses_batches_that_do_not_fit_and_unknown_rings():
    ring = BatchRing(2, 4, (3, 6, 5))
    fresh = torch.randint(0, 256, (4, 3, 6, 5), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"\(5, 3, 6, 5\).*up to 4 uint8 images of \(3, 6, 5\)"):
        ring.put(torch.cat([fresh, fresh[:1]]), torch.arange(5))
    with pytest.raises(ValueError, match="does not fit"):
        ring.put(fresh.float(), torch.arange(4))
    with pytest.raises(ValueError, match="does not fit"):
        ring.put(fresh[:, :, :5], torch.arange(4))
    assert ring.free.qsize() == 2  # nothing taken by the refused batches
    # a partial batch (files dropped) travels with its length; in this process it comes back as a ReceivedBatch
    slot = ring.put(fresh[:3], torch.tensor([4, 5, 6]))
    received = pickle.loads(pickle.dumps(slot))
    assert isinstance(slot, RingSlot) and isinstance(received, ReceivedBatch)
    x, y = received.to(torch.device("cpu"))
    assert torch.equal(x, fresh[:3]) and torch.equal(y, torch.tensor([4, 5, 6]))
    fresh.zero_()  # the ring holds its own copy
    assert x.sum() > 0
    assert received.done()
    del received
    assert _free_slots(ring) == 2
    held = [ring.put(fresh, torch.arange(4)) for _ in range(2)]  # sent, never received: the ring is full
    with pytest.raises(RuntimeError, match="no free slot"):
        ring.put(fresh, torch.arange(4), timeout_s=0.1)
    assert len(held) == 2
    with pytest.raises(RuntimeError, match="no longer has"):
        ReceivedBatch("not-a-ring", 0, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_ring_copies_from_pinned_slots_without_syncing():
    """CUDA: the slots are page-locked, the copy to the device is queued without a host sync (sync debug mode
    'error'), and the slot comes back only after that copy has run."""
    ring = BatchRing(1, 64, (3, 224, 224))
    fresh = torch.randint(0, 256, (64, 3, 224, 224), dtype=torch.uint8)
    received = pickle.loads(pickle.dumps(ring.put(fresh, torch.arange(64))))
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):  # queue work ahead of the copy: it cannot have run when `to` returns
            busy = busy @ busy / 64
        x, y = received.to(torch.device("cuda"))
        assert not received.done()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ring.images.is_pinned()
    received.release()  # waits for the copy, then frees the slot
    assert received.done() and torch.equal(x.cpu(), fresh) and torch.equal(y.cpu(), torch.arange(64))
    assert _free_slots(ring) == 1
