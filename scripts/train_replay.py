"""train.py with data.decode=gpu whose loader workers neither decode nor augment: the training process's side of it.

Each worker still reads its batch's files and collates them, then puts one fixed random uint8 batch (made once per
worker, in host memory) with the batch's real labels into the loader's ring (swin.batch_ring) instead of decoding
and augmenting on the GPU (with data.batch_ring=gpu that is a copy to the GPU, their only GPU work). Everything in
the training process runs as in data.decode=gpu: the DataLoader, the ring, the side stream's copy (host ring),
normalisation and erasing. Against train.py on synthetic data (no loader) this prices the training process's own
side of each batch; scripts/bench_worker_cost.py prices the workers' GPU work beside synthetic data. The loss it
reports is meaningless (noise images).

    python scripts/train_replay.py experiment=imagenet_swin_tiny data.root=/data data.decode=gpu data.num_workers=8 ...
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import get_worker_info

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from swin.gpu_augment import transform_shape  # noqa: E402
from swin.gpu_data import DeviceCollate, collate_encoded  # noqa: E402


class ReplayCollate(DeviceCollate):
    """A DeviceCollate whose workers put a fixed noise batch and the files' labels into the ring (see the module)."""

    def __init__(self, collate: DeviceCollate):
        self.__dict__.update(collate.__dict__)
        self.noise: torch.Tensor | None = None

    def __call__(self, samples: list) -> tuple[Any, None, int, list[str]]:
        targets = torch.as_tensor(collate_encoded(samples).targets)
        if self.noise is None:
            worker = get_worker_info()
            g = torch.Generator().manual_seed(worker.id if worker is not None else 0)
            self.noise = torch.randint(0, 256, (self.ring.images.shape[1], *transform_shape(self.transform)),
                                       generator=g, dtype=torch.uint8)
        return self.ring.put(self.noise[:len(targets)], targets), None, 0, []


def replaying(worker_settings: Any) -> Any:
    """swin.data._worker_settings, with ReplayCollate for the collate of workers that decode into a ring (an error
    for any other loader: it would not be a replay)."""
    def settings(*args: Any, **kwargs: Any) -> dict[str, Any]:
        s = worker_settings(*args, **kwargs)
        collate = s.get("collate_fn")
        if not (isinstance(collate, DeviceCollate) and collate.ring is not None):
            raise SystemExit("train_replay.py replays loader workers that decode into a ring: it needs "
                             "data.num_workers > 0 and no data.gpu_decode_thread or data.augment=gpu")
        # imported by its module name, not as __main__: spawned workers unpickle it from there
        from train_replay import ReplayCollate as Replay
        s["collate_fn"] = Replay(collate)
        print(f"train_replay: {s['num_workers']} loader workers put noise batches in the ring (no decoding)",
              flush=True)
        return s
    return settings


def main() -> None:
    import swin.data
    if not any(arg.startswith("data.decode=gpu") for arg in sys.argv[1:]):
        raise SystemExit("train_replay.py replays data.decode=gpu's workers: give data.decode=gpu with train.py's "
                         "other arguments")
    swin.data._worker_settings = replaying(swin.data._worker_settings)
    sys.argv[0] = str(ROOT / "train.py")
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main()
