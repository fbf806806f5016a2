"""FP8 e4m3 block-scaled weights: the one dequantization every weight read goes through, and the
quantization that produces such weights (random tiny models, tests).

The format is the DeepSeek-V3 checkpoint's, as transformers' fine-grained FP8 integration reads
and writes it (`transformers/integrations/finegrained_fp8.py`: `Fp8Quantize._quantize_one`,
`Fp8Dequantize`): a weight W [out, in] is stored as e4m3 values q with one fp32 `weight_scale_inv`
s per (block_rows x block_cols) block, and

    W[i, j] = float(q[i, j]) * s[i // block_rows, j // block_cols].

The scale is the *inverse* of the quantization scale: quantizing divides a block by
s = amax(|block|) / 448 (448 is the largest finite e4m3 value), dequantizing multiplies by it.
With `scale_fmt` "ue8m0" s is rounded up to a power of two before quantizing. Edge blocks of a
weight whose sides are not multiples of the block are partial (the scale grid is
ceil(out / block_rows) x ceil(in / block_cols)), as in DeepSeek's reference `weight_dequant`.
"""

from __future__ import annotations

import math

import torch

FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The `weight_scale_inv` grid of a weight [out, in]: one scale per (partial) block."""
    rows, cols = shape
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def expand_blocks(scale_inv: torch.Tensor, shape: tuple[int, ...],
                  block: tuple[int, int]) -> torch.Tensor:
    """The per-block scales broadcast to one per weight element, [out, in]."""
    rows, cols = shape
    per_row = scale_inv.repeat_interleave(block[0], dim=0)[:rows]
    return per_row.repeat_interleave(block[1], dim=1)[:, :cols]


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor,
               block: tuple[int, int]) -> torch.Tensor:
    """W = q · s per block, in float32 (exact for ue8m0 scales, which are powers of two)."""
    if tuple(scale_inv.shape) != scale_shape(tuple(weight.shape), block):
        raise ValueError(f"scale grid {tuple(scale_inv.shape)} does not match weight "
                         f"{tuple(weight.shape)} in {block[0]}x{block[1]} blocks")
    return weight.float() * expand_blocks(scale_inv.float(), tuple(weight.shape), block)


def quantize(weight: torch.Tensor, block: tuple[int, int],
             ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 weight_scale_inv) with each block's largest |value| mapped to 448.

    An all-zero block gets scale 1 so that its zeros stay exact and nothing divides by zero.
    """
    w = weight.float()
    rows, cols = w.shape
    gr, gc = scale_shape((rows, cols), block)
    padded = torch.zeros(gr * block[0], gc * block[1], device=w.device)
    padded[:rows, :cols] = w
    amax = padded.reshape(gr, block[0], gc, block[1]).abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    if ue8m0:
        scale_inv = torch.exp2(torch.ceil(torch.log2(scale_inv)))
    scaled = w / expand_blocks(scale_inv, (rows, cols), block)
    q = scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale_inv


def packed_row_bytes(k: int, scale_cols: int) -> int:
    """Bytes of one weight row of k columns as the kernel streams it: its k e4m3 values, then
    one fp32 scale per `scale_cols` columns (ceil(k / scale_cols) of them), padded to 16 bytes.
    Values and scales side by side let one bulk copy bring both; the padding keeps every row of
    a ring page on the 16-byte boundaries bulk copies need. A checkpoint weight's row carries
    the scales of its block row (`scale_cols` = the block's columns); a row derived from one
    may need finer ones (`ir/mla.py: derive_kv_b_scales`)."""
    return -(-(k + 4 * math.ceil(k / scale_cols)) // 16) * 16


def row_scales(scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Each row's scales [rows rounded up to whole blocks, ceil(in / block_cols)]: the scales
    of its block row."""
    return scale_inv.float().repeat_interleave(block[0], dim=0)


def pack_rows(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e4m3 rows [n, k] with their scales [n, m] (one per k / m columns, the last partial) in
    the layout of `packed_row_bytes`: uint8 [n, packed_row_bytes(k, ceil(k / m))], zero
    padding."""
    n, k = values.shape
    m = scales.shape[1]
    out = torch.zeros(n, -(-(k + 4 * m) // 16) * 16, dtype=torch.uint8, device=values.device)
    out[:, :k] = values.view(torch.uint8)
    out[:, k:k + 4 * m] = scales.float().contiguous().view(torch.uint8).to(values.device)
    return out


# FP8 tiles (decode/tile_pages.cuh: tile_pages): the layout in which the kernel's tensor cores
# (wgmma, e4m3) read a projection's weights. A row of k columns is cut into S segments (S = 8 when k
# is a multiple of 1024, else 4: segments of whole 128-column blocks), and a tile is 64 / S
# consecutive rows of one weight, so that segment j of row r is row m = (64 / S) j + r of a
# 64-row operand. A tile is streamed as units of C columns of every segment: the unit's 64 x C
# values as 8x16-byte core matrices (column c of row m at (c / 32) 2048 + (c % 32 / 16) 1024 +
# m 16 + c % 16), then its S x C / 128 fp32 block scales (segment j's block b at j C / 128 + b;
# the tile's rows share one 128-row scale block).
TILE_BLOCK_COLS = 128  # the one scale block width tiles take: a unit is one or two blocks
TILE_UNIT_MAX_COLS = 2 * TILE_BLOCK_COLS
TILE_M = 64  # rows of the tensor cores' operand: a tile's rows x its segments
# rows a producer of ready digits digitizes with one exponent (passes/digits.py;
# decode/ready_digits.cuh: DIGIT_GROUP), so its tasks are whole groups
DIGIT_GROUP_ROWS = 8


def tile_segments(k: int) -> int | None:
    """S, the segments of a tiled row of k columns (decode/shared.cuh: tile_segments); None when k
    does not cut into 4 segments of whole 128-column blocks."""
    return 8 if k % 1024 == 0 else 4 if k % 512 == 0 else None


def tile_rows(k: int) -> int:
    """The rows of a tile of a weight of k columns: 64 / S."""
    return TILE_M // tile_segments(k)


def tile_unit_cols(k: int, block_cols: int = TILE_BLOCK_COLS) -> int | None:
    """C, the columns of a unit of a tiled row of k columns: 256 if it divides a segment, else
    128; None when k does not tile. Units of 1 or 2 blocks fill ring pages of any multiple of
    16448 B (passes/residency.py) to within 128 B."""
    segments = tile_segments(k)
    if segments is None or block_cols != TILE_BLOCK_COLS:
        return None
    return TILE_UNIT_MAX_COLS if (k // segments) % TILE_UNIT_MAX_COLS == 0 else block_cols


def tile_unit_bytes(k: int, block_cols: int = TILE_BLOCK_COLS) -> int:
    """Bytes of a unit of a tiled row of k columns: 64 C e4m3 values, then S C / 128 fp32
    scales."""
    cols, segments = tile_unit_cols(k, block_cols), tile_segments(k)
    return TILE_M * cols + 4 * segments * cols // block_cols


def tiled_row_bytes(k: int, block_cols: int = TILE_BLOCK_COLS) -> int:
    """Bytes per row of a tiled weight of k columns: a tile's units over its rows."""
    units = k // tile_segments(k) // tile_unit_cols(k, block_cols)
    return units * tile_unit_bytes(k, block_cols) // tile_rows(k)


def pack_tiles(values: torch.Tensor, scales: torch.Tensor,
               block_cols: int = TILE_BLOCK_COLS) -> torch.Tensor:
    """e4m3 rows [n, k] (n a multiple of the tile's rows) with their row scales [n, k /
    block_cols] as tiles: uint8 [tiles, units x tile_unit_bytes(k)], each tile's units in
    order."""
    n, k = values.shape
    cols, segments, rows = tile_unit_cols(k, block_cols), tile_segments(k), tile_rows(k)
    parts, tiles = k // segments // cols, n // rows
    # [tile, r, j, part, c32, half, byte] -> [tile, part, c32, half, j, r, byte]: the 16-byte row
    # pieces of core matrices, k32 steps 2048 B apart, their halves 1024, operand rows m 16
    v = values.view(torch.uint8).reshape(tiles, rows, segments, parts, cols // 32, 2, 16)
    v = v.permute(0, 3, 4, 5, 2, 1, 6).reshape(tiles, parts, -1)
    s = scales.float()[::rows].reshape(tiles, segments, parts, cols // block_cols)
    s = s.permute(0, 2, 1, 3).contiguous().view(torch.uint8).reshape(tiles, parts, -1)
    return torch.cat([v, s.to(v.device)], 2).reshape(tiles, -1)
