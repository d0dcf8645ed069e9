"""torchrun on the CPU (gloo, loopback): 2 processes, and 2 nodes x 1 process, give the same result
as one process with the same global batch; so does a 2-task job of Hydra's submitit launcher (started as SLURM
starts tasks, without torchrun), which also survives the cluster's stop signal: save, requeue, resume."""
import json
import os
import re
import signal
import subprocess
import sys
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


def _start_task(rank: int, port: int, args: list[str]) -> subprocess.Popen:
    """train.py as one task of a 2-task SLURM step (srun starts each task; no torchrun agent watches them)."""
    env = {**cli_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return subprocess.Popen([sys.executable, "train.py", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.slow
def test_a_killed_rank_stops_the_job_with_one_line_and_the_rerun_resumes(tmp_path):
    """kill -9 of rank 1 mid-run: rank 0 does not hang in a collective; it stops within a bounded time (gloo sees
    the closed connection; a hung peer would hit train.dist_timeout_s) with one line, no traceback. Rerunning the
    same command resumes both ranks from last.pt and finishes."""
    args = [*ARGS, "train.epochs=12", "train.save_every_steps=2", "train.dist_timeout_s=60",
            f"hydra.run.dir={tmp_path}"]
    port = free_port()
    tasks = [_start_task(rank, port, args) for rank in (0, 1)]
    try:
        deadline = time.time() + 180
        while not (tmp_path / "checkpoints" / "last.pt").exists():
            assert time.time() < deadline and all(t.poll() is None for t in tasks), "no last.pt before the kill"
            time.sleep(0.2)
        os.kill(tasks[1].pid, signal.SIGKILL)
        killed = time.time()
        _, err = tasks[0].communicate(timeout=150)
        assert time.time() - killed < 90, "rank 0 took longer than the collective timeout to stop"
    finally:
        for t in tasks:
            if t.poll() is None:
                os.killpg(t.pid, signal.SIGKILL)
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("[W")]
    assert tasks[0].returncode not in (0, None) and "Traceback" not in err, err[-3000:]
    assert lines[-1].startswith("error: ") and "rerun the same command" in lines[-1], err[-3000:]
    port = free_port()
    tasks = [_start_task(rank, port, args) for rank in (0, 1)]
    outs = [t.communicate(timeout=300) for t in tasks]
    assert [t.returncode for t in tasks] == [0, 0], outs[0][1][-3000:]
    log = (tmp_path / "train.log").read_text()
    assert "resumed from" in log and json.loads((tmp_path / "summary.json").read_text())["epochs"] == 12
