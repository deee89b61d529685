"""The per-step GPU clock sampler (ling/train/gpu_clocks.py): its windows, its summary, how it stops, and the NVML
reader against a stand-in for pynvml (the real one runs in the `gpu` test)."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from ling.train import gpu_clocks
from ling.train.gpu_clocks import SW_POWER_CAP, ClockSample, ClockSampler, nvml_reader


def queued_reader() -> tuple[queue.Queue, Callable[[], ClockSample]]:
    """A reader that returns what the test puts in the queue, in order (an exception is raised), and blocks
    until then."""
    q: queue.Queue = queue.Queue()

    def read() -> ClockSample:
        item = q.get(timeout=10)
        if isinstance(item, Exception):
            raise item
        return item

    return q, read


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the sampler did not take the readings in time"
        time.sleep(0.005)


def test_each_take_summarises_the_readings_since_the_last_one():
    q, read = queued_reader()
    sampler = ClockSampler(read, interval_s=0.001)
    try:
        for mhz, watts, capped in [(1500, 690.0, True), (1800, 700.0, True), (1700, 650.0, False)]:
            q.put(ClockSample(mhz, watts, capped))
        wait_for(lambda: q.empty() and len(sampler._samples) == 3)
        assert sampler.take() == {"sm_clock_mhz": 1700, "power_w": 690.0, "power_capped_share": 2 / 3}
        assert sampler.take() == {}  # a new window: nothing read since
        q.put(ClockSample(1980, 300.0, False))
        wait_for(lambda: len(sampler._samples) == 1)
        assert sampler.take() == {"sm_clock_mhz": 1980, "power_w": 300.0, "power_capped_share": 0.0}
    finally:
        q.put(RuntimeError("test over"))  # unblocks the thread
        sampler.close()
    assert not sampler._thread.is_alive()


def test_a_failing_reading_stops_the_sampling_and_says_so(caplog):
    q, read = queued_reader()
    sampler = ClockSampler(read, interval_s=0.001)
    q.put(ClockSample(1600, 600.0, False))
    with caplog.at_level(logging.WARNING, logger=gpu_clocks.__name__):
        q.put(RuntimeError("NVML_ERROR_GPU_IS_LOST"))
        sampler._thread.join(timeout=10)
    assert not sampler._thread.is_alive()
    assert "GPU clock sampling stopped: NVML_ERROR_GPU_IS_LOST" in caplog.text
    assert sampler.take() == {"sm_clock_mhz": 1600, "power_w": 600.0, "power_capped_share": 0.0}  # kept
    assert sampler.take() == {}
    sampler.close()


DEVICE_UUID = "5e1f0c2a-0000-4000-8000-000000000001"  # the stand-in NVML's one device, as torch reports it


def fake_nvml(reasons: int, *, new_name: bool = True) -> SimpleNamespace:
    """A stand-in for pynvml: one device, found by its NVML UUID, with these clocks-event reasons."""
    handle = object()
    calls = {"init": 0, "shutdown": 0}

    def by_uuid(uuid: str):
        if not calls["init"]:
            raise RuntimeError("NVML_ERROR_UNINITIALIZED")
        if uuid != f"GPU-{DEVICE_UUID}":
            raise RuntimeError(f"NVML_ERROR_NOT_FOUND: {uuid}")
        return handle

    def init():
        calls["init"] += 1

    def shutdown():
        calls["shutdown"] += 1

    def clock(h, kind):
        assert h is handle and kind == 1
        return 1830

    nvml = SimpleNamespace(nvmlInit=init, nvmlShutdown=shutdown, nvmlDeviceGetHandleByUUID=by_uuid, NVML_CLOCK_SM=1,
                           nvmlDeviceGetClockInfo=clock, nvmlDeviceGetPowerUsage=lambda h: 698_500,  # mW
                           calls=calls)
    reasons_fn = (lambda h: reasons)
    if new_name:
        nvml.nvmlDeviceGetCurrentClocksEventReasons = reasons_fn
    nvml.nvmlDeviceGetCurrentClocksThrottleReasons = reasons_fn  # the older name, present in both
    return nvml


def test_no_sampler_when_off_or_on_cpu_and_a_bad_interval_is_refused(monkeypatch):
    # a working stand-in NVML: only the device type and the interval can turn the sampling off here
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid=DEVICE_UUID))
    monkeypatch.setattr(gpu_clocks, "pynvml", fake_nvml(0))
    sampler = ClockSampler.for_device(torch.device("cuda", 0), 0.5)  # the control: on
    assert sampler is not None
    assert gpu_clocks.pynvml.calls == {"init": 1, "shutdown": 0}
    sampler.close()
    sampler.close()
    assert gpu_clocks.pynvml.calls == {"init": 1, "shutdown": 1}  # NVML shut down once, when closed
    assert ClockSampler.for_device(torch.device("cpu"), 0.5) is None
    assert ClockSampler.for_device(torch.device("cuda", 0), 0.0) is None  # off
    with pytest.raises(ValueError, match="sampling interval must be positive"):
        ClockSampler(lambda: ClockSample(1, 1.0, False), interval_s=0)


@pytest.mark.parametrize("uuid", [DEVICE_UUID, f"GPU-{DEVICE_UUID}"])
@pytest.mark.parametrize("new_name", [True, False])
def test_the_nvml_reader_finds_the_device_by_uuid_and_reads_the_power_cap_bit(monkeypatch, uuid, new_name):
    props = SimpleNamespace(uuid=uuid)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(gpu_clocks, "pynvml", fake_nvml(SW_POWER_CAP | 0x1, new_name=new_name))  # + GPU idle bit
    read = nvml_reader(torch.device("cuda", 0))
    assert gpu_clocks.pynvml.calls["init"] == 1  # once (the lookup refuses an uninitialised NVML)
    assert read() == ClockSample(sm_mhz=1830.0, power_w=698.5, power_capped=True)
    monkeypatch.setattr(gpu_clocks, "pynvml", fake_nvml(0x1 | 0x8))  # idle and hardware slowdown, not the cap
    assert nvml_reader(torch.device("cuda", 0))().power_capped is False


def test_without_pynvml_or_the_device_the_sampling_is_off_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(gpu_clocks, "pynvml", None)
    with pytest.raises(RuntimeError, match="nvidia-ml-py"):
        nvml_reader(torch.device("cuda", 0))
    monkeypatch.setattr(gpu_clocks, "pynvml", fake_nvml(0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="another-gpu"))
    with caplog.at_level(logging.INFO, logger=gpu_clocks.__name__):
        assert ClockSampler.for_device(torch.device("cuda", 0), 0.5) is None
    assert "GPU clock sampling off (logging.gpu_clock_interval_s): NVML_ERROR_NOT_FOUND" in caplog.text
    assert gpu_clocks.pynvml.calls == {"init": 1, "shutdown": 1}  # the failed lookup's init undone


@pytest.mark.gpu
def test_the_gpu_clock_is_sampled_on_a_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if gpu_clocks.pynvml is None:
        pytest.skip("needs nvidia-ml-py")
    sampler = ClockSampler.for_device(torch.device("cuda", torch.cuda.current_device()), 0.02)
    assert sampler is not None
    try:
        x = torch.randn(4096, 4096, device="cuda")
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            x = x @ x
            x /= x.norm()
        torch.cuda.synchronize()
        summary = sampler.take()
    finally:
        sampler.close()
    assert 100 <= summary["sm_clock_mhz"] <= 5000 and summary["power_w"] > 0
    assert 0.0 <= summary["power_capped_share"] <= 1.0
