"""The caching allocator's release-and-retry count (ling/train/metrics.py `allocator_retries`), logged per step as
`alloc_retries` on CUDA: a step with retries waited for `cudaFree` (memory near full or fragmented)."""

from __future__ import annotations

import pytest
import torch

from ling.train.metrics import allocator_retries
from ling.train.trainer import train
from tests.helpers import COMMON, compose_cfg, metrics_of


def test_the_count_is_the_allocators_and_zero_off_cuda():
    seen = []

    def stats(device):
        seen.append(device)
        return {"num_alloc_retries": 3, "num_ooms": 0}

    assert allocator_retries(torch.device("cuda", 1), stats) == 3 and seen == [torch.device("cuda", 1)]
    assert allocator_retries(torch.device("cuda", 0), lambda d: {}) == 0  # a stack that does not count them
    assert allocator_retries(torch.device("cpu"), stats) == 0 and len(seen) == 1  # not asked off CUDA


def test_a_cpu_run_logs_no_retry_count(tmp_path):
    train(compose_cfg([*COMMON, "train.steps=1", "train.save_final=false", "train.resume=none"]), run_dir=tmp_path)
    assert "alloc_retries" not in metrics_of(tmp_path)[0]


@pytest.mark.gpu
def test_on_a_gpu_the_count_is_torchs_and_each_step_logs_its_own(tmp_path):
    device = torch.device("cuda")
    assert allocator_retries(device) == torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    train(compose_cfg([*COMMON, "train.device=cuda", "train.steps=2", "train.save_final=false", "train.resume=none"]),
          run_dir=tmp_path)
    assert [type(m["alloc_retries"]) for m in metrics_of(tmp_path)] == [int, int]
    assert all(m["alloc_retries"] >= 0 for m in metrics_of(tmp_path))
