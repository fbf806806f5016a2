// ---- FP8 tiles on the tensor cores: a tile task's pages (wgmma) ---------------------------------
#if FP8_MMA
// A tile task's row sums, warpgroup k's own (tile_pages): s.acc for the first, and for the
// others the end of the input vector's space, past the task's staged input (passes/residency.py
// sizes it so); `n`: the task's rows x halves. A warpgroup's stage: a flush's row sums of its 4
// warps, TILE_STAGE_ROWS each (a tile's rows of a warp: 8, or 16 for S = 4), two of them used in
// turn, at the end of s.red (no reduction in a tile task's page loop uses that part).
constexpr int TILE_WARPGROUPS = COMPUTE_WARPS / 4, TILE_STAGE_ROWS = 16;
static_assert(4 * COMPUTE_WARPS + 2 + TILE_WARPGROUPS * 2 * 4 * TILE_STAGE_ROWS <= MISC_FLOATS,
              "the warpgroups' stages overlap the matrix-vector reductions' slots in s.red");
__device__ __forceinline__ float* tile_sums(const Shared& s, int n, int k) {
  return k == 0 ? s.acc : s.vec + MAX_K - (TILE_WARPGROUPS - k) * n;
}
__device__ __forceinline__ float* tile_stage(const Shared& s, int wgi, int parity) {
  return s.red + MISC_FLOATS - (2 * wgi + parity + 1) * 4 * TILE_STAGE_ROWS;
}
// matvec_pages of an FP8 tile task of S segments (the input staged by stage_digits): a page
// holds whole units. The warpgroups of the page group take the page's units in turn, a unit's
// 128-column blocks (one or two) one after the other, each 4 wgmma k32 steps into D. Then a
// thread folds those of its D values that lie in its rows' own segment (S = 8: row g, segment
// 2 w + q / 2, its 2 values of digits 2 (q % 2) and + 1; S = 4: rows g and g + 8, segment w, 4
// values in lanes with q / 2 = w % 2, none in the others) times the block's weight scale and x's
// digit factors into its sums y of the tile. When its next unit is another tile's, and at the end
// of the page, the warpgroup flushes: the 4 lanes of a row add up theirs, each warp leaves its
// row sums in the warpgroup's stage (tile_stage), and after the warpgroup's barrier warp 0 adds
// the four in warp order to the warpgroup's own sums (tile_sums), which the task adds up in
// warpgroup order at its end. So every row's sum is added in one order, the same bits every run;
// float atomicAdd on shared memory (a compare-and-swap loop, 4 warps on the same rows) made no
// order and cost ~9 us a layer of qwen3-32b (docs/performance.md, session 28). Whole units
// rather than (unit, block) items in turn: a warp flushes half as often and walks half the
// items, and a page's compute fell from 2.2 to 1.5 us (H200, llama-3.1-8b gate/up pages of 4
// units, docs/performance.md), under the ~1.7 us its bytes take to arrive.
// A MoE down task's units come piece by piece (copy_pieces), each piece over its own digits;
// finding a unit's piece costs divisions, which only such a task pays (in every unit of every
// tile task they had made a page ~0.4 us longer).
static_assert(GROUP_WARPS % 4 == 0, "a page group is whole warpgroups");
// The sums of a thread's D values d[4 U] .. d[4 U + 3] that lie in its rows' own segment (see
// tile_pages), digit factors f0 (even v) and f1 (odd v) applied.
template <int S, int U, int ND, int ROWS>
__device__ __forceinline__ void fold_segment(const float (&d)[ND], float (&sum)[ROWS], int q, int w, float f0,
                                             float f1) {
  if constexpr (S == 8) {
    const float e0 = d[4 * U], e1 = d[4 * U + 1], e2 = d[4 * U + 2], e3 = d[4 * U + 3];
    sum[0] = (q & 2 ? e2 : e0) * f0 + (q & 2 ? e3 : e1) * f1;
  } else if constexpr (U < 2) {  // S = 4: U = w / 2
    if ((q >> 1) == (w & 1)) {
      sum[0] = d[4 * U] * f0 + d[4 * U + 1] * f1;
      sum[1] = d[4 * U + 2] * f0 + d[4 * U + 3] * f1;
    }
  }
}
template <int S>
__device__ void tile_pages(const Params& p, Shared& s, const int* t, int task_units, int rb, int rpp, int halves,
                           uint32_t& consumed, int lane, int group, int gw) {
  constexpr int N = TILE_DIGITS * S, R = TILE_M / S, ROWS = S == 8 ? 1 : 2, CHUNK = 16 * N;  // CHUNK: B's 16 columns
  const int kp = tile_k(t), C = unit_cols(t), kseg = kp / S, per_tile = kseg >> unit_shift(t);
  const int blocks = C / FP8_BLOCK_COLS, per_segment = kseg / FP8_BLOCK_COLS, per_piece = kp / FP8_BLOCK_COLS;
  const int units = piece_units(t);  // a piece's units of the task (all of them in one piece)
  const Divisor by_piece(units), by_tile(per_tile);  // a unit's piece and tile (below)
  const int wg = gw / 4, w = gw % 4, g = lane >> 2, q = lane & 3, j = S == 8 ? 2 * w + q / 2 : w;
  const float f0 = q & 1 ? 0x1p-8f : 1.f, f1 = f0 * 0x1p-4f;  // 2^(-4 t) of digits 2 (q % 2), + 1
  const uint8_t* xb = reinterpret_cast<const uint8_t*>(s.vec);
  const float* factor = s.vec + t[F_K];
  const int sums_n = (t[F_ROW1] - t[F_ROW0]) * halves, wgi = (group * GROUP_WARPS + gw) / 4;
  float* sums = tile_sums(s, sums_n, wgi);
  int parity = 0;
  const auto flush = [&](int tile, float (&y)[ROWS]) {  // warpgroup-uniform
    float* stage = tile_stage(s, wgi, parity);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      y[r] += __shfl_xor_sync(0xffffffffu, y[r], 1);
      y[r] += __shfl_xor_sync(0xffffffffu, y[r], 2);
      if (q == 0) stage[w * TILE_STAGE_ROWS + g + 8 * r] = y[r];
      y[r] = 0.f;
    }
    warpgroup_sync(wgi);
    // warp 0 reads this stage before it reaches the next flush's barrier, which every warp
    // passes before it writes this stage again (two flushes on)
    if (w == 0 && q == 0)
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const int at = g + 8 * r;
        sums[(tile / halves * R + at) * halves + tile % halves] +=
            ((stage[at] + stage[TILE_STAGE_ROWS + at]) + stage[2 * TILE_STAGE_ROWS + at]) + stage[3 * TILE_STAGE_ROWS + at];
      }
    parity ^= 1;
  };
  // The page is released once the warpgroup's last wgmma on it is done and its last scale read,
  // before that unit's fold and the flushes, which read only registers and s.vec: with 2 ring
  // pages, a page's slot is otherwise not refilled while it is computed.
  for_each_page<true>(p, s, task_units, rpp, group, consumed, [&](const uint8_t* page, int u0, int n, int slot) {
    float y[ROWS] = {};
    int tile = -1;
    // a warpgroup takes a run of the page's units, so that a tile's units (3 of 8 on a page of
    // K = 1536 tiles) mostly go to one warpgroup: fewer flushes, and fewer warpgroups adding
    // to the same rows at once
    constexpr int WG = GROUP_WARPS / 4;
    const int run = (n + WG - 1) / WG, last = min(n, (wg + 1) * run) - 1;  // the warpgroup's last unit
    if (last < wg * run) release_page(s, slot);  // no unit of the page
    for (int i = wg * run; i <= last; ++i) {
      const int piece = by_piece(u0 + i), pu = u0 + i - piece * units;  // pu: the unit's index among its piece's
      const int unit_tile = by_tile(pu), part = pu - unit_tile * per_tile;
      if (unit_tile != tile) {
        if (tile >= 0) flush(tile, y);
        tile = unit_tile;
      }
      const uint8_t* xp = xb + piece * TILE_DIGITS * kp;  // the piece's digits (stage_digits)
      const uint8_t* unit = page + i * rb;  // columns [part C, part C + C) of every segment
      const float* scale = reinterpret_cast<const float*>(unit + TILE_M * C);
      for (int b = 0; b < blocks; ++b) {
        float d[N / 2];
        wgmma_fence();
#pragma unroll
        for (int k32 = 0; k32 < 4; ++k32) {
          const int step = 4 * b + k32;
          Wgmma<N>::mma(d, smem_desc(unit + step * 2048, 1024, 128),
                        smem_desc(xp + (part * C / 32 + step) * 2 * CHUNK, CHUNK, 128), k32);
        }
        wgmma_commit();
        wgmma_wait_all();
        const float f = scale[j * blocks + b] * factor[piece * per_piece + j * per_segment + part * blocks + b];
        if (i == last && b == blocks - 1) release_page(s, slot);
        // d[v]: row 16 w + g + 8 (v % 4 / 2), column 8 (v / 4) + 2 q + v % 2, in the row's own
        // segment where column / 4 = row / R: S = 8, v = 4 w + (q & 2) and the next; S = 4, v =
        // 4 (w / 2) .. + 3 where q / 2 = w % 2. A switch on the warp's part names them with
        // constant indices (one that varies, even by warp, would put d in local memory).
        float sum[ROWS] = {};
        switch (S == 8 ? w : w / 2) {
          case 0: fold_segment<S, 0, N / 2, ROWS>(d, sum, q, w, f0, f1); break;
          case 1: fold_segment<S, 1, N / 2, ROWS>(d, sum, q, w, f0, f1); break;
          case 2: fold_segment<S, 2, N / 2, ROWS>(d, sum, q, w, f0, f1); break;
          default: fold_segment<S, 3, N / 2, ROWS>(d, sum, q, w, f0, f1); break;
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) y[r] = fmaf(f, sum[r], y[r]);
      }
    }
    if (tile >= 0) flush(tile, y);
  });
}

// A tile task's input staged (ready digits copied in, or converted: stage_digits) and its pages
// run; then the warpgroups' sums added up in warpgroup order (tile_pages).
__device__ __forceinline__ void tile_task(const Params& p, Shared& s, const int* t, uint32_t& consumed, int ct) {
  const int units = stream_rows(t), rb = t[F_ROW_BYTES], rpp = rows_per_page(t), halves = row_halves(t);
  const int lane = ct & 31, warp = ct >> 5, group = warp / GROUP_WARPS, gw = warp % GROUP_WARPS;
#if READY_DIGITS
  if (t[F_DIGITS_IN] >= 0)
    stage_ready_digits(p, s, t, ct);
  else
#endif
    stage_digits(p, s, t, ct);
  if (tile_segments(tile_k(t)) == 8)
    tile_pages<8>(p, s, t, units, rb, rpp, halves, consumed, lane, group, gw);
  else
    tile_pages<4>(p, s, t, units, rb, rpp, halves, consumed, lane, group, gw);
  compute_sync();  // every warpgroup's sums are in
  const int sums_n = (t[F_ROW1] - t[F_ROW0]) * halves;
  for (int i = ct; i < sums_n; i += COMPUTE_WARPS * 32) {
    float v = s.acc[i];
    for (int k = 1; k < TILE_WARPGROUPS; ++k) v += tile_sums(s, sums_n, k)[i];
    s.acc[i] = v;
  }
}
#endif
