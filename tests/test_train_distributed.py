"""torchrun on the CPU (gloo, loopback): 2 processes, and 2 nodes x 1 process, give the same result
as one process with the same global batch; so does a 2-task job of Hydra's submitit launcher (started as SLURM
starts tasks, without torchrun), which also survives the cluster's stop signal: save, requeue, resume."""
import json
import os
import re
import signal
import subprocess
import time

import pytest
import torch
from _train_utils import (
    DET,
    REPO,
    child_pids,
    cli_env,
    free_port,
    make_cfg,
    model_weights,
    submitit_local_cmd,
    torchrun_cmd,
    train_inprocess,
)

ARGS = [*DET, "data.train_limit=128", "data.val_limit=64"]  # 4 updates/epoch of global batch 32
LR = make_cfg(*ARGS).train.lr  # the largest change one AdamW step makes to a weight is about LR


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    run = tmp_path_factory.mktemp("single")
    return run, train_inprocess(run, *ARGS)


def _check_same_as_single(run, single_process):
    ref_dir, ref = single_process
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_step"] == ref["global_step"]
    for a, b in zip(summary["history"], ref["history"]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)
        assert a["top1"] == pytest.approx(b["top1"], abs=1e-6)  # same images, same predictions
    got, want = model_weights(run / "checkpoints/last.pt"), model_weights(ref_dir / "checkpoints/last.pt")
    # Two half-batch gradients summed by gloo round differently from one full-batch gradient (last fp32
    # bits). AdamW divides by sqrt(v), so where a gradient is near zero that rounding can become a visible
    # part of one step (seen: 2.2e-5 on one of 135k weights). Every weight stays within 1/40 of a step, and
    # all but a handful agree to rounding (seen: 99.9th percentile 3e-7).
    diffs = []
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=LR / 40, msg=lambda m, k=k: f"{k}: {m}")
        diffs.append((got[k].double() - want[k].double()).abs().flatten())
    assert torch.cat(diffs).quantile(0.999).item() < 2e-6


def test_two_processes_equal_one(tmp_path, single_process):
    run = tmp_path / "run"
    r = subprocess.run(torchrun_cmd(*ARGS, f"hydra.run.dir={run}", nproc=2, port=free_port()), cwd=REPO,
                       env=cli_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    _check_same_as_single(run, single_process)


def test_two_nodes_equal_one(tmp_path, single_process):
    run, port = tmp_path / "run", free_port()
    nodes = [subprocess.Popen(torchrun_cmd(*ARGS, f"hydra.run.dir={run}", nproc=1, nnodes=2, node_rank=i, port=port),
                              cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in nodes]
    assert all(p.returncode == 0 for p in nodes), "\n".join(o[-3000:] for o in outs)
    _check_same_as_single(run, single_process)


def _submitit_logs(sweep_dir, tail: int | None = 2000):
    """The job's task logs (submitit's and ours), each to its last `tail` characters."""
    texts = [(p.name, p.read_text()) for p in sorted(sweep_dir.glob(".submitit/*/*_log.*"))]
    return "\n".join(f"--- {name}\n{text[-tail:] if tail else text}" for name, text in texts)


def test_submitit_job_of_two_tasks_equals_one(tmp_path, single_process):
    """Rank, world size and the rendezvous come from the submitit job (no torchrun): one DDP run."""
    r = subprocess.run(submitit_local_cmd(*ARGS, f"hydra.sweep.dir={tmp_path}", tasks=2), cwd=tmp_path,
                       env=cli_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:] + _submitit_logs(tmp_path)
    _check_same_as_single(tmp_path / "0", single_process)


def test_submitit_job_signalled_mid_run_saves_requeues_and_finishes(tmp_path):
    """SIGUSR2 (SLURM's warning before the time limit, or preemption) to the tasks of a running 2-task job:
    last.pt at the next check point, submitit requeues the job (the local executor restarts its tasks), and the
    requeued job resumes from it in the same run directory (the default multirun/<date>/<time>/0) to the end."""
    epochs, steps = 8, 4
    launcher = subprocess.Popen(submitit_local_cmd(*ARGS, f"train.epochs={epochs}", tasks=2), cwd=tmp_path,
                                env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    signalled, deadline = [], time.time() + 240
    while launcher.poll() is None and time.time() < deadline and not signalled:
        lasts = list(tmp_path.glob("multirun/*/*/0/checkpoints/last.pt"))
        if lasts and torch.load(lasts[0], weights_only=True)["epoch"] >= 1:  # epoch 2 has begun
            job = next(d for d in lasts[0].parents[2].glob(".submitit/*") if d.name.isdigit())  # the controller
            signalled = child_pids(int(job.name))  # the job's tasks
            for pid in signalled:
                os.kill(pid, signal.SIGUSR2)
        time.sleep(0.02)
    out = launcher.communicate(timeout=300)[0]
    sweeps = list(tmp_path.glob("multirun/*/*"))
    assert len(signalled) == 2, out[-3000:]
    assert launcher.returncode == 0, out[-3000:] + _submitit_logs(sweeps[0])
    assert len(sweeps) == 1 and len(list(sweeps[0].glob("[0-9]*"))) == 1  # the requeued job kept its directory
    run = sweeps[0] / "0"
    log = (run / "train.log").read_text()
    saved = re.search(r"SIGUSR2 received .*after (\d+) epoch\(s\) \+ (\d+) step\(s\)", log)
    resumed = re.search(r"resumed from .*last\.pt: (\d+) epoch\(s\) \+ (\d+) step\(s\) done", log)
    assert saved and resumed and saved.groups() == resumed.groups(), log
    done_steps = int(saved[1]) * steps + int(saved[2])
    assert steps <= done_steps < epochs * steps  # stopped in the middle of the run
    assert "Requeued job" in _submitit_logs(sweeps[0], tail=None)  # submitit's own requeue
    summary = json.loads((run / "summary.json").read_text())
    assert [h["epoch"] for h in summary["history"]] == list(range(1, epochs + 1))
    assert summary["global_step"] == epochs * steps and summary["world_size"] == 2
    assert torch.load(run / "checkpoints/last.pt", weights_only=True)["epoch"] == epochs
