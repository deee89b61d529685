"""`batch_to_device`: the micro-batch reaches the device unchanged, and on CUDA without the host waiting for the
GPU work already queued (what a copy from pageable memory does)."""

from __future__ import annotations

import time

import pytest
import torch

from data.loader import batch_to_device

GPU_SLEEP_CYCLES = 400_000_000  # ~0.2 s of one SM spinning at H100/H200 clocks: long enough to still be running


def _batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 50_000, (4, 257), generator=gen)
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].clone(), "doc_ids": torch.zeros(4, 256).long()}


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
    batch = _batch(torch.Generator().manual_seed(1))
    stream = torch.cuda.current_stream(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    torch.cuda._sleep(GPU_SLEEP_CYCLES)
    end.record()
    end.synchronize()
    sleep_s = begin.elapsed_time(end) / 1e3
    # the pageable copy waits for the queued work (CUDA synchronises the stream first): the premise of the helper
    torch.cuda._sleep(GPU_SLEEP_CYCLES)
    t0 = time.perf_counter()
    batch["labels"].to(device, non_blocking=True)
    assert time.perf_counter() - t0 > 0.5 * sleep_s, "a pageable host-to-device copy no longer waits for the GPU"
    torch.cuda._sleep(GPU_SLEEP_CYCLES)
    moved = batch_to_device(batch, device)
    assert not stream.query(), "batch_to_device waited for the GPU"
    torch.cuda.synchronize(device)
    for k, v in batch.items():
        assert moved[k].is_cuda and torch.equal(moved[k].cpu(), v)
