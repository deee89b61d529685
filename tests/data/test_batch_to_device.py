"""`batch_to_device`: the micro-batch reaches the device unchanged, and on CUDA without the host waiting for the
GPU work already queued (which a staged copy from pageable memory may do)."""

from __future__ import annotations

import pytest
import torch

from data.loader import batch_to_device

GPU_SLEEP_CYCLES = 400_000_000  # ~0.2 s of one SM spinning at H100/H200 clocks: long enough to still be running


def _batch(gen: torch.Generator, rows: int = 4, seq: int = 256) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 50_000, (rows, seq + 1), generator=gen)
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].clone(),
            "doc_ids": torch.zeros(rows, seq, dtype=torch.long)}


def test_a_batch_reaches_the_cpu_device_unchanged():
    batch = _batch(torch.Generator().manual_seed(0))
    for device in (torch.device("cpu"), "cpu"):  # evaluate() takes either
        moved = batch_to_device(batch, device)
        assert moved.keys() == batch.keys()
        for k, v in batch.items():
            assert moved[k].device.type == "cpu" and moved[k].dtype == v.dtype and torch.equal(moved[k], v)


@pytest.mark.gpu
def test_a_batch_is_queued_behind_running_gpu_work_without_waiting_for_it():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda")
    batch = _batch(torch.Generator().manual_seed(1), rows=16, seq=4096)  # 512 KiB each, past CUDA's small-copy path
    stream = torch.cuda.current_stream(device)
    torch.cuda.synchronize(device)
    torch.cuda._sleep(GPU_SLEEP_CYCLES)
    moved = batch_to_device(batch, device)
    assert not stream.query(), "batch_to_device waited for the GPU"
    torch.cuda.synchronize(device)
    for k, v in batch.items():
        assert moved[k].is_cuda and torch.equal(moved[k].cpu(), v)
