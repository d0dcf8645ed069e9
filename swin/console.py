"""The one log format of train.py and eval.py: ``[time] message`` on the console, above any progress bar, and in
the run's log file, for every ``swin.*`` logger (training, evaluation, weight loading, loaders)."""
from __future__ import annotations

import logging
from pathlib import Path

from tqdm import tqdm

LOGGER = logging.getLogger("swin")
FORMAT = logging.Formatter("[%(asctime)s] %(message)s", "%Y-%m-%d %H:%M:%S")


class _TqdmHandler(logging.StreamHandler):
    """Console log lines that do not break the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record))


def attach_logging(log_file: Path | None, is_main: bool) -> list[logging.Handler]:
    """Console (and log_file's) handlers on the swin logger: INFO on the main process, warnings elsewhere. Returns
    them for :func:`detach_logging`."""
    LOGGER.setLevel(logging.INFO if is_main else logging.WARNING)
    LOGGER.propagate = False  # Hydra's own handlers (if any) do not repeat the lines in another format
    handlers: list[logging.Handler] = [_TqdmHandler()]
    if log_file is not None:
        handlers.append(logging.FileHandler(log_file))
    for h in handlers:
        h.setFormatter(FORMAT)
        LOGGER.addHandler(h)
    return handlers


def detach_logging(handlers: list[logging.Handler]) -> None:
    for h in handlers:
        LOGGER.removeHandler(h)
        h.close()
