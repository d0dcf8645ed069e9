"""Input pipeline throughput: CPU decoding in loader workers against nvJPEG decoding on the GPU (data.decode=gpu),
and CPU decoding with augmentation on the GPU (data.augment=gpu).

``python scripts/bench_data.py`` (Hydra, configs/bench_data.yaml; every key can be overridden) runs, in order:

1. a JPEG folder: ``root=PATH``, or else ``scripts/make_imagefolder.py`` writes one into ``generate.dir``
   (ImageNet-like sizes, quality 90, ~100 KB per file; reused when it already holds the expected file count);
   its mean file size and image size are reported;
2. loader rows: the training loader alone, as train.py builds it (``swin.data.build_loaders`` with the data
   config, the recipe's augmentation, batches normalised and randomly erased on the device), for
   ``data.decode=cpu`` with ``loader.cpu_workers`` workers, for ``data.decode=gpu`` (``loader.gpu_workers``, and
   ``loader.gpu_thread_workers`` with a decoding thread) and for ``data.augment=gpu`` (``loader.gpu_augment_workers``
   decoding on the CPU): after
   ``loader.warmup_batches`` batches, images per second over ``loader.seconds``, the device synchronised at both
   ends of the timed window;
3. train rows: ``train.py`` end to end (``train.args``: the ImageNet recipe, compiled) on ``data=synthetic`` (the
   same recipe, batches made on the device: the model's speed), with ``data.decode=cpu`` and with
   ``data.decode=gpu``; images/s and the data-wait fraction of the last epoch from summary.json, and the ratio to
   the synthetic run;
4. eval rows (right after the data.decode=gpu train row): ``eval.py`` on that run's checkpoint with each decode
   path (top-1, top-5, loss): the two must agree (same resize and crop; only JPEG decoding differs).

Rows not started within ``time_budget_s`` are skipped; bench_data.json and bench_data.md (a table) are rewritten
after every row. Examples:

    python scripts/bench_data.py out_dir=$OUT/data                       # everything (several minutes)
    python scripts/bench_data.py root=/data/imagenet train.rows=[gpu] eval.enabled=false
    python scripts/bench_data.py loader.cpu_workers=[1,8] train.rows=[] eval.enabled=false   # loaders only
"""
from __future__ import annotations

import gc
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hydra  # noqa: E402
from hydra.core.config_store import ConfigStore  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import MISSING, DictConfig, OmegaConf  # noqa: E402

import swin.config  # noqa: E402, F401  (registers the config schemas before Hydra composes)
from swin.config import DataConfig, ImageFolderDataConfig, ModelConfig, to_settings  # noqa: E402
from swin.data.datasets import build_datasets  # noqa: E402
from swin.data.gpu.decode import jpeg_frame  # noqa: E402
from swin.data.loaders import build_loaders  # noqa: E402
from swin.train.distributed import pick_device  # noqa: E402


# --- the config schema of configs/bench_data.yaml (Hydra structured config; the YAML keeps the values) ---
@dataclass
class GenerateConfig:
    dir: str = MISSING
    classes: int = MISSING
    train_per_class: int = MISSING
    val_per_class: int = MISSING
    quality: int = MISSING


@dataclass
class LoaderBenchConfig:
    enabled: bool = MISSING
    cpu_workers: list[Any] = MISSING  # worker counts: ints, all or all-1
    gpu_workers: Any = MISSING
    gpu_thread_workers: Any = MISSING  # data.gpu_decode_thread=true rows: file-reading workers
    gpu_augment_workers: Any = MISSING  # data.augment=gpu rows: workers decoding on the CPU
    warmup_batches: int = MISSING
    seconds: float = MISSING
    min_batches: int = MISSING  # timed batches at least, whatever `seconds` says


@dataclass
class TrainBenchConfig:
    rows: list[str] = MISSING
    cpu_workers: Any = MISSING
    gpu_workers: Any = MISSING
    gpu_augment_workers: Any = MISSING
    epochs: int = MISSING
    compile: bool = MISSING
    args: list[str] = MISSING
    timeout_s: float = MISSING


@dataclass
class EvalBenchConfig:
    enabled: bool = MISSING
    workers: Any = MISSING


@dataclass
class BenchDataAppConfig:
    """configs/bench_data.yaml (scripts/bench_data.py)."""

    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    device: str = MISSING
    root: str | None = MISSING
    out_dir: str | None = MISSING
    runs_dir: str | None = MISSING
    batch_size: int = MISSING
    seed: int = MISSING
    time_budget_s: float = MISSING
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    loader: LoaderBenchConfig = field(default_factory=LoaderBenchConfig)
    train: TrainBenchConfig = field(default_factory=TrainBenchConfig)
    eval: EvalBenchConfig = field(default_factory=EvalBenchConfig)


ConfigStore.instance().store(group="schema", name="bench_data", node=BenchDataAppConfig)

# the data keys of each kind of loader / train row
DECODE_KINDS = {
    "cpu": {"decode": "cpu", "augment": None, "gpu_decode_thread": False},
    "gpu": {"decode": "gpu", "augment": None, "gpu_decode_thread": False},
    "gpu_thread": {"decode": "gpu", "augment": None, "gpu_decode_thread": True},
    "gpu_augment": {"decode": "cpu", "augment": "gpu", "gpu_decode_thread": False},
}
LABELS = {"cpu": "data.decode=cpu", "gpu": "data.decode=gpu",
          "gpu_thread": "data.decode=gpu data.gpu_decode_thread=true (workers read files)",
          "gpu_augment": "data.decode=cpu data.augment=gpu (workers decode, a thread augments)"}


def workers(spec: Any) -> int:
    """A worker count: an int, 'all' (every core) or 'all-N' (every core but N, at least 1)."""
    cores = os.cpu_count() or 1
    if spec == "all":
        return cores
    if isinstance(spec, str) and spec.startswith("all-"):
        return max(1, cores - int(spec[4:]))
    return int(spec)


def folder(cfg: DictConfig) -> Path:
    """The JPEG folder to read: ``root``, or one generated by scripts/make_imagefolder.py."""
    if cfg.root:
        return Path(cfg.root).expanduser()
    g = cfg.generate
    out = Path(g.dir)
    expected = g.classes * (g.train_per_class + g.val_per_class)
    if len(list(out.glob("*/*/*.JPEG"))) == expected:
        print(f"reusing {out} ({expected} files)", flush=True)
        return out
    subprocess.run([sys.executable, str(ROOT / "scripts/make_imagefolder.py"), str(out), "--classes", str(g.classes),
                    "--train-per-class", str(g.train_per_class), "--val-per-class", str(g.val_per_class),
                    "--quality", str(g.quality), "--seed", str(cfg.seed)], check=True)
    return out


def runs_dir(cfg: DictConfig, out_dir: Path) -> Path:
    return Path(cfg.runs_dir) if cfg.runs_dir else out_dir / "runs"


def folder_stats(root: Path, sample: int = 400) -> dict[str, Any]:
    """Mean file size and image size of (a sample of) the training files, from their JPEG headers."""
    files = sorted((root / "train").glob("*/*"))
    step = max(1, len(files) // sample)
    picked = files[::step][:sample]
    sizes, frames = [], []
    for f in picked:
        data = f.read_bytes()
        sizes.append(len(data))
        frame = jpeg_frame(data)
        if frame is not None:
            frames.append(frame[2:4])
    return {"train_files": len(files), "mean_kb": _mean(sizes) / 1e3,
            "mean_height": _mean([h for h, _ in frames]), "mean_width": _mean([w for _, w in frames])}


def _mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


def data_config(cfg: DictConfig, root: Path, decode: str, num_workers: int) -> ImageFolderDataConfig:
    """The recipe's data section on ``root`` with the data keys of row kind ``decode`` (DECODE_KINDS)."""
    return to_settings(OmegaConf.merge(cfg.data, {"root": str(root), "num_workers": num_workers,
                                                  **DECODE_KINDS[decode]}))


def loader_row(cfg: DictConfig, root: Path, device: torch.device, decode: str, num_workers: int) -> dict[str, Any]:
    """Images/s of the training loader alone: batches ready (normalised, erased) on the device."""
    data = data_config(cfg, root, decode, num_workers)
    ds = build_datasets(data, cfg.model.img_size)
    train, _ = build_loaders(ds, data, device, 0, 1, cfg.batch_size, cfg.batch_size, cfg.seed)
    train.set_epoch(0)
    batches = iter(train)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    try:
        t_start = time.perf_counter()
        for _ in range(cfg.loader.warmup_batches):
            next(batches)
        sync()
        t0, images, count = time.perf_counter(), 0, 0
        while count < cfg.loader.min_batches or time.perf_counter() - t0 < cfg.loader.seconds:
            try:
                x, _, _ = next(batches)
            except StopIteration:  # a short folder: start another epoch
                train.set_epoch(count + 1)
                batches = iter(train)
                continue
            images += x.shape[0]
            count += 1
            del x
        sync()
        elapsed = time.perf_counter() - t0
    finally:
        del batches
    row = {"kind": "loader", "decode": decode, "workers": num_workers, "images": images, "batches": count,
           "seconds": elapsed, "img_s": images / elapsed, "startup_s": t0 - t_start,
           "cpu_decoded": getattr(train, "cpu_decoded", 0)}
    del train, ds
    gc.collect()
    return row


def train_args(cfg: DictConfig, root: Path, run_dir: Path, name: str) -> list[str]:
    """train.py's arguments for the train row `name` (a DECODE_KINDS key or "synthetic"), the worker count last for
    folder rows. The synthetic row's recipe is composed by train.py itself (synthetic_recipe)."""
    t = cfg.train
    args = [*t.args, f"model={cfg.model.name}", f"train.batch_size={cfg.batch_size}", f"train.epochs={t.epochs}",
            f"train.compile={str(bool(t.compile)).lower()}", f"seed={cfg.seed}", f"device={cfg.device}",
            f"hydra.run.dir={run_dir}"]
    if name == "synthetic":  # as many steps per epoch and classes as the folder
        n = len(list((root / "train").glob("*/*")))
        classes = len([d for d in (root / "train").iterdir() if d.is_dir()])
        args = synthetic_recipe(args, run_dir) + [
            "data=synthetic", f"data.train_samples={n}", f"data.val_samples={max(cfg.batch_size, 64)}",
            f"data.num_classes={classes}"]
    else:  # the data keys of the row's kind, then the worker count
        keys = DECODE_KINDS[name]
        count = {"cpu": t.cpu_workers, "gpu_augment": t.gpu_augment_workers}.get(name, t.gpu_workers)
        args += [f"data.root={root}", f"data.decode={keys['decode']}", f"data.augment={keys['augment'] or 'null'}",
                 f"data.gpu_decode_thread={str(keys['gpu_decode_thread']).lower()}",
                 f"data.num_workers={workers(count)}"]
    return args


def train_row(cfg: DictConfig, root: Path, out_dir: Path, name: str, timeout: float) -> dict[str, Any]:
    """train.py end to end (subprocess); the last epoch's img/s and data-wait fraction from summary.json."""
    run_dir = runs_dir(cfg, out_dir) / f"train_{name}"
    args = train_args(cfg, root, run_dir, name)
    row = {"kind": "train", "name": name, "workers": None if name == "synthetic" else int(args[-1].split("=")[1]),
           "args": args, "run_dir": str(run_dir)}
    row.update(_run([sys.executable, str(ROOT / "train.py"), *args], timeout))
    summary = run_dir / "summary.json"
    if row["returncode"] == 0 and summary.is_file():
        s = json.loads(summary.read_text())
        row.update(img_s=s.get("images_per_sec"), data_wait=s.get("data_wait_fraction"),
                   img_s_per_epoch=[h.get("images_per_sec") for h in s.get("history", [])],
                   cpu_decoded=s.get("cpu_decoded_images"), checkpoint=str(run_dir / "checkpoints" / "last.pt"))
    return row


def synthetic_recipe(args: list[str], run_dir: Path) -> list[str]:
    """``args`` for a data=synthetic run with the same model and training recipe. An experiment such as
    imagenet_swin_tiny also sets the folder dataset's augmentation keys, which data=synthetic does not have (the
    composition fails), so its model and train sections, as train.py composes them (``--cfg job``), become an
    experiment file of their own (in ``run_dir``'s parent, found through hydra.searchpath)."""
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, "--cfg", "job"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    if proc.returncode:
        raise RuntimeError(f"composing the synthetic row's recipe failed: {(proc.stderr or proc.stdout)[-800:]}")
    composed = OmegaConf.create(proc.stdout)
    search = run_dir.parent / f"{run_dir.name}_configs"
    (search / "experiment").mkdir(parents=True, exist_ok=True)
    body = OmegaConf.create({"defaults": [{"override /model": composed.model.name}], "model": composed.model,
                             "train": composed.train})
    (search / "experiment" / "bench_synthetic.yaml").write_text("# @package _global_\n" + OmegaConf.to_yaml(body))
    kept = [a for a in args if not a.startswith(("experiment=", "model=", "train.", "+train."))]
    return [*kept, f"hydra.searchpath=['file://{search.resolve()}']", "experiment=bench_synthetic"]


def eval_row(cfg: DictConfig, root: Path, out_dir: Path, checkpoint: str, decode: str,
             timeout: float) -> dict[str, Any]:
    out = runs_dir(cfg, out_dir) / f"eval_{decode}.json"
    args = [f"checkpoint={checkpoint}", "data=imagenet", f"data.root={root}", f"data.decode={decode}",
            f"data.num_workers={workers(cfg.eval.workers)}", f"batch_size={cfg.batch_size}", "progress=false",
            f"device={cfg.device}", f"output={out}", f"hydra.run.dir={out.with_suffix('')}"]
    row = {"kind": "eval", "decode": decode, "args": args}
    row.update(_run([sys.executable, str(ROOT / "eval.py"), *args], timeout))
    if row["returncode"] == 0 and out.is_file():
        r = json.loads(out.read_text())
        row.update({k: r.get(k) for k in ("top1", "top5", "loss", "num_images", "images_per_sec",
                                          "cpu_decoded_images")})
    return row


def _run(cmd: list[str], timeout: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"returncode": None, "error": f"timed out after {timeout:.0f} s", "wall_s": time.perf_counter() - t0}
    result: dict[str, Any] = {"returncode": proc.returncode, "wall_s": time.perf_counter() - t0}
    if proc.returncode:
        result["error"] = (proc.stderr or proc.stdout).strip()[-1500:]
    return result


def _fmt(v: Any, spec: str = ",.0f") -> str:
    return "-" if v is None else format(v, spec)


def table(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = ["| row | img/s | data-wait | x synthetic | notes |", "|---|---|---|---|---|"]
    synthetic = next((r.get("img_s") for r in rows if r.get("name") == "synthetic"), None)
    for r in rows:
        if "skipped" in r or r.get("error"):
            label = r.get("label", r["kind"])
            lines.append(f"| {label} | - | - | - | {r.get('skipped') or r.get('error', '')[-200:]!r} |")
            continue
        if r["kind"] == "loader":
            note = f"{r['batches']} batches in {r['seconds']:.1f} s, start-up {r['startup_s']:.1f} s"
            if r["decode"] != "cpu":
                note += f", {r['cpu_decoded']} decoded on the CPU"
            lines.append(f"| loader only, {LABELS[r['decode']]}, num_workers={r['workers']} | {_fmt(r['img_s'])} "
                         f"| - | - | {note} |")
        elif r["kind"] == "train":
            ratio = f"{r['img_s'] / synthetic:.2f}" if synthetic and r.get("img_s") else "-"
            label = ("train.py data=synthetic (same recipe)" if r["name"] == "synthetic" else
                     f"train.py {LABELS[r['name']]}, num_workers={r['workers']}")
            per_epoch = ", ".join(_fmt(v) for v in r.get("img_s_per_epoch", []))
            lines.append(f"| {label} | {_fmt(r.get('img_s'))} | {_fmt(r.get('data_wait'), '.1%')} | {ratio} "
                         f"| per epoch: {per_epoch} |")
        else:
            lines.append(f"| eval.py data.decode={r['decode']} | {_fmt(r.get('images_per_sec'))} | - | - | top-1 "
                         f"{_fmt(r.get('top1'), '.2f')}%, top-5 {_fmt(r.get('top5'), '.2f')}%, loss "
                         f"{_fmt(r.get('loss'), '.4f')} over {r.get('num_images')} images |")
    evals = {r["decode"]: r for r in rows if r["kind"] == "eval" and r.get("top1") is not None}
    if len(evals) == 2:
        lines.append(f"\neval top-1 gpu - cpu: {evals['gpu']['top1'] - evals['cpu']['top1']:+.3f} points")
    return "\n".join(lines)


def environment(device: torch.device) -> dict[str, Any]:
    import timm
    import torchvision
    env = {"torch": torch.__version__, "torchvision": torchvision.__version__, "timm": timm.__version__,
           "python": platform.python_version(), "cpus": os.cpu_count(), "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def write(out_dir: Path, result: dict[str, Any]) -> str:
    text = table(result)
    head = (f"# Input pipeline on {result['env'].get('gpu', 'cpu')} ({result['env']['cpus']} CPUs): torch "
            f"{result['env']['torch']}, torchvision {result['env']['torchvision']}, timm {result['env']['timm']}\n\n"
            f"Folder {result['folder']['root']}: {result['folder']['train_files']} training files, "
            f"{result['folder']['mean_kb']:.0f} KB and {result['folder']['mean_width']:.0f}x"
            f"{result['folder']['mean_height']:.0f} on average; batch {result['batch_size']}, crop "
            f"{result['img_size']}, auto_augment {result['auto_augment']}, reprob {result['reprob']}\n\n")
    (out_dir / "bench_data.json").write_text(json.dumps(result, indent=2, default=str))
    (out_dir / "bench_data.md").write_text(head + text + "\n")
    return text


@hydra.main(version_base="1.3", config_path="../configs", config_name="bench_data")
def main(cfg: DictConfig) -> dict[str, Any]:
    started = time.perf_counter()
    device = pick_device(cfg.device)
    out_dir = Path(cfg.out_dir) if cfg.out_dir else Path(HydraConfig.get().runtime.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    root = folder(cfg)
    result: dict[str, Any] = {"env": environment(device), "folder": {"root": str(root), **folder_stats(root)},
                              "batch_size": cfg.batch_size, "img_size": cfg.model.img_size,
                              "auto_augment": cfg.data.auto_augment, "reprob": cfg.data.reprob,
                              "config": OmegaConf.to_container(cfg, resolve=True), "rows": []}
    print(f"folder {root}: {result['folder']}", flush=True)

    plan: list[tuple[str, Any]] = []
    if cfg.loader.enabled:
        plan += [("loader", ("cpu", workers(w))) for w in cfg.loader.cpu_workers]
        plan += [("loader", ("gpu", workers(w))) for w in cfg.loader.gpu_workers]
        plan += [("loader", ("gpu_thread", workers(w))) for w in cfg.loader.gpu_thread_workers]
        plan += [("loader", ("gpu_augment", workers(w))) for w in cfg.loader.gpu_augment_workers]
    for name in cfg.train.rows:  # the eval rows need the data.decode=gpu run's checkpoint: right after it
        plan += [("train", name)]
        if name == "gpu" and cfg.eval.enabled:
            plan += [("eval", "cpu"), ("eval", "gpu")]
    if cfg.eval.enabled and "gpu" not in cfg.train.rows:
        plan += [("eval", "cpu"), ("eval", "gpu")]  # skipped with a reason: no checkpoint
    for kind, what in plan:
        left = cfg.time_budget_s - (time.perf_counter() - started) if cfg.time_budget_s else None
        label = f"{kind} {what}"
        if left is not None and left <= 0:
            result["rows"].append({"kind": kind, "label": label, "skipped": "time budget spent"})
            print(f"{label}: skipped (time budget)", flush=True)
            continue
        timeout = min(cfg.train.timeout_s, left) if left is not None else cfg.train.timeout_s
        try:
            if kind == "loader":
                row = loader_row(cfg, root, device, *what)
            elif kind == "train":
                row = train_row(cfg, root, out_dir, what, timeout)
            else:
                ckpt = next((r.get("checkpoint") for r in result["rows"] if r.get("name") == "gpu"), None)
                row = (eval_row(cfg, root, out_dir, ckpt, what, timeout) if ckpt and Path(ckpt).is_file() else
                       {"kind": kind, "label": label, "skipped": "no data.decode=gpu checkpoint"})
        except Exception as e:  # keep the other rows
            row = {"kind": kind, "label": label, "error": f"{type(e).__name__}: {e}"}
        row.setdefault("label", label)
        result["rows"].append(row)
        shown = {k: v for k, v in row.items() if k in ("img_s", "data_wait", "top1", "cpu_decoded", "error",
                                                       "skipped", "wall_s")}
        print(f"{label}: {shown}", flush=True)
        write(out_dir, result)
    result["total_s"] = time.perf_counter() - started
    text = write(out_dir, result)
    print()
    print(text)
    print(f"\nwrote {out_dir / 'bench_data.json'} and bench_data.md ({result['total_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
