"""What a training run reports: train.log and the console (above the progress bar), wandb when enabled, and
summary.json at the end (rank 0)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from swin.config import ConfigError, TrainAppConfig, to_dict
from swin.io import write_json
from swin.train.state import Run

log = logging.getLogger("swin.train")


def init_wandb(cfg: TrainAppConfig, run_dir: Path, run_id: str | None) -> Any:
    """wandb run (rank 0), or None; wandb is imported only here, only when enabled."""
    wcfg = cfg.logger.wandb
    if wcfg.mode == "disabled":
        return None
    try:
        import wandb
    except ImportError:
        if wcfg.mode == "online":
            raise ConfigError("logger.wandb.mode=online but wandb is not installed; pip install wandb "
                              "or set logger.wandb.mode=disabled") from None
        log.warning("wandb is not installed: offline logging is off (pip install wandb, or set "
                    "logger.wandb.mode=disabled to silence this)")
        return None
    offline = wcfg.mode == "offline"
    try:
        run = wandb.init(project=wcfg.project, entity=wcfg.entity, name=wcfg.name, tags=list(wcfg.tags),
                         mode=wcfg.mode, dir=str(run_dir), id=run_id, resume="allow", config=to_dict(cfg),
                         settings=wandb.Settings(silent=True) if offline else None)  # no banner nor footer
    except wandb.errors.Error as e:  # online without a login, or without a network to wandb's server
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"logger.wandb.mode={wcfg.mode}: wandb did not start ({reason}); run `wandb login`, or "
                          "log offline (logger.wandb.mode=offline, the default) and `wandb sync` the run later"
                          ) from None
    if offline:
        where = getattr(getattr(run, "settings", None), "sync_dir", None) or run_dir / "wandb"
        log.info(f"offline wandb run in {where}; upload it with `wandb sync {where}`")
    return run


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}%"


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def write_summary(run: Run, train_time: float) -> dict[str, Any]:
    """summary.json (rank 0): last-epoch (steady-state) throughput and data-wait fraction, and the history."""
    t, history = run.cfg.train, run.history
    last = history[-1] if history else {}
    rates = [r["images_per_sec"] for r in history if r.get("images_per_sec")]
    waits = [r["data_wait_fraction"] for r in history if r.get("data_wait_fraction") is not None]
    summary = {
        "model": run.cfg.model.name, "data": run.cfg.data.name, "params": run.n_params,
        "world_size": run.dist.world_size, "epochs": len(history), "global_step": run.global_step,
        "best_top1": run.best_top1 if run.best_top1 >= 0 else None,
        "best_epoch": run.best_epoch if run.best_epoch > 0 else None,
        "final_top1": last.get("top1"), "final_top5": last.get("top5"), "final_train_loss": last.get("train_loss"),
        "images_per_sec": rates[-1] if rates else None,  # last epoch's, after its first update
        # the last epoch's second half: past the ramp that follows compilation (scaling measurements)
        "images_per_sec_steady": last.get("images_per_sec_steady"),
        "images_per_sec_mean": _mean(rates),
        # time blocked in next(loader) / wall time (rank 0, last epoch): near 0 when the model is the limit
        "data_wait_fraction": last.get("data_wait_fraction"),
        "data_wait_fraction_mean": _mean(waits),
        "train_time_sec_this_run": train_time,
        "nonfinite_steps": run.nonfinite_total, "skipped_images": run.skipped_total,
        # data.decode=gpu: images nvJPEG could not decode, decoded on the CPU instead (all epochs)
        "cpu_decoded_images": sum(r.get("cpu_decoded_images", 0) for r in history),
        "amp": run.amp, "ema": bool(t.ema), "compile": run.compile_mode or False, "history": history,
    }
    if run.dist.is_main:
        write_json(run.run_dir / "summary.json", summary)
        wait = summary["data_wait_fraction"]
        log.info(f"done: best top1 {_pct(summary['best_top1'])}, final top1 {_pct(summary['final_top1'])}, "
                 f"{summary['images_per_sec'] or 0:.0f} img/s"
                 + (f" ({steady:.0f} steady)" if (steady := summary["images_per_sec_steady"]) else "")
                 + (f", {wait:.1%} waiting for data" if wait is not None else "")
                 + f"; {run.run_dir / 'summary.json'}")
        if run.wandb_run is not None:
            run.wandb_run.summary.update({k: v for k, v in summary.items() if k != "history"})
            run.wandb_run.finish()
    return summary
