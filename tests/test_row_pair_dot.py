"""A gate/up row pair's dot products in one pass over the input (decode.cuh: dot_groups with
N = 2 rows sharing each load of x, as matvec_pages runs every halves == 2 row: a dense FFN's
norm_matvec, moe_gate_up, the split-K FFN's gate/up part) equal each row's own dot product
(N = 1) bit for bit, bf16 and FP8 rows, over segments with and without a tail of single groups:
on the host (g++, the harness tests/row_pair_dot.cu), and on a GPU (the same file through nvcc,
where the compiler's own instruction choice could break it). The sums themselves are checked
against float64 math, so that equal results cannot be two equal wrong ones.

The whole decode step through the pair (every model family, bf16 and FP8) against the
interpreter is in tests/test_mla_kernel.py and its neighbours (`random_host_step`).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from kernel_source import KernelSource
from test_fp8_kernel import fp8_row, host_cuda_compiler, needs_nvcc

from tilertc.backends.cuda import codegen
from tilertc.ir.fp8 import expand_blocks, pack_rows, row_scales
from tilertc.ir.target import get_target

HARNESS = Path(__file__).with_name("row_pair_dot.cu")
FP8_BLOCK_COLS = 128
# (format, k, scale columns): rows of one 4-group step and less, several steps with and without
# a tail, and FP8 rows with finer scales (MLA's q absorption rows)
ROWS = [("bf16", 64, 0), ("bf16", 1024, 0), ("bf16", 4096 + 72, 0),
        ("fp8", 64, 128), ("fp8", 2056, 128), ("fp8", 4096, 128), ("fp8", 520, 64),
        ("fp8", 192, 8)]


def pair_source(device: bool) -> str:
    """decode.cuh's row loop and bf16 rows (dot_groups through dot_segment) and its FP8 rows
    (through dot_segment_fp8); warp_sum too for the GPU (the host harness has its own)."""
    k = KernelSource()
    parts = [k.between("// The loop every row format shares", "#if MOE && TP > 1\n"),
             k.between("// FP8 rows (ir/fp8.py", "// An FP8 routed down row")]
    if device:
        parts.insert(0, k.definition("__device__ __forceinline__ float warp_sum"))
    return "\n".join(parts)


def segments(k8: int) -> list[tuple[int, int]]:
    """Segments of a row's 8-column groups: whole, short, a 4-group step plus a tail, one
    warp's share of several."""
    cand = {(0, k8), (0, 1), (k8 - 1, k8), (3, max(4, k8 - 2)), (k8 // 3, 2 * k8 // 3),
            (5, min(k8, 5 + 64 + 5)), (k8 // 4, k8 // 2)}
    return sorted((b, e) for b, e in cand if 0 <= b < e <= k8)


def cases(gen: torch.Generator) -> tuple[np.ndarray, bytes, np.ndarray, np.ndarray]:
    """Every row pair of ROWS over its segments: the Case table (struct Case), the rows, the
    inputs and each case's two dot products in float64."""
    table, rows, xs, want = [], [], [], []
    offset = x_offset = 0
    for fmt, k, cols in ROWS:
        if fmt == "bf16":
            pair = (torch.randn(2, k, generator=gen) * 0.05).bfloat16()
            packed, values = pair.view(torch.uint8).reshape(2, -1), pair.double()
            shift = 0
        else:
            qs = [fp8_row(k, gen, cols) for _ in range(2)]
            packed = torch.cat([pack_rows(q, row_scales(s, (1, cols))) for q, s in qs])
            values = torch.cat([q.double() * expand_blocks(s.double(), (1, k), (1, cols))
                                for q, s in qs])
            shift = (cols // 4).bit_length() - 1
        x = (torch.randn(k, generator=gen) * 3).float()
        stride = packed.shape[1]
        for b, e in segments(k // 8):
            table.append([fmt == "fp8", k, b, e, stride, offset, x_offset, shift])
            cols8 = slice(8 * b, 8 * e)
            want.append((values[:, cols8] * x[cols8].double()).sum(1).tolist())
        rows.append(packed.numpy().tobytes())
        xs.append(x.numpy())
        offset += 2 * stride
        x_offset += k
    return (np.array(table, dtype=np.int32), b"".join(rows), np.concatenate(xs),
            np.array(want))


def assert_pair_is_each_row(out: np.ndarray, want: np.ndarray) -> None:
    """The pair's sums are each row's alone, bit for bit, and float64 math to float32
    rounding."""
    pair, alone = out[:, :2], out[:, 2:]
    differ = np.nonzero((pair.view(np.uint32) != alone.view(np.uint32)).any(1))[0]
    assert differ.size == 0, f"cases {differ.tolist()}: pair {pair[differ]} alone {alone[differ]}"
    assert np.allclose(alone, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_row_pair_on_the_host_is_each_rows_dot_product(tmp_path: Path) -> None:
    cxx, include = host_cuda_compiler()
    (tmp_path / "pair_extract.inc").write_text(pair_source(device=False))
    exe = tmp_path / "row_pair_dot"
    subprocess.run([cxx, "-x", "c++", "-O1", "-std=c++20", "-pthread", f"-I{tmp_path}",
                    f"-I{include}", f"-DFP8_BLOCK_COLS={FP8_BLOCK_COLS}", "-o", str(exe),
                    str(HARNESS)], check=True, capture_output=True, text=True)
    table, rows, x, want = cases(torch.Generator().manual_seed(0))
    (tmp_path / "cases.bin").write_bytes(table.tobytes())
    (tmp_path / "rows.bin").write_bytes(rows)
    (tmp_path / "x.bin").write_bytes(x.tobytes())
    subprocess.run([str(exe), str(tmp_path)], check=True)
    out = np.fromfile(tmp_path / "out.bin", dtype=np.float32).reshape(-1, 4)
    assert_pair_is_each_row(out, want)


def device_cubin(tmp: Path) -> bytes:
    """tests/row_pair_dot.cu compiled by nvcc for the H200, as the kernel is (-O3)."""
    needs_nvcc()
    (tmp / "pair_extract.inc").write_text(pair_source(device=True))
    cubin, arch = tmp / "row_pair_dot.cubin", get_target("h200").arch
    virt = arch.replace("sm_", "compute_")
    subprocess.run([codegen.find_nvcc(), "-cubin", f"-gencode=arch={virt},code={arch}", "-O3",
                    "-std=c++17", f"-I{tmp}",
                    f"-DFP8_BLOCK_COLS={FP8_BLOCK_COLS}", "-o", str(cubin), str(HARNESS)],
                   check=True, capture_output=True, text=True)
    return cubin.read_bytes()


@pytest.mark.gpu
def test_row_pair_on_the_gpu_is_each_rows_dot_product(tmp_path: Path) -> None:
    from cuda.bindings import driver as drv

    from tilertc.engine import _check

    blob = device_cubin(tmp_path)
    table, rows, x, want = cases(torch.Generator().manual_seed(0))
    dev = torch.device("cuda")
    bufs = [torch.from_numpy(table).to(dev),
            torch.frombuffer(bytearray(rows), dtype=torch.uint8).to(dev),
            torch.from_numpy(x).to(dev), torch.zeros(len(table), 4, device=dev)]
    torch.cuda.init()
    module = _check(drv.cuModuleLoadData(blob), "cuModuleLoadData")
    func = _check(drv.cuModuleGetFunction(module, b"row_pair_dot"), "cuModuleGetFunction")
    ptrs = [np.array([b.data_ptr()], dtype=np.uint64) for b in bufs]
    args = np.array([p.ctypes.data for p in ptrs], dtype=np.uint64)
    stream = drv.CUstream(torch.cuda.current_stream().cuda_stream)
    _check(drv.cuLaunchKernel(func, len(table), 1, 1, 32, 1, 1, 0, stream, args.ctypes.data, 0),
           "cuLaunchKernel")
    torch.cuda.synchronize()
    _check(drv.cuModuleUnload(module), "cuModuleUnload")
    assert_pair_is_each_row(bufs[3].cpu().numpy(), want)
