"""The GPU's SM clock, power draw and power-cap throttling over each training step, sampled through NVML.

At the power cap a GPU lowers its clock to stay under its power limit, so the same kernels run slower in a
power-hungry step (the BF16 and FP8 steps of the e64 proxy both run at the H200's 700 W cap, at different clocks:
docs/benchmarks.md). `ClockSampler` reads the GPU every `interval_s` on a daemon thread; the trainer takes the
samples at the end of every optimizer step and logs their summary (`sm_clock_mhz`, `power_w`,
`power_capped_share`) beside the step's tokens/s, so a slow step can be told from a throttled one.

The readings come from NVML (the `nvidia-ml-py` package, `pynvml`), which the CUDA images ship; without it, on
CPU, or when NVML fails, there is no sampler and the metrics are left out. A reading that fails mid-run stops the
sampler (logged once); training never depends on it.
"""

from __future__ import annotations

import logging
import statistics
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

try:  # optional: NVML's Python bindings (package nvidia-ml-py)
    import pynvml
except ImportError:  # pragma: no cover - depends on the environment
    pynvml = None

__all__ = ["ClockSample", "ClockSampler", "nvml_reader"]

log = logging.getLogger(__name__)

# nvmlClocksEventReasonSwPowerCap (nvml.h): the clock is held down to keep the board under its power limit
SW_POWER_CAP = 0x4


@dataclass(frozen=True)
class ClockSample:
    """One reading: SM clock (MHz), board power draw (W), and whether the power cap is holding the clock down."""

    sm_mhz: float
    power_w: float
    power_capped: bool


class ClockSampler:
    """Calls `read()` every `interval_s` seconds on a daemon thread; `take()` summarises the samples since the last
    `take()` and starts a new window. `read` raising stops the sampling (logged once); `take()` then returns {}.
    `release` (e.g. NVML's shutdown) runs once, when `close()` has stopped the thread."""

    def __init__(self, read: Callable[[], ClockSample], interval_s: float,
                 release: Callable[[], None] | None = None) -> None:  # fmt: skip
        if interval_s <= 0:
            raise ValueError(f"the sampling interval must be positive, got {interval_s}")
        self._read, self.interval_s, self._release = read, interval_s, release
        self._samples: list[ClockSample] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-clock-sampler", daemon=True)
        self._thread.start()

    @classmethod
    def for_device(cls, device: torch.device, interval_s: float) -> ClockSampler | None:
        """A sampler of this CUDA device through NVML, or None: interval 0 (off), not CUDA, no pynvml, or NVML
        refused (each but the first two logged)."""
        if interval_s <= 0 or device.type != "cuda":
            return None
        try:
            read = nvml_reader(device)
        except Exception as err:  # noqa: BLE001 - any NVML failure only turns the sampling off
            log.info("GPU clock sampling off (logging.gpu_clock_interval_s): %s", err)
            return None
        return cls(read, interval_s, release=pynvml.nvmlShutdown)  # pairs nvml_reader's nvmlInit

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                sample = self._read()
            except Exception as err:  # noqa: BLE001 - a failing reading only ends the sampling
                log.warning("GPU clock sampling stopped: %s", err)
                return
            with self._lock:
                self._samples.append(sample)

    def take(self) -> dict[str, float]:
        """The window's summary, {} without samples: median SM clock (MHz), median power (W), and the share of
        samples in which the power cap held the clock down."""
        with self._lock:
            samples, self._samples = self._samples, []
        if not samples:
            return {}
        return {"sm_clock_mhz": statistics.median(s.sm_mhz for s in samples),
                "power_w": statistics.median(s.power_w for s in samples),
                "power_capped_share": sum(s.power_capped for s in samples) / len(samples)}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.interval_s + 1.0)
        release, self._release = self._release, None
        if release is not None and not self._thread.is_alive():  # a reading still in flight keeps NVML
            release()


def nvml_reader(device: torch.device) -> Callable[[], ClockSample]:
    """A reader of `device` through NVML, found by its UUID (so CUDA_VISIBLE_DEVICES' renumbering does not
    matter); NVML stays initialised for it (the caller shuts it down: `ClockSampler.for_device` on close). Raises
    when pynvml is missing or NVML cannot find the device, with NVML shut down again."""
    if pynvml is None:
        raise RuntimeError("the package nvidia-ml-py (pynvml) is not installed")
    pynvml.nvmlInit()
    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            pynvml.nvmlDeviceGetCurrentClocksThrottleReasons  # the older name (NVML < 12.2)

        def read() -> ClockSample:
            return ClockSample(sm_mhz=float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
                               power_w=pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,  # mW
                               power_capped=bool(reasons(handle) & SW_POWER_CAP))

        read()  # fail here, at start-up, rather than on the thread
    except Exception:
        pynvml.nvmlShutdown()  # NVML counts its inits: this one is undone
        raise
    return read
