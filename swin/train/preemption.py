"""Stopping on the cluster's warning signal: before the time limit (sbatch --signal, submitit's
signal_delay_s) or at preemption, SLURM sends SIGUSR2 (submitit's choice; SUBMITIT_PREEMPT_SIGNAL=USR1
changes it, as for submitit). The handler only sets a flag; the training loop reads it at its next check
point, where all processes agree on it (one process may get the signal before another), write last.pt
with the ordinary checkpoint code, and hand over:

- in a submitit job (Hydra's submitit launcher), to submitit's own handler, which was installed before
  ours: on rank 0 it calls the launcher's ``checkpoint()`` (the same Hydra job, same overrides, same run
  directory) and requeues the job (``scontrol requeue``, or a restart of the tasks by the local executor);
- in an srun task without submitit: rank 0 runs ``scontrol requeue $SLURM_JOB_ID``;
- anywhere else: the process exits; the same command continues from last.pt.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from typing import Any

import torch

from swin.train.distributed import all_reduce_sum, barrier

log = logging.getLogger("swin.train")


class Preempted(Exception):
    """The run stopped on the cluster's signal after saving last.pt; rerunning it resumes."""


class Interrupted(Exception):
    """The run stopped on Ctrl-C (SIGINT) after saving last.pt where it had updates to save; rerunning resumes."""


def preempt_signal() -> signal.Signals:
    """The signal SLURM sends before the time limit: submitit's (SIGUSR2 unless SUBMITIT_PREEMPT_SIGNAL says)."""
    name = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    return signal.Signals["SIG" + name]


class PreemptionFlag:
    """Set by the cluster's signal (``received``) or by Ctrl-C (``interrupted``); `agreed()` asks all processes
    (a collective: every rank calls it at the same point). A second Ctrl-C interrupts at once (KeyboardInterrupt)."""

    def __init__(self) -> None:
        self.signum = preempt_signal()
        self.received = False
        self.interrupted = False
        self._previous: Any = None
        self._previous_int: Any = None
        self._installed = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only: nothing to catch here
        self._previous = signal.signal(self.signum, self._on_signal)
        self._previous_int = signal.signal(signal.SIGINT, self._on_interrupt)
        self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            signal.signal(self.signum, self._previous)
            signal.signal(signal.SIGINT, self._previous_int)
            self._installed = False

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.received = True  # acted upon at the loop's next sync point, never inside a step

    def _on_interrupt(self, signum: int, frame: Any) -> None:
        self.interrupted = True  # acted upon after the update in flight; a second Ctrl-C raises at once
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def agreed(self, device: torch.device) -> bool:
        """True on every process when any process got the signal or Ctrl-C."""
        flag = torch.tensor([1.0 if self.received or self.interrupted else 0.0], device=device)
        return bool(all_reduce_sum(flag).item() > 0)

    def requeue(self, is_main: bool) -> None:
        """After last.pt is written: rank 0 requeues the job (or says how to resume); all ranks wait for it,
        so that no task ends the job before the requeue is registered. Re-raises what submitit's handler
        raised (its SystemExit ends the process the way submitit expects)."""
        raised: BaseException | None = None
        if is_main:
            try:
                self._requeue_job()
            except BaseException as e:  # submitit exits (SystemExit) or gives up (UncompletedJobError)
                raised = e
        barrier()
        if raised is not None:
            raise raised

    def _requeue_job(self) -> None:
        if callable(self._previous):  # submitit's handler: checkpoint() of the launcher, then requeue
            log.info("handing over to submitit: requeueing the job")
            self._previous(self.signum, None)
        elif os.environ.get("SLURM_JOB_ID"):
            job = os.environ["SLURM_JOB_ID"]
            subprocess.run(["scontrol", "requeue", job], check=True, timeout=60)
            log.info(f"requeued SLURM job {job}: it continues from last.pt")
        else:
            log.info("not a SLURM job: rerun the same command to continue from last.pt")
