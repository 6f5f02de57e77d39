"""Cost and energy of a benchmark run: USD per 1M output tokens from an hourly price, and joules
from hardware counters when this machine exposes them, else an honest "not available (why)".

Energy sources, first that works wins:
  * RAPL (Intel, and AMD on Linux >= 5.8): /sys/class/powercap/<zone>/energy_uj of the top-level
    package zones, with wraparound handled via max_energy_range_uj. It counts the whole CPU
    package, so anything else running on the machine is included.
  * NVIDIA GPUs: `nvidia-smi --query-gpu=power.draw` sampled on a thread, integrated over time
    (GPU board power only, not the host).
Nothing is ever estimated from TDPs or guessed.

Used by bench_throughput.py (`EnergyMeter`, `cost_fields`); as a script it reports what is
readable here and the energy of a short numpy load:

    python benchmarks/micro/energy.py [--seconds 5] [--quick] [--out benchmarks/results/energy.json]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.lib.report import script_parser, write_result  # noqa: E402

# An assumption, not a quote: roughly what a 2-vCPU general-purpose cloud VM rents for on demand.
DEFAULT_USD_PER_HOUR = 0.10
POWERCAP = Path("/sys/class/powercap")


def add_cost_args(p: argparse.ArgumentParser) -> None:
    """--usd-per-hour, shared by every script that reports cost."""
    p.add_argument(
        "--usd-per-hour",
        type=float,
        default=DEFAULT_USD_PER_HOUR,
        help=f"machine price for the cost figures (default {DEFAULT_USD_PER_HOUR} USD/h: an assumed "
        "on-demand price of a 2-vCPU cloud VM; pass your own)",
    )


def usd_per_million_tokens(elapsed_s: float, tokens: int, usd_per_hour: float) -> float | None:
    """What 1M tokens cost at this speed when the whole machine is rented for the run."""
    if tokens <= 0 or elapsed_s <= 0:
        return None
    return usd_per_hour * (elapsed_s / 3600.0) / tokens * 1e6


# ---------------------------------------------------------------------------------------- RAPL


def rapl_zones(root: Path = POWERCAP) -> list[Path]:
    """Top-level package zones (intel-rapl:N), whose counters we can read.

    Sub-zones (intel-rapl:N:M, e.g. core/dram) are parts of a package and would double count;
    intel-rapl-mmio:N repeats package N through another interface.
    """
    if not root.is_dir():
        return []
    zones = []
    for zone in sorted(root.iterdir()):
        if (
            zone.name.startswith("intel-rapl:")
            and zone.name.count(":") == 1
            and "mmio" not in zone.name
        ):
            try:
                int((zone / "energy_uj").read_text())
                zones.append(zone)
            except (OSError, ValueError):
                continue
    return zones


def _rapl_reason(root: Path = POWERCAP) -> str:
    if not root.is_dir():
        return f"no {root} (no RAPL driver, or a VM/container that hides it)"
    if not any(z.name.startswith("intel-rapl:") for z in root.iterdir()):
        return f"{root} has no RAPL package zones"
    return f"RAPL energy_uj under {root} is not readable by this user (root only on recent kernels)"


def rapl_delta_uj(before: int, after: int, max_range_uj: int) -> int:
    """Energy between two readings of a counter that wraps to 0 after max_range_uj."""
    return after - before if after >= before else after + max_range_uj - before


class _Rapl:
    def __init__(self, zones: list[Path]) -> None:
        self.zones = zones
        self.ranges = []
        for z in zones:
            try:
                self.ranges.append(int((z / "max_energy_range_uj").read_text()))
            except (OSError, ValueError):
                self.ranges.append(2**32)  # unknown range: assume a 32-bit counter

    def read(self) -> list[int]:
        return [int((z / "energy_uj").read_text()) for z in self.zones]

    def joules(self, before: list[int], after: list[int]) -> dict[str, float]:
        return {
            z.name: rapl_delta_uj(b, a, r) / 1e6
            for z, b, a, r in zip(self.zones, before, after, self.ranges)
        }


# ---------------------------------------------------------------------------------- nvidia-smi


def _nvidia_power_w() -> list[float] | None:
    """Board power of each GPU in watts, or None when nvidia-smi is absent or fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=power.draw", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout
        return [float(x) for x in out.split()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


class _GpuSampler(threading.Thread):
    """Samples nvidia-smi power while a run is in progress; integrates with the trapezoid rule."""

    def __init__(self, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []  # (time, watts summed over GPUs)
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            watts = _nvidia_power_w()
            if watts is not None:
                self.samples.append((time.perf_counter(), sum(watts)))
            self._done.wait(self.interval_s)

    def stop(self) -> float | None:
        self._done.set()
        self.join()
        if len(self.samples) < 2:
            return None
        s = self.samples
        return sum((t1 - t0) * (w0 + w1) / 2 for (t0, w0), (t1, w1) in zip(s, s[1:]))


# ----------------------------------------------------------------------------------- the meter


class EnergyMeter:
    """Context manager: `with EnergyMeter() as m: run()`, then `m.result(output_tokens)`.

    The result is a dict (source, joules, average watts, J per output token) or the string
    "not available (reason)" when no counter is readable.
    """

    def __init__(self, root: Path = POWERCAP, gpu_interval_s: float = 0.1) -> None:
        self.root = root
        self.gpu_interval_s = gpu_interval_s
        self.source = None
        zones = rapl_zones(root)
        if zones:
            self.source = "rapl"
            self._rapl = _Rapl(zones)
        elif _nvidia_power_w() is not None:
            self.source = "nvidia-smi"
        self.reason = None if self.source else f"{_rapl_reason(root)}; no working nvidia-smi"
        self.elapsed_s = 0.0
        self._joules: dict[str, float] | None = None

    def __enter__(self) -> EnergyMeter:
        self._t0 = time.perf_counter()
        if self.source == "rapl":
            self._before = self._rapl.read()
        elif self.source == "nvidia-smi":
            self._sampler = _GpuSampler(self.gpu_interval_s)
            self._sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed_s = time.perf_counter() - self._t0
        if self.source == "rapl":
            self._joules = self._rapl.joules(self._before, self._rapl.read())
        elif self.source == "nvidia-smi":
            joules = self._sampler.stop()
            if joules is None:
                self.reason = "nvidia-smi gave fewer than 2 power samples (run too short)"
            else:
                self._joules = {"gpu": joules}

    def result(self, output_tokens: int | None = None) -> dict[str, Any] | str:
        """JSON-ready energy of the measured block, or "not available (reason)"."""
        if self._joules is None:
            return f"not available ({self.reason})"
        total = sum(self._joules.values())
        out: dict[str, Any] = {
            "source": self.source,
            "scope": "whole CPU package(s), other processes included"
            if self.source == "rapl"
            else "GPU board power",
            "joules": total,
            "by_zone_j": self._joules,
            "avg_watts": total / self.elapsed_s if self.elapsed_s > 0 else None,
        }
        if output_tokens:
            out["j_per_output_token"] = total / output_tokens
        return out


def cost_fields(
    elapsed_s: float, output_tokens: int, usd_per_hour: float, meter: EnergyMeter | None
) -> dict[str, Any]:
    """The cost and energy fields one benchmark side adds to its result."""
    return {
        "usd_per_hour": usd_per_hour,
        "usd_per_1m_output_tokens": usd_per_million_tokens(elapsed_s, output_tokens, usd_per_hour),
        "energy": meter.result(output_tokens)
        if meter is not None
        else "not available (not measured)",
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = script_parser(__doc__, "energy.json", model=None)
    p.add_argument("--seconds", type=float, default=5.0, help="length of the numpy load to measure")
    p.add_argument("--quick", action="store_true", help="a 0.5 s load")
    add_cost_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Report which energy source works here and what a short busy loop costs."""
    import numpy as np

    args = parse_args(argv)
    seconds = 0.5 if args.quick else args.seconds
    a = np.random.default_rng(0).standard_normal((512, 512), dtype=np.float32)
    meter = EnergyMeter()
    matmuls = 0
    with meter:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            a @ a
            matmuls += 1
    result = {
        "benchmark": "energy_probe",
        "source": meter.source,
        "load": f"{matmuls} fp32 512x512 matmuls in {meter.elapsed_s:.2f} s",
        "elapsed_s": meter.elapsed_s,
        "energy": meter.result(),
        "usd_per_hour": args.usd_per_hour,
        "usd_for_load": args.usd_per_hour * meter.elapsed_s / 3600,
    }
    print(f"energy source: {meter.source or 'none'}; energy: {result['energy']}")
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
