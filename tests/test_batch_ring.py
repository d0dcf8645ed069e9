"""batch_ring: loader workers send batches through a ring of shared buffers; every batch arrives intact, in
order, and every slot comes back, also when an epoch is abandoned half-way."""
from __future__ import annotations

import pickle
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from swin.data.gpu.batch_ring import BatchRing, ReceivedBatch, RingSlot
from swin.data.loaders import DeviceLoader, ResumableDistributedSampler, _Normalize


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
    """What swin.data.gpu.decode.DeviceCollate does with a ring in a worker, minus the decoding."""

    def __init__(self, ring: BatchRing):
        self.ring = ring

    def __call__(self, samples: list) -> tuple:
        images = torch.stack([s[0] for s in samples])
        return self.ring.put(images, torch.tensor([s[1] for s in samples])), None, 0


def _free_slots(ring: BatchRing, timeout_s: float = 10.0) -> int:
    """How many slots are in the ring's free queue (given back by reference counting alone: no gc.collect)."""
    deadline = time.monotonic() + timeout_s
    while ring.free.qsize() < ring.slots and time.monotonic() < deadline:
        time.sleep(0.05)
    return ring.free.qsize()


WORKERS, BATCH = 2, 4


def _ring_loader(slots: int, device: str = "cpu", ring_device: str | None = None
                 ) -> tuple[_Images, BatchRing, DeviceLoader]:
    """163 images in batches of 4 (40 per epoch, several times the slots: each slot is reused) from 2 workers;
    ring_device: the ring's slots in that GPU's memory (the workers spawned, as CUDA IPC needs)."""
    seed = torch.randint(0, 1000, ()).item()
    ds = _Images(163, seed)
    context = "spawn" if ring_device else None
    ring = BatchRing(slots, BATCH, (3, 6, 5), context, ring_device)
    sampler = ResumableDistributedSampler(ds, 1, 0, shuffle=True, seed=seed)
    dl = DataLoader(ds, batch_size=BATCH, sampler=sampler, drop_last=True, num_workers=WORKERS,
                    collate_fn=_RingCollate(ring), persistent_workers=True, prefetch_factor=2,
                    multiprocessing_context=context)
    return ds, ring, DeviceLoader(dl, torch.device(device), _Normalize(torch.device(device), None, None), sampler)


def _expected(ds: _Images, order: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    want = [ds[i] for i in order[BATCH * k:BATCH * k + BATCH]]
    return torch.stack([w[0] for w in want]).float(), torch.tensor([w[1] for w in want])


def _epochs(ds: _Images, loader: DeviceLoader, epochs: int) -> tuple[list, list]:
    """Every batch of `epochs` epochs as handed out, and what each should be."""
    got, want = [], []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        order = list(loader.sampler)
        batches = list(loader)
        assert len(batches) == 40
        got += batches
        want += [_expected(ds, order, k) for k in range(40)]
    return got, want


# as many slots as swin.data gives a loader (the DataLoader's batches in flight, plus the consumer's unfinished
# copies, plus one), and the fewest that work on the CPU, where every copy is finished when the batch is handed out
@pytest.mark.parametrize("slots", [WORKERS * 2 + BatchRing.in_flight_limit + 1, WORKERS * 2])
def test_ring_batches_arrive_intact_in_order_and_every_slot_returns(slots):
    ds, ring, loader = _ring_loader(slots)
    got, want = _epochs(ds, loader, 3)
    assert _free_slots(ring) == ring.slots
    # checked after the last epoch: a batch still reading its slot would show the slot's later contents
    for (x, y, skipped), (wx, wy) in zip(got, want, strict=True):
        assert torch.equal(x, wx) and torch.equal(y, wy) and skipped == 0
    # an epoch abandoned after two batches: the batches the DataLoader had fetched give their slots back
    loader.set_epoch(3)
    it = iter(loader)
    next(it), next(it)
    del it
    loader.set_epoch(4)
    assert len(list(loader)) == 40
    assert _free_slots(ring) == ring.slots


class _Copying:
    """A received batch whose copy is still running until `finished`."""

    ring = BatchRing

    def __init__(self, finished: bool = False):
        self.finished, self.released = finished, False

    def done(self) -> bool:
        return self.finished

    def release(self) -> None:
        self.released = True


def test_device_loader_gives_slots_back_in_order_and_waits_beyond_the_limit():
    """Slots go back oldest first once their copies are done; past in_flight_limit unfinished copies the oldest is
    waited for (release), so the consumer never holds more slots than the ring has room for."""
    loader = DeviceLoader(DataLoader(list(range(8)), batch_size=2), torch.device("cpu"),
                          _Normalize(torch.device("cpu"), None, None))
    limit = BatchRing.in_flight_limit
    pending = [_Copying() for _ in range(limit + 2)]
    loader._received.extend(pending)
    loader._release_copied()
    assert [b.released for b in pending] == [True, True] + [False] * limit  # waited for the two oldest
    pending[3].finished = True  # done, but behind an unfinished one: stays
    loader._release_copied()
    assert not pending[3].released and len(loader._received) == limit
    pending[2].finished = True
    loader._release_copied()
    assert pending[2].released and pending[3].released and len(loader._received) == limit - 2


def test_ring_refuses_batches_that_do_not_fit_and_unknown_rings():
    ring = BatchRing(2, 4, (3, 6, 5))
    fresh = torch.randint(0, 256, (4, 3, 6, 5), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"\(5, 3, 6, 5\).*up to 4 uint8 images of \(3, 6, 5\)"):
        ring.put(torch.cat([fresh, fresh[:1]]), torch.arange(5))
    with pytest.raises(ValueError, match="does not fit"):
        ring.put(fresh.float(), torch.arange(4))
    with pytest.raises(ValueError, match="does not fit"):
        ring.put(fresh[:, :, :5], torch.arange(4))
    with pytest.raises(ValueError, match=r"targets of shape \(1,\), not \(4,\)"):
        ring.put(fresh, torch.arange(1))  # copy_ would have broadcast it
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


def test_ring_says_when_shared_memory_is_too_small(monkeypatch):
    """A container's /dev/shm (64 MB by default) too small for the ring: one clear line naming the fix, instead of
    a SIGBUS when a worker first writes a slot."""
    import shutil
    import types
    monkeypatch.setattr(shutil, "disk_usage", lambda path: types.SimpleNamespace(total=64 << 20, free=4 << 20))
    with pytest.raises(RuntimeError,
                       match=r"needs 423 MiB of shared memory and /dev/shm has 4 MiB free.*shm-size.*batch_ring=gpu"):
        BatchRing(2 * 8 + 7, 128, (3, 224, 224))  # 23 slots of 128 images of 3 x 224 x 224 and their targets


def test_a_slot_given_back_by_the_collector_inside_give_back_is_not_lost():
    """The free queue's lock is not reentrant: a batch the garbage collector frees while this thread is inside
    give_back has its slot put back by that outer call, not by a second put that would wait on the lock forever."""
    ring = BatchRing(3, 1, (1,))
    taken = [ring.free.get(timeout=5) for _ in range(3)]
    ring._giving_back.active = True  # as if the collector ran inside a put of give_back
    ring.give_back(taken[0])
    assert ring.free.qsize() == 0
    ring._giving_back.active = False
    ring.give_back(taken[1])  # the outer call: its slot and the deferred one
    assert sorted(ring.free.get(timeout=5) for _ in range(2)) == sorted(taken[:2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ring_device", [None, "cuda"])
def test_gpu_ring_slots_are_reused_only_after_their_copies(ring_device):
    """CUDA: with the consumer's stream kept busy, the reads of the ring (copies from pinned host memory, or the
    normalisation reading slots in the GPU's memory that spawned workers write over CUDA IPC) queue up behind its
    work; a slot given back before its read ran would be overwritten by a worker and show up in an earlier batch.
    Every batch of three epochs (10 per slot) is checked after the last."""
    ds, ring, loader = _ring_loader(WORKERS * 2 + BatchRing.in_flight_limit + 1, "cuda", ring_device)
    busy = torch.randn(2048, 2048, device="cuda")
    got, want = [], []
    for epoch in range(3):
        loader.set_epoch(epoch)
        order = list(loader.sampler)
        for k, (x, y, _) in enumerate(loader):
            for _ in range(4):  # ~1 ms of work queued ahead of the next batch's copy
                busy = busy @ busy / 45
            got.append((x, y))
            want.append(_expected(ds, order, k))
    assert ring.images.is_cuda if ring_device else ring.images.is_pinned()
    for (x, y), (wx, wy) in zip(got, want, strict=True):
        assert torch.equal(x.cpu(), wx) and torch.equal(y.cpu(), wy)
    torch.cuda.synchronize()
    loader._release_copied()  # the last epoch's last copies (the next epoch's first batch would give them back)
    assert len(got) == 120 and _free_slots(ring) == ring.slots


def _behind_busy_work(read):
    """read(), queued behind ~20 large matmuls on the current stream under CUDA sync debug mode 'error': what it
    queues cannot have run when it returns, and a host sync in it fails."""
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            busy = busy @ busy / 64
        return read()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_ring_copies_from_pinned_slots_without_syncing():
    """CUDA: the slots are page-locked, the copy to the device is queued without a host sync (sync debug mode
    'error'), and the slot comes back only after that copy has run."""
    ring = BatchRing(1, 64, (3, 224, 224))
    fresh = torch.randint(0, 256, (64, 3, 224, 224), dtype=torch.uint8)
    received = pickle.loads(pickle.dumps(ring.put(fresh, torch.arange(64))))
    ring.pin()  # before the work is queued: registering does not wait for it, and takes its own time
    x, y = _behind_busy_work(lambda: received.to(torch.device("cuda")))
    assert not received.done()  # the copy is queued behind the busy work
    assert ring.images.is_pinned()
    received.release()  # waits for the copy, then frees the slot
    assert received.done() and torch.equal(x.cpu(), fresh) and torch.equal(y.cpu(), torch.arange(64))
    assert _free_slots(ring) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_ring_in_device_memory_is_read_in_place_without_syncing():
    """CUDA, slots in the GPU's memory: put() has finished writing when it returns; to() hands out the transform of
    the slot and a copy of its targets, queued without a host sync, in memory of their own (the slot can be
    overwritten afterwards), and the slot comes back only after those reads have run."""
    ring = BatchRing(1, 64, (3, 224, 224), device="cuda")
    fresh = torch.randint(0, 256, (64, 3, 224, 224), dtype=torch.uint8, device="cuda")
    labels = torch.randint(0, 1000, (64,))
    received = pickle.loads(pickle.dumps(ring.put(fresh, labels)))
    assert ring.on_device and not ring.images.is_pinned() and torch.equal(ring.images[0], fresh)
    x, y = _behind_busy_work(lambda: received.to(torch.device("cuda"), lambda t: t.float().div_(255)))
    assert not received.done()  # the reads are queued behind the busy work
    received.release()  # waits for the reads, then frees the slot
    assert received.done() and _free_slots(ring) == 1
    ring.images.zero_()
    ring.targets.zero_()
    assert torch.equal(x, fresh.float() / 255) and torch.equal(y.cpu(), labels)
    with pytest.raises(ValueError, match="a batch in a ring on cuda:0 was asked for on cpu"):
        pickle.loads(pickle.dumps(ring.put(fresh, labels))).to(torch.device("cpu:0"))
