"""Batches from loader workers through a ring of buffers made once, not one new shared tensor per batch.

A tensor a DataLoader worker returns the default way costs the training process, per batch: a new shared-memory
segment whose file descriptor it receives over a socket (Python code, in the DataLoader's pin-memory thread), a copy
into pinned memory, and an munmap when the batch is freed; the Python parts and the unmapping hold the GIL that the
training loop needs. Here the training process allocates the ring's slots once, the workers get them when they
start (inherited or sent once, like any tensor in a worker's arguments), and a batch travels as a slot number. The
slots live in shared host memory that every process copying to or from it pins (``cudaHostRegister``), or in a
GPU's memory (``device``), which the workers open over CUDA IPC when they unpickle the ring: no /dev/shm or locked
memory is needed and a batch does not go through the host (19 MB each way per 128 images at 224).

Protocol: a worker takes a free slot from the ring's queue (blocking), writes the batch and its targets there
(on the GPU: waits for that write to finish) and returns a :class:`RingSlot`; unpickled in the training process it
becomes a :class:`ReceivedBatch`, whose :meth:`ReceivedBatch.to` queues what reads the slot (a copy to the device, or
the caller's transform of the images in place) on the current stream, records an event after it, and gives the slot
back once that event has passed (:meth:`ReceivedBatch.release`, or when it is garbage-collected: batches a
DataLoader drops when an epoch is abandoned are given back too). Slots: the DataLoader's batches in flight plus
``in_flight_limit`` reads the consumer may leave unfinished, so a worker always finds one in the end.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import multiprocessing
import os
import queue
import shutil
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

_rings: weakref.WeakValueDictionary[str, BatchRing] = weakref.WeakValueDictionary()
_ids = itertools.count()


def _unregister(pointers: list[int]) -> None:
    for ptr in pointers:
        torch.cuda.cudart().cudaHostUnregister(ptr)


def _shared(t: torch.Tensor) -> torch.Tensor:
    """`t` in memory other processes can open: shared host memory; a GPU's memory needs nothing (CUDA IPC)."""
    return t if t.is_cuda else t.share_memory_()


def _check_shared_memory(nbytes: int, where: str = "/dev/shm") -> None:
    """A clear error instead of a SIGBUS later when the ring cannot fit in shared memory (a container's default
    /dev/shm is 64 MB)."""
    try:
        free = shutil.disk_usage(where).free
    except OSError:  # no such file system here: shared memory lives elsewhere
        return
    if free < nbytes:
        raise RuntimeError(f"the loader's batch ring needs {nbytes / 2**20:,.0f} MiB of shared memory and {where} has "
                           f"{free / 2**20:,.0f} MiB free: give it more (docker run --shm-size=...), keep the ring in "
                           "the GPU's memory (data.batch_ring=gpu), or lower data.num_workers or the batch size")


class BatchRing:
    """``slots`` buffers of ``batch`` uint8 images of ``image_shape`` and their int64 targets, with a queue of the
    free ones: in the memory of ``device`` where that is a GPU (shared with the workers over CUDA IPC: they must be
    spawned), else in shared host memory. ``context``: the DataLoader's multiprocessing context (its queue must be
    of the same start method)."""

    in_flight_limit = 6  # reads a consumer may leave unfinished before it waits for the oldest

    def __init__(self, slots: int, batch: int, image_shape: tuple[int, ...], context: Any = None,
                 device: torch.device | str | None = None):
        if slots < 1 or batch < 1:
            raise ValueError(f"a batch ring needs at least one slot of one image (slots={slots}, batch={batch})")
        self.id = f"{os.getpid()}-{next(_ids)}"
        device = torch.device(device or "cpu")
        if device.type == "cpu":
            _check_shared_memory(slots * batch * (math.prod(image_shape) + 8))
        self.images = _shared(torch.empty((slots, batch, *image_shape), dtype=torch.uint8, device=device))
        self.targets = _shared(torch.empty((slots, batch), dtype=torch.int64, device=device))
        self.free = multiprocessing.get_context(context).Queue()
        for k in range(slots):
            self.free.put(k)
        self._pinned_in: int | None = None  # the pid that registered the memory with CUDA
        self._process_local()
        _rings[self.id] = self

    def _process_local(self) -> None:
        self._giving_back = threading.local()  # see give_back
        self._deferred: list[int] = []

    @property
    def slots(self) -> int:
        return self.images.shape[0]

    @property
    def on_device(self) -> bool:
        """Whether the slots are in a GPU's memory (else in shared host memory)."""
        return self.images.is_cuda

    def pin(self) -> None:
        """Page-lock the slots for this process's CUDA context, once (asynchronous copies from and to them); slots
        in a GPU's memory need nothing. A refusal is an error: it would also stay behind as CUDA's last error and
        fail an unrelated later launch."""
        if self._pinned_in == os.getpid() or self.on_device:
            return
        cudart, pinned = torch.cuda.cudart(), []
        for t in (self.images, self.targets):
            err = cudart.cudaHostRegister(t.data_ptr(), t.untyped_storage().nbytes(), 0)
            if err != 0:
                _unregister(pinned)
                raise RuntimeError(
                    f"could not page-lock the loader's batch ring ({self.images.nbytes / 2**20:,.0f} MiB; "
                    f"cudaHostRegister: {cudart.cudaGetErrorString(err)}): raise the locked-memory limit "
                    "(ulimit -l), keep the ring in the GPU's memory (data.batch_ring=gpu), or lower "
                    "data.num_workers or the batch size")
            pinned.append(t.data_ptr())
        self._pinned_in = os.getpid()
        # unregistered before the memory is unmapped (a later mapping at that address could not be registered)
        weakref.finalize(self, _unregister, pinned)

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("_giving_back", "_deferred")}
        return {**state, "_pinned_in": None}  # a spawned worker pins for its own context

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._process_local()
        _rings.setdefault(self.id, self)

    def give_back(self, slot: int) -> None:
        """Put `slot` back in the free queue. The queue's lock is not reentrant: a batch the garbage collector
        releases while this thread is inside give_back already has its slot put back by that outer call."""
        if getattr(self._giving_back, "active", False):
            self._deferred.append(slot)
            return
        self._giving_back.active = True
        try:
            self.free.put(slot)
            while self._deferred:
                self.free.put(self._deferred.pop())
        finally:
            self._giving_back.active = False

    def put(self, images: torch.Tensor, targets: torch.Tensor, timeout_s: float = 600.0) -> RingSlot:
        """(In a worker.) Write a batch into a free slot, waiting for one; the slot's number, to return instead. The
        write has finished when this returns (the slot's reader in another process cannot wait for our stream)."""
        n, (most, *shape) = images.shape[0], self.images.shape[1:]
        if list(images.shape[1:]) != shape or n > most or images.dtype != torch.uint8:
            raise ValueError(f"a batch of {tuple(images.shape)} {images.dtype} images does not fit the loader's "
                             f"batch ring (up to {most} uint8 images of {tuple(shape)})")
        if tuple(targets.shape) != (n,):
            raise ValueError(f"a batch of {n} images came with targets of shape {tuple(targets.shape)}, not ({n},)")
        if images.is_cuda:
            self.pin()
        try:
            slot = self.free.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"no free slot in the loader's batch ring for {timeout_s:.0f} s: the training process "
                               "stopped giving batches back") from None
        try:
            self.images[slot, :n].copy_(images)  # into host memory: synchronous; on the GPU: waited for below
            self.targets[slot, :n].copy_(targets)
            if self.on_device:
                torch.cuda.current_stream(self.images.device).synchronize()
        except BaseException:
            self.give_back(slot)
            raise
        return RingSlot(self.id, slot, n)


class RingSlot:
    """What a worker returns for a batch in a ring slot: a few pickled bytes. Unpickled, a ReceivedBatch."""

    def __init__(self, ring_id: str, slot: int, n: int):
        self.ring_id, self.slot, self.n = ring_id, slot, n

    def __reduce__(self) -> tuple:
        return ReceivedBatch, (self.ring_id, self.slot, self.n)


class ReceivedBatch:
    """(In the training process.) A batch in a slot of a ring this process made; gives the slot back once what
    read it (:meth:`to`) is done (:meth:`release`, or when collected)."""

    def __init__(self, ring_id: str, slot: int, n: int):
        ring = _rings.get(ring_id)
        if ring is None:
            raise RuntimeError(f"a batch arrived for the loader's batch ring {ring_id}, which this process no longer "
                               "has")
        self.ring, self.slot, self.n = ring, slot, n
        self.copied: torch.cuda.Event | None = None  # recorded after the last read of the slot
        self.released = False

    def to(self, device: torch.device, transform: Callable[[torch.Tensor], torch.Tensor] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
        """(transform(images), targets) on `device`, queued on the current stream, in memory of their own: from a
        slot in host memory copied first, from a slot in the GPU's memory read in place by ``transform`` (which
        must return a new tensor; none: a copy). On the CPU, copies of the slot."""
        images, targets = self.ring.images[self.slot, :self.n], self.ring.targets[self.slot, :self.n]
        device = torch.device(device)
        if self.ring.on_device and (device.type != "cuda" or device.index not in (None, images.device.index)):
            raise ValueError(f"a batch in a ring on {images.device} was asked for on {device}")
        if device.type != "cuda":
            return (transform or torch.clone)(images), targets.clone()
        self.ring.pin()
        try:
            if self.ring.on_device:
                return (transform or torch.clone)(images), targets.clone()
            images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            return (transform(images) if transform else images), targets
        finally:  # whatever was queued: the slot goes back only after it
            self.copied = torch.cuda.Event()
            self.copied.record()

    def done(self) -> bool:
        """Whether the slot can be given back without waiting (its reads finished, or none were queued)."""
        return self.copied is None or self.copied.query()

    def release(self) -> None:
        """Give the slot back, after waiting for its reads if they are still running."""
        if not self.released:
            self.released = True
            if self.copied is not None:
                self.copied.synchronize()
            self.ring.give_back(self.slot)

    def __del__(self) -> None:
        # not when __init__ raised, nor while the interpreter shuts down (the ring and CUDA are going away too)
        if hasattr(self, "released") and not sys.is_finalizing():
            with contextlib.suppress(ValueError, OSError, RuntimeError):  # a closed queue, CUDA torn down
                self.release()
