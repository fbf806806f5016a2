"""An FP8 gate/up row's two halves multiplied in one pass over the input (decode/dot.cuh:
dot_segment_fp8_pair, dot_groups of N = 2 rows sharing each load of x, as matvec_pages runs
every FP8 row with halves == 2: a dense FFN's norm_matvec, moe_gate_up, the split-K FFN's
gate/up part) give each row's own dot product (dot_segment_fp8, N = 1) bit for bit, over
segments with and without a tail of single groups and scales per 128 or fewer columns: on the
host (g++, the harness tests/row_pair_dot.cu), and on a GPU (the same file through nvcc, whose
own instruction choice could break it). The sums are also checked against float64 math, so
that equal results cannot be two equal wrong ones.

The whole decode step through the pair (dense, Qwen3-MoE, DeepSeek MLA and DSA, split-K, tp > 1
with FP8 weights) against the interpreter is in tests/test_fp8_kernel.py and its neighbours
(`random_host_step`).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from kernel_source import KernelSource
from test_fp8_kernel import (
    assert_float64_math,
    fp8_row,
    host_cuda_compiler,
    needs_nvcc,
    segments_of,
)

from tilertc.backends.cuda import codegen
from tilertc.ir.fp8 import expand_blocks, pack_rows, row_scales
from tilertc.ir.target import get_target

HARNESS = Path(__file__).with_name("row_pair_dot.cu")
FP8_BLOCK_COLS = 128
# (k, scale columns) of a pair's rows: less than one 4-group step, whole steps, steps and a
# tail, llama-3.1-8b's gate/up width, and finer scales (MLA's derived rows; the pair path does
# not see them today, but dot_groups takes any Fp8Row)
ROWS = [(64, 128), (1024, 128), (2056, 128), (4096, 128), (520, 64), (192, 8)]


@dataclass
class Pairs:
    """The harness's input: its Case table, packed rows and inputs; per ROWS entry its case
    indices, segments, both rows' values (float64) and input."""

    table: np.ndarray
    rows: bytes
    x: np.ndarray
    each: list[tuple[slice, list[tuple[int, int]], np.ndarray, np.ndarray]]


def pair_source(device: bool) -> str:
    """The device library's row loop (decode/dot.cuh: dot_groups, dot_row) and its FP8 rows up to
    the routed down row's pieces (Fp8Row, dot_segment_fp8, dot_segment_fp8_pair); warp_sum too for
    the GPU (the host harness has its own)."""
    k = KernelSource()
    parts = [k.between("// The loop every row format shares", "// A bf16 row"),
             k.between("// FP8 rows (ir/fp8.py", "// An FP8 routed down row")]
    if device:
        parts.insert(0, k.definition("__device__ __forceinline__ float warp_sum"))
    return "\n".join(parts)


def make_pairs(gen: torch.Generator) -> Pairs:
    """A random FP8 row pair (two halves of one packed gate/up row) per ROWS entry, over its
    segments (including a quarter of the row: a warp's share of a 4-warp row)."""
    table, rows, xs, each = [], [], [], []
    offset = x_offset = 0
    for k, cols in ROWS:
        qs = [fp8_row(k, gen, cols) for _ in range(2)]
        packed = torch.cat([pack_rows(q, row_scales(s, (1, cols))) for q, s in qs])
        values = torch.cat([q.double() * expand_blocks(s.double(), (1, k), (1, cols))
                            for q, s in qs]).numpy()
        x = (torch.randn(k, generator=gen) * 3).float().numpy()
        stride, shift = packed.shape[1], (cols // 4).bit_length() - 1
        segments = segments_of(k // 8, (k // 32, k // 16))
        first = len(table)
        table += [[k, b, e, stride, offset, x_offset, shift] for b, e in segments]
        each.append((slice(first, len(table)), segments, values, x))
        rows.append(packed.numpy().tobytes())
        xs.append(x)
        offset += 2 * stride
        x_offset += k
    return Pairs(np.array(table, dtype=np.int32), b"".join(rows), np.concatenate(xs), each)


def assert_pair_is_each_row(out: np.ndarray, pairs: Pairs) -> None:
    """Per case (pair's two sums, each row's alone): the pair's sums are each row's alone, bit
    for bit, and those are float64 math to float32 rounding."""
    pair, alone = out[:, :2], out[:, 2:]
    differ = np.nonzero((pair.view(np.uint32) != alone.view(np.uint32)).any(1))[0]
    assert differ.size == 0, f"cases {differ.tolist()}: pair {pair[differ]} alone {alone[differ]}"
    for cases, segments, values, x in pairs.each:
        for n in range(2):
            assert_float64_math(alone[cases, n].tolist(), segments, values[n], x)


def test_fp8_row_pair_on_the_host_is_each_rows_dot_product(tmp_path: Path) -> None:
    cxx, include = host_cuda_compiler()
    (tmp_path / "pair_extract.inc").write_text(pair_source(device=False))
    exe = tmp_path / "row_pair_dot"
    subprocess.run([cxx, "-x", "c++", "-O1", "-std=c++20", "-pthread", f"-I{tmp_path}",
                    f"-I{include}", f"-DFP8_BLOCK_COLS={FP8_BLOCK_COLS}", "-o", str(exe),
                    str(HARNESS)], check=True, capture_output=True, text=True)
    pairs = make_pairs(torch.Generator().manual_seed(0))
    (tmp_path / "cases.bin").write_bytes(pairs.table.tobytes())
    (tmp_path / "rows.bin").write_bytes(pairs.rows)
    (tmp_path / "x.bin").write_bytes(pairs.x.tobytes())
    subprocess.run([str(exe), str(tmp_path)], check=True)
    out = np.fromfile(tmp_path / "out.bin", dtype=np.float32).reshape(-1, 4)
    assert out.shape[0] == len(pairs.table)
    assert_pair_is_each_row(out, pairs)


def device_cubin(tmp: Path) -> bytes:
    """tests/row_pair_dot.cu compiled by nvcc for the H200, with the kernel's flags (-O3)."""
    needs_nvcc()
    (tmp / "pair_extract.inc").write_text(pair_source(device=True))
    cubin, arch = tmp / "row_pair_dot.cubin", get_target("h200").arch
    virt = arch.replace("sm_", "compute_")
    subprocess.run([codegen.find_nvcc(), "-cubin", f"-gencode=arch={virt},code={arch}", "-O3",
                    "-std=c++17", f"-I{tmp}", f"-DFP8_BLOCK_COLS={FP8_BLOCK_COLS}",
                    "-o", str(cubin), str(HARNESS)], check=True, capture_output=True, text=True)
    return cubin.read_bytes()


def test_the_gpu_harness_compiles_for_the_h200(tmp_path: Path) -> None:
    """The GPU test's cubin builds here too (nvcc, no GPU): the extracted source is whole."""
    assert device_cubin(tmp_path)[:4] == b"\x7fELF"


@pytest.mark.gpu
def test_fp8_row_pair_on_the_gpu_is_each_rows_dot_product(tmp_path: Path) -> None:
    from cuda.bindings import driver as drv

    from tilertc.engine import _check

    blob = device_cubin(tmp_path)
    pairs = make_pairs(torch.Generator().manual_seed(0))
    dev = torch.device("cuda")
    bufs = [torch.from_numpy(pairs.table).to(dev),
            torch.frombuffer(bytearray(pairs.rows), dtype=torch.uint8).to(dev),
            torch.from_numpy(pairs.x).to(dev), torch.zeros(len(pairs.table), 4, device=dev)]
    torch.cuda.init()
    module = _check(drv.cuModuleLoadData(blob), "cuModuleLoadData")
    func = _check(drv.cuModuleGetFunction(module, b"row_pair_dot"), "cuModuleGetFunction")
    ptrs = [np.array([b.data_ptr()], dtype=np.uint64) for b in bufs]
    args = np.array([p.ctypes.data for p in ptrs], dtype=np.uint64)
    stream = drv.CUstream(torch.cuda.current_stream().cuda_stream)
    _check(drv.cuLaunchKernel(func, len(pairs.table), 1, 1, 32, 1, 1, 0, stream,
                              args.ctypes.data, 0), "cuLaunchKernel")
    torch.cuda.synchronize()
    _check(drv.cuModuleUnload(module), "cuModuleUnload")
    assert_pair_is_each_row(bufs[3].cpu().numpy(), pairs)
