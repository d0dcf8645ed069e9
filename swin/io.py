"""Atomic file writes: a reader, or a crash at any moment, sees the previous complete file or the new one.

The one writer every output of the package goes through (checkpoints, summary.json, evaluation results).
"""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> Path:
    """Call ``write(f)`` on a temporary file beside ``path``, fsync it, then rename it over ``path``.

    The temporary file is named ``.<name>.<random>.tmp`` in the same directory (a rename is atomic within one
    file system only) and is removed if ``write`` raises; :func:`remove_stale_temporaries` clears the ones a
    killed process left.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass
    return path


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """``data`` as indented JSON at ``path``, atomically (values JSON cannot hold are written as strings)."""
    text = json.dumps(data, indent=2, default=str) + "\n"
    return atomic_write(path, lambda f: f.write(text.encode()))


def remove_stale_temporaries(directory: str | os.PathLike) -> int:
    """Delete the temporary files of writes killed before their rename; returns how many."""
    n = 0
    for tmp in Path(directory).glob(".*.tmp"):
        tmp.unlink(missing_ok=True)
        n += 1
    return n
