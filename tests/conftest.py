"""Test setup: without CUDA, Triton kernels run through the interpreter on the CPU.

TRITON_INTERPRET must be set before anything imports triton (timm does), so it is set here.
"""
import os
import sys
import zlib
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # -n N on N cores: a core per worker (and per process it starts),
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # not N threads each that take turns on the same cores
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402

# Fresh random inputs on every run; TEST_SEED=<n> replays a run (the seed is printed in the header). Set in the
# environment here: pytest-xdist's workers (-n), started after this file is loaded, draw the seed of the header.
RUN_SEED = int(os.environ.setdefault("TEST_SEED", str(int.from_bytes(os.urandom(4), "little"))))


def pytest_report_header(config):
    return f"TEST_SEED={RUN_SEED} (set it to replay these random inputs)"


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(RUN_SEED + zlib.crc32(request.node.nodeid.encode()))


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
