"""The data path: uint8 batches normalised (and randomly erased) on the device one batch ahead (DeviceLoader),
synthetic batches made on the device (SyntheticLoader), and the data-wait fraction of a training run."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from _train_utils import DET, image_folder, make_cfg, train_inprocess
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_transform

from swin.config import to_settings
from swin.data.datasets import SyntheticDataset, TensorImageDataset, build_datasets
from swin.data.loaders import DeviceLoader, SyntheticLoader, _Normalize, build_loaders


def _folder_cfg(root, *overrides):
    return to_settings(make_cfg("data=imagefolder", f"data.root={root}", "data.num_workers=0", "model.img_size=16",
                                *overrides).data)


def test_folder_images_stay_uint8_until_normalised_on_the_device(tmp_path):
    """The dataset yields uint8; the loader's output equals timm's float pipeline (ToTensor + Normalize)."""
    from PIL import Image
    for split in ("train", "val"):
        for c in ("a", "b"):
            (tmp_path / split / c).mkdir(parents=True)
            for i in range(3):
                arr = torch.randint(0, 256, (23 + i, 31, 3), dtype=torch.uint8).numpy()
                Image.fromarray(arr).save(tmp_path / split / c / f"{i}.png")
    ds = build_datasets(_folder_cfg(tmp_path), 16)
    x, _ = ds.train[0]
    assert x.dtype == torch.uint8 and x.shape == (3, 16, 16)
    _, val = build_loaders(ds, _folder_cfg(tmp_path), torch.device("cpu"), 0, 1, 4, 4, seed=0)
    got = torch.cat([b[0] for b in val])
    tf = create_transform(input_size=16, is_training=False, interpolation="bicubic", crop_pct=0.875,
                          mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD)
    want = torch.stack([tf(ds.val.folder.loader(p)) for p, _ in ds.val.folder.samples])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def _uint8_batches(n: int, skipped: int = 0):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8, generator=g), torch.arange(4) + 10 * i,
             skipped + i) for i in range(n)]


class _Batches(list):
    """A list of batches standing in for a DataLoader (DeviceLoader needs batch_size and len)."""

    batch_size = 4


def _class_folders(root, layout: dict[str, list[str]]) -> None:
    """root/<split>/<class>/ with two PNGs of random pixels per class; a class named "-empty" gets its folder
    (named "empty") without images."""
    from PIL import Image
    for split, classes in layout.items():
        for c in classes:
            folder = root / split / c.lstrip("-")
            folder.mkdir(parents=True)
            for i in range(0 if c.startswith("-") else 2):
                Image.fromarray(torch.randint(0, 256, (9, 9, 3), dtype=torch.uint8).numpy()).save(folder / f"{i}.png")


@pytest.mark.parametrize("layout, says", [
    ({"train": ["a", "b"], "val": ["a", "b", "c"]},
     "have different class folders (only in val/: c); both splits need the same set of class sub-folders"),
    ({"train": ["a", "b", "d"], "val": ["a", "c"]}, "(only in train/: b, d; only in val/: c)"),
    ({"train": ["a", "b", "-empty"], "val": ["a", "b"]},
     "Found no valid file for the classes empty. Supported extensions are"),
    ({"train": ["a"], "val": ["a"]}, "has 1 class folder (a); classification needs at least 2"),
])
def test_folder_layout_mistakes_name_the_classes_and_the_fix(tmp_path, layout, says):
    """A folder dataset whose splits disagree, which has an empty class folder or a single class stops at start
    with a ValueError naming the classes (train.py prints it as one line)."""
    _class_folders(tmp_path, layout)
    with pytest.raises(ValueError) as error:
        build_datasets(_folder_cfg(tmp_path), 16)
    assert says in str(error.value)
    if "-empty" in layout["train"]:
        assert f"({tmp_path / 'train'}: every class needs a sub-folder holding its images" in str(error.value)


def test_device_loader_yields_every_batch_in_order_normalised():
    batches = _uint8_batches(5, skipped=1)
    norm = _Normalize(torch.device("cpu"), IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)
    out = list(DeviceLoader(_Batches(batches), torch.device("cpu"), norm))
    assert len(out) == 5
    mean = torch.tensor(IMAGENET_DEFAULT_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_DEFAULT_STD).view(1, 3, 1, 1)
    for (x, y, s), (x8, y8, s8) in zip(out, batches):
        torch.testing.assert_close(x, (x8.float() / 255 - mean) / std, rtol=1e-5, atol=1e-5)
        assert torch.equal(y, y8) and s == s8  # the unreadable-image count travels with its batch
    assert list(DeviceLoader(_Batches([]), torch.device("cpu"), norm)) == []


def test_random_erasing_runs_in_the_loader():
    """re_prob moves timm's RandomErasing from the worker transforms to the loader, after normalisation."""
    batches = _uint8_batches(3)
    plain = _Normalize(torch.device("cpu"), IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)
    erase = _Normalize(torch.device("cpu"), IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, re_prob=1.0,
                       re_mode="const")
    for (a, _, _), (b, _, _) in zip(DeviceLoader(_Batches(batches), "cpu", plain),
                                    DeviceLoader(_Batches(batches), "cpu", erase)):
        changed = (a != b).flatten(1).any(dim=1)
        assert changed.all()  # every image erased somewhere (probability 1) ...
        assert ((a != b) & (b != 0)).sum() == 0  # ... to zeros (mode const), and nowhere else changed


@pytest.mark.parametrize("mode,count,splits", [("const", 1, 0), ("pixel", 1, 0), ("rand", 1, 0), ("rand", 3, 0),
                                               ("pixel", 3, 2)])
def test_batch_random_erasing_erases_timms_boxes(mode, count, splits):
    """The batched erasing draws timm's boxes (same seed of Python's random, same order) and fills them as timm's
    mode says: zeros, one normal colour per box, normal noise per pixel; nothing else changes."""
    import random

    from timm.data.random_erasing import RandomErasing

    from swin.data.erasing import BatchRandomErasing
    args = dict(probability=0.6, mode=mode, max_count=count, num_splits=splits, device="cpu")
    x = torch.rand(48, 3, 24, 20) + 0.5  # no value is 0 or noise-like by chance
    seed = int(torch.randint(0, 2**31, ()))
    random.seed(seed)
    want = RandomErasing(**args)(x.clone())
    random.seed(seed)
    got = BatchRandomErasing(**args)(x.clone())
    state = random.getstate()
    random.seed(seed)
    RandomErasing(**args)(x.clone())
    assert random.getstate() == state  # the same number of draws as timm's
    erased = got != x
    assert torch.equal(erased, want != x)  # the same pixels, in every channel
    assert erased[:splits and 48 // splits].sum() == 0  # the clean split is left alone
    assert 0.1 < erased.flatten(1).any(1).float().mean() < 0.9
    fill = got[erased]
    if mode == "const":
        assert torch.equal(got, want)
    elif mode == "pixel":  # fresh noise per pixel (float32 normals collide now and then: not all distinct)
        assert abs(fill.mean()) < 0.05 and abs(fill.std() - 1) < 0.05 and fill.unique().numel() > 0.99 * fill.numel()
    elif count == 1:  # one colour per box and channel, a different one for each box
        colours = [got[i, c][erased[i, c]].unique() for i in range(48) for c in range(3) if erased[i, c].any()]
        assert all(colour.numel() == 1 for colour in colours)
        assert torch.cat(colours).unique().numel() == len(colours)
    else:  # overlapping boxes: the later box's colour where they overlap
        assert fill.unique().numel() <= 48 * count * 3


def test_batch_random_erasing_of_an_empty_batch_is_the_empty_batch():
    from swin.data.erasing import BatchRandomErasing
    assert BatchRandomErasing(1.0, mode="pixel", device="cpu")(torch.rand(0, 3, 8, 8)).shape == (0, 3, 8, 8)


def test_batch_random_erasing_leaves_single_images_to_timm():
    import random

    from timm.data.random_erasing import RandomErasing

    from swin.data.erasing import BatchRandomErasing
    x = torch.rand(3, 16, 16) + 0.5
    random.seed(5)
    want = RandomErasing(1.0, mode="const", device="cpu")(x.clone())
    random.seed(5)
    assert torch.equal(BatchRandomErasing(1.0, mode="const", device="cpu")(x.clone()), want)
    assert not torch.equal(want, x)


@pytest.mark.gpu
def test_gpu_batch_random_erasing_matches_the_cpu_and_never_syncs():
    """On CUDA: the boxes of the same seed as on the CPU, erased without waiting for the device."""
    import random

    from swin.data.erasing import BatchRandomErasing
    x = torch.rand(128, 3, 224, 224) + 0.5
    erase = BatchRandomErasing(0.25, mode="pixel", device="cuda")
    random.seed(11)
    want = erase(x.clone()) != x
    random.seed(11)
    gpu = x.cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = erase(gpu.clone()) != gpu
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert want.any() and torch.equal(got.cpu(), want)


def _synthetic(n=40, classes=5, rank=0, world=1, train=True, seed=3, batch=4):
    ds = SyntheticDataset(n, (8, 8), classes, seed=0, pool=8)
    norm = _Normalize(torch.device("cpu"), IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)
    return ds, SyntheticLoader(ds, batch, torch.device("cpu"), norm, rank, world, seed=seed, train=train)


def test_synthetic_batches_are_deterministic_learnable_and_resumable():
    ds, loader = _synthetic()
    assert loader.num_batches == 10 and len(loader) == 10
    loader.set_epoch(1)
    epoch1 = list(loader)
    _, again = _synthetic()
    again.set_epoch(1)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(epoch1, again))
    again.set_epoch(1, start_batch=7)  # resuming mid-epoch: the same remaining batches
    rest = list(again)
    assert len(rest) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(epoch1[7:], rest))
    again.set_epoch(2)
    assert not torch.equal(next(iter(again))[0], epoch1[0][0])  # another epoch, other draws
    # each image is a pool image with the label of its index: a learnable task
    pool = (ds.pool(torch.device("cpu")).float() / 255 - torch.tensor(IMAGENET_DEFAULT_MEAN).view(3, 1, 1)) \
        / torch.tensor(IMAGENET_DEFAULT_STD).view(3, 1, 1)
    for x, y, skipped in epoch1:
        assert x.dtype == torch.float32 and skipped == 0
        for img, label in zip(x, y):
            j = [k for k in range(len(pool)) if torch.allclose(pool[k], img, atol=1e-5)]
            assert j and label == j[0] % ds.num_classes


def test_synthetic_validation_shards_cover_every_sample_once():
    seen = []
    for rank in range(3):
        ds, loader = _synthetic(n=23, rank=rank, world=3, train=False, batch=4)
        for x, y, _ in loader:
            assert x.shape[0] == y.shape[0] <= 4
            seen += y.tolist()
    assert len(seen) == 23  # every sample once: 8 + 8 + 7, no padding
    assert sorted(seen) == sorted((i % 8) % 5 for i in range(23))


def test_imagenet_randaugment_runs_at_its_strongest_posterize():
    """The official recipe's RandAugment (increasing ops, magnitude noise) reaches level 10, where timm keeps
    0 bits in posterize: a black image, which Pillow 12 refuses (requirements.txt pins Pillow below 12)."""
    from PIL import Image
    from timm.data.auto_augment import AugmentOp
    image = Image.fromarray(torch.randint(0, 256, (16, 16, 3), dtype=torch.uint8).numpy())
    out = AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=10)(image)
    assert torch.from_numpy(np.asarray(out)).max() == 0
    keep_two = AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=5)(image)  # 4 - int(5 / 10 * 4) = 2 bits
    assert (torch.from_numpy(np.asarray(keep_two)) % 64 == 0).all()


def test_data_wait_fraction_shows_a_slow_loader(tmp_path, monkeypatch):
    fast = train_inprocess(tmp_path / "fast", *DET, "train.epochs=1")
    real_getitem = TensorImageDataset.__getitem__

    def slow_getitem(self, i):
        time.sleep(0.04)  # 32 images: ~1.3 s per batch, several times the model's step even on a loaded CPU
        # (0.01 s gave a fraction of only ~0.36 with two other test runs on the same 2 cores)
        return real_getitem(self, i)

    monkeypatch.setattr(TensorImageDataset, "__getitem__", slow_getitem)
    slow = train_inprocess(tmp_path / "slow", *DET, "train.epochs=1")
    assert slow["data_wait_fraction"] > 0.6 > 0.4 > fast["data_wait_fraction"] >= 0.0
    assert slow["history"][0]["data_wait_fraction"] == slow["data_wait_fraction"]
    assert "of the time waiting for data" in (tmp_path / "slow" / "train.log").read_text()


def test_corrupt_images_skipped_with_the_prefetching_loader(tmp_path):
    """The unreadable-image count still reaches the summary through the one-batch-ahead loader (2 workers)."""
    image_folder(tmp_path / "data", corrupt=True)
    summary = train_inprocess(tmp_path / "run", *DET[:-1], "data=imagefolder", f"data.root={tmp_path / 'data'}",
                              "data.skip_corrupt=true", "data.num_workers=2", "train.batch_size=4",
                              "train.epochs=1", "data.train_limit=null")
    assert summary["skipped_images"] == 2


@pytest.mark.gpu
def test_gpu_device_loader_batches_survive_allocator_reuse():
    """CUDA path: copies and normalisation on a side stream, consumed on the default stream while slow work
    still reads earlier batches and frees them; every batch arrives intact (checksums on the device, read at
    the end, so nothing here synchronises the streams by accident)."""
    batches = [(torch.randint(0, 256, (64, 3, 64, 64), dtype=torch.uint8).pin_memory(), torch.arange(64), 0)
               for _ in range(12)]
    norm = _Normalize(torch.device("cuda"), IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)
    loader = DeviceLoader(_Batches(batches), torch.device("cuda"), norm)
    w = torch.randn(4096, 4096, device="cuda")
    sums = []
    for x, y, _ in loader:
        busy = w
        for _ in range(20):  # keep the default stream busy so that the next copy overlaps it
            busy = busy @ w / 64
        sums.append(x.double().sum() + 0 * busy.sum().double())
        del x, y, busy
    cpu_norm = _Normalize(torch.device("cpu"), IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)
    want = [cpu_norm(b[0]).double().sum() for b in batches]
    got = torch.stack(sums).cpu()
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-6, atol=1e-3)


def test_make_imagefolder_writes_an_imagenet_shaped_folder(tmp_path):
    """scripts/make_imagefolder.py: class folders in train/ and val/, JPEG files of ImageNet-like sizes
    (mostly ~500 on the long side, both orientations) and weight, readable by the training datasets."""
    import subprocess
    import sys

    from _train_utils import REPO
    from PIL import Image
    r = subprocess.run([sys.executable, "scripts/make_imagefolder.py", str(tmp_path / "d"), "--classes", "3",
                        "--train-per-class", "8", "--val-per-class", "2", "--workers", "2", "--seed", "1"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    train = sorted((tmp_path / "d" / "train").glob("*/*.JPEG"))
    val = sorted((tmp_path / "d" / "val").glob("*/*.JPEG"))
    assert len(train) == 24 and len(val) == 6 and len({p.parent.name for p in train}) == 3
    sizes = [Image.open(p).size for p in train + val]
    assert all(Image.open(p).format == "JPEG" for p in train[:3])
    assert all(230 <= min(s) and max(s) <= 660 for s in sizes) and len(set(sizes)) > 10
    assert any(w > h for w, h in sizes) and any(h > w for w, h in sizes)
    mean_kb = sum(p.stat().st_size for p in train + val) / len(train + val) / 1e3
    assert 60 < mean_kb < 160, mean_kb  # ImageNet's mean is ~110 KB; pure noise or flat colour would miss this
    ds = build_datasets(_folder_cfg(tmp_path / "d"), 16)
    assert ds.num_classes == 3 and ds.train[0][0].dtype == torch.uint8


def test_loader_workers_default_to_the_process_share_of_the_cores(monkeypatch, tmp_path):
    """data.num_workers=null: the cores this process may use less one (under torchrun the affinity divided among
    the host's processes, a SLURM task's own cores, else the affinity), at most 8 decoding on the GPU and 32 on the
    CPU; a number is taken as given."""
    from swin.data.loaders import CPU_DECODE_WORKERS, GPU_DECODE_WORKERS, worker_count

    def data(*overrides):
        return to_settings(make_cfg("data=imagenet", f"data.root={tmp_path}", *overrides)).data

    cores = int(np.random.randint(40, 200))
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    for key in ("SLURM_CPUS_PER_TASK", "TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert data().num_workers is None
    assert worker_count(data()) == min(cores - 1, CPU_DECODE_WORKERS)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # torchrun, 8 processes on this host
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert worker_count(data()) == cores // 8 - 1
    assert worker_count(data("data.decode=gpu")) == min(cores // 8 - 1, GPU_DECODE_WORKERS)
    # workers that only read files (a thread decodes on the GPU) are not held to the GPU decoders' cap
    assert worker_count(data("data.decode=gpu", "data.gpu_decode_thread=true")) == cores // 8 - 1
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", str(cores))  # torchrun inside one SLURM task: still shared
    assert worker_count(data()) == cores // 8 - 1
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "3")  # a task srun started, with its own 3 cores
    assert worker_count(data()) == 2
    monkeypatch.delenv("SLURM_CPUS_PER_TASK")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    assert worker_count(data()) == 0  # one core: the training process loads
    assert worker_count(data("data.num_workers=5")) == 5
