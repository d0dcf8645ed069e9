"""The rendezvous of a submitit job's tasks (no torchrun): torchrun's variables from the job's environment, as
submitit's local executor sets it for each task (tests/test_train_distributed.py runs such a job for real)."""
import os
import socket

import pytest

from swin.train.distributed import MASTER_PORTS, export_job_environment, job_environment

TORCHRUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def no_torchrun(monkeypatch):
    for key in TORCHRUN:  # setenv first: teardown then removes what the code under test exports
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    return monkeypatch


def _as_submitit_task(monkeypatch, job_id: str, rank: int, tasks: int) -> None:
    for key, value in {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": job_id, "SUBMITIT_LOCAL_NTASKS": tasks,
                       "SUBMITIT_LOCAL_JOB_NUM_NODES": 1, "SUBMITIT_LOCAL_NODEID": 0,
                       "SUBMITIT_LOCAL_GLOBALID": rank, "SUBMITIT_LOCAL_LOCALID": rank}.items():
        monkeypatch.setenv(key, str(value))


def test_every_task_of_a_job_gets_its_rank_and_the_same_rendezvous(no_torchrun):
    envs = []
    for rank in range(4):
        _as_submitit_task(no_torchrun, "4242", rank, tasks=4)
        envs.append(job_environment())
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"] == [e["LOCAL_RANK"] for e in envs]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"} and {e["LOCAL_WORLD_SIZE"] for e in envs} == {"4"}
    assert {e["MASTER_ADDR"] for e in envs} == {socket.gethostname()}  # the job's first (here: only) host
    ports = {e["MASTER_PORT"] for e in envs}
    assert len(ports) == 1 and MASTER_PORTS[0] <= int(ports.pop()) <= MASTER_PORTS[1]
    # the port is the job's: the same after a requeue (same job id), another for another job
    again = job_environment()["MASTER_PORT"]
    _as_submitit_task(no_torchrun, "4243", 3, tasks=4)
    assert again == envs[0]["MASTER_PORT"] != job_environment()["MASTER_PORT"]


def test_master_port_from_the_environment_wins(no_torchrun):
    _as_submitit_task(no_torchrun, "4242", 1, tasks=2)
    no_torchrun.setenv("MASTER_PORT", "29511")
    assert export_job_environment()["MASTER_PORT"] == "29511"
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]) == ("1", "2", "29511")


def test_torchrun_variables_win_and_one_task_is_one_process(no_torchrun):
    _as_submitit_task(no_torchrun, "4242", 0, tasks=1)
    assert job_environment() is None and export_job_environment() is None and "RANK" not in os.environ
    _as_submitit_task(no_torchrun, "4242", 1, tasks=2)
    no_torchrun.setenv("WORLD_SIZE", "8")  # under torchrun: its variables stay
    assert export_job_environment() is None and os.environ["WORLD_SIZE"] == "8" and "RANK" not in os.environ


def test_exported_variables_do_not_outlive_a_test():
    assert not set(TORCHRUN) & set(os.environ)  # runs after the tests above (file order)
