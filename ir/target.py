"""Targets are data: what the passes need to know about a GPU to size and place work.

`hbm_bandwidth` is the read rate the roofline is reported against. For the H200 it is the
measured best (a persistent bulk-copy stream, 4.40 TB/s, see docs/performance.md); for the
others it is the vendor's datasheet figure until measured. `link_bandwidth` (NVLink, bytes/s
per direction per GPU) and `link_latency_ns` (one small all-reduce's fixed cost) are what the
cost model charges for tensor parallelism: datasheet bandwidths and an estimated latency, not
measurements.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    name: str
    arch: str  # nvcc code name, e.g. "sm_90a"
    num_sms: int
    smem_per_block: int  # bytes of shared memory one CTA may use (opt-in maximum)
    regs_per_sm: int
    l2_bytes: int
    hbm_bandwidth: float  # bytes/s
    hbm_latency_ns: float  # typical load-to-use latency of HBM, for Little's law
    clock_hz: float
    link_bandwidth: float = 450e9  # NVLink 4: 900 GB/s both directions
    link_latency_ns: float = 5000.0

    def bandwidth_floor_s(self, nbytes: int) -> float:
        """Seconds to read `nbytes` once at the roofline bandwidth."""
        return nbytes / self.hbm_bandwidth


TARGETS: dict[str, Target] = {
    "h200": Target("h200", "sm_90a", num_sms=132, smem_per_block=227 * 1024, regs_per_sm=65536,
                   l2_bytes=60 * 1024**2, hbm_bandwidth=4.40e12, hbm_latency_ns=700.0,
                   clock_hz=1.98e9),
    "h100": Target("h100", "sm_90a", num_sms=132, smem_per_block=227 * 1024, regs_per_sm=65536,
                   l2_bytes=50 * 1024**2, hbm_bandwidth=3.35e12, hbm_latency_ns=700.0,
                   clock_hz=1.98e9),
    "b200": Target("b200", "sm_100a", num_sms=148, smem_per_block=227 * 1024, regs_per_sm=65536,
                   l2_bytes=126 * 1024**2, hbm_bandwidth=8.0e12, hbm_latency_ns=700.0,
                   clock_hz=1.965e9, link_bandwidth=900e9),
}


def get_target(name: str | Target) -> Target:
    if isinstance(name, Target):
        return name
    key = name.lower()
    if key not in TARGETS:
        raise ValueError(f"unknown target {name!r} (known: {', '.join(TARGETS)})")
    return TARGETS[key]
