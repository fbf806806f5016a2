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


# FP8 tiles (decode.cuh: tile_pages): the layout in which the kernel's tensor cores (wgmma,
# e4m3) read a projection's weights. A tile is TILE_ROWS consecutive rows of one weight, each
# row cut into TILE_SEGMENTS segments of k / 8 columns; segment j of row r is row m = 8 j + r of
# a 64-row operand. It is streamed as units of C columns of every segment: the unit's 64 x C
# values as 8x16-byte core matrices (column c of row m at tile_offset(m, c)), then its
# TILE_SEGMENTS x C / 128 fp32 block scales (segment j's block b at j C / 128 + b; the 8 rows
# share one 128-row scale block).
TILE_ROWS = 8
TILE_SEGMENTS = 8
TILE_UNIT_MAX_COLS = 256


def tile_unit_cols(k: int, block_cols: int = 128) -> int | None:
    """C, the columns of a unit of a tiled row of k columns: the largest power-of-two number of
    scale blocks, at most TILE_UNIT_MAX_COLS columns, that divides a segment (k / 8); None when
    a segment is not whole blocks. Units of 1 or 2 blocks (8224 or 16448 B) fill ring pages of
    any multiple of 16448 B (passes/residency.py)."""
    seg = k // TILE_SEGMENTS
    if k % TILE_SEGMENTS or seg % block_cols:
        return None
    cols = block_cols
    while 2 * cols <= TILE_UNIT_MAX_COLS and seg % (2 * cols) == 0:
        cols *= 2
    return cols


def tile_unit_bytes(cols: int, block_cols: int = 128) -> int:
    """Bytes of a unit of C columns: 64 C e4m3 values, then 8 C / 128 fp32 scales."""
    return TILE_ROWS * TILE_SEGMENTS * cols + 4 * TILE_SEGMENTS * cols // block_cols


def tiled_row_bytes(k: int, block_cols: int = 128) -> int:
    """Bytes per row of a tiled weight of k columns: a tile's units over its 8 rows."""
    cols = tile_unit_cols(k, block_cols)
    return k // TILE_SEGMENTS // cols * tile_unit_bytes(cols, block_cols) // TILE_ROWS


def pack_tiles(values: torch.Tensor, scales: torch.Tensor, block_cols: int = 128) -> torch.Tensor:
    """e4m3 rows [n, k] (n a multiple of 8) with their row scales [n, k / block_cols] as
    tiles: uint8 [n / 8, k / 8 / C units x tile_unit_bytes(C)], each tile's units in order."""
    n, k = values.shape
    cols = tile_unit_cols(k, block_cols)
    parts = k // TILE_SEGMENTS // cols
    # [tile, r, j, part, c32, half, byte] -> [tile, part, c32, half, j, r, byte]: the 16-byte row
    # pieces of core matrices, k32 steps 2048 B apart, their halves 1024, segments 128, rows 16
    v = values.view(torch.uint8).reshape(n // TILE_ROWS, TILE_ROWS, TILE_SEGMENTS, parts,
                                         cols // 32, 2, 16)
    v = v.permute(0, 3, 4, 5, 2, 1, 6).reshape(n // TILE_ROWS, parts, -1)
    blocks = cols // block_cols
    s = scales.float()[::TILE_ROWS].reshape(n // TILE_ROWS, TILE_SEGMENTS, parts, blocks)
    s = s.permute(0, 2, 1, 3).contiguous().view(torch.uint8).reshape(n // TILE_ROWS, parts, -1)
    return torch.cat([v, s.to(v.device)], 2).reshape(n // TILE_ROWS, -1)
