"""The accelerators the estimator prices a step on: peak compute, memory, and the two links.

One `Device` per `--device`. `peak_tflops` is the dense bf16 peak (trainer.metrics.PEAK_TFLOPS, what MFU
is measured against); `efficiency` is the one fraction of it that eager bf16 training kernels reach on
that device, stated here once and used for every layout and model (it is not fitted per benchmark row).
Links are α–β (parallelisms.dtensor.cost.LinkCost): NVLink inside a node, the network between nodes;
β is the bus bandwidth one GPU gets in a ring collective, α the latency of one collective.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from parallelisms.dtensor.cost import LinkCost

GIB = 1 << 30


@dataclass(frozen=True)
class Device:
    name: str
    peak_tflops: float  # dense bf16 (fp32 for the CPU)
    float8_tflops: float  # dense float8 matmuls; 0: no float8 tensor cores
    efficiency: float  # fraction of the peak the step's compute runs at
    memory_bytes: int
    memory_bytes_per_s: float  # HBM bandwidth (what a memory-bound kernel such as a float8 cast runs at)
    intra_node: LinkCost  # NVLink (NVSwitch) between the GPUs of one node
    inter_node: LinkCost  # the scale-out network, per GPU (one NIC per GPU)


DEVICES: dict[str, Device] = {
    # A100 SXM 80GB: NVLink3 600 GB/s bidirectional (~230 GB/s ring bus bandwidth), 200 Gb/s HDR per GPU
    "a100": Device("a100", 312.0, 0.0, 0.50, 80 * GIB, 2.0e12, LinkCost(10e-6, 230e9), LinkCost(20e-6, 23e9)),
    # H100 SXM 80GB: NVLink4 900 GB/s bidirectional (~360 GB/s ring), 400 Gb/s NDR per GPU
    "h100": Device("h100", 989.0, 1979.0, 0.45, 80 * GIB, 3.35e12, LinkCost(10e-6, 360e9), LinkCost(20e-6, 45e9)),
    # H200 141GB: H100's compute and links, more and faster HBM
    "h200": Device("h200", 989.0, 1979.0, 0.48, 141 * 10**9, 4.8e12, LinkCost(10e-6, 360e9), LinkCost(20e-6, 45e9)),
    # B200 180GB: NVLink5 1.8 TB/s bidirectional (~720 GB/s ring), 400 Gb/s per GPU
    "b200": Device("b200", 2250.0, 4500.0, 0.40, 180 * 10**9, 8.0e12, LinkCost(10e-6, 720e9), LinkCost(20e-6, 45e9)),
    # a CPU rank under gloo (the tests' worlds): a nominal fp32 peak (float8 matmuls run in fp32), loopback TCP
    "cpu": Device("cpu", 0.2, 0.2, 1.0, 64 * GIB, 20e9, LinkCost(50e-6, 5e9), LinkCost(50e-6, 5e9)),
}


def lookup_device(name: str) -> Device:
    """The table's entry for `name` (case-insensitive), or a ValueError naming the choices."""
    device = DEVICES.get(name.lower())
    if device is None:
        raise ValueError(f"--device {name!r}: expected one of {sorted(DEVICES)}")
    return device


def gpus_per_node() -> int:
    """GPUs per node: the NGPU environment variable run_train.sh uses (default 8). ValueError, naming NGPU, when it
    is not a positive whole number."""
    raw = os.environ.get("NGPU", "") or "8"
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError(f"NGPU={raw!r}: the GPUs per node must be a positive whole number (e.g. NGPU=8), or unset")
    return int(raw)
