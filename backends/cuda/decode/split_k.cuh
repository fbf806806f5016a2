// ---- compute: a dense MLP as one split-K op (passes/fusion.py: _fuse_split_k) ---------------
#if FFN_SPLIT_K
// Task [row0, row1) owns that slice of the intermediate dimension: it stages the RMS-normalized
// input as a norm_matvec does, streams its slice's gate/up pairs (matvec_pages), leaves
// h = silu(g) * u of the slice in shared memory, then streams W_down's columns of the slice as
// F_K rows of `width` values and adds each row's dot product with h into the output, a
// fixed-point sum whose start value the op before wrote (red.add of integers: the same bits in
// any order). A down row is whole 16-byte pieces (8 bf16); SPLIT_K_LANES lanes share a row, so a
// warp takes 32 / SPLIT_K_LANES rows at a time.
__device__ __forceinline__ int split_k_lanes(int pieces) {
  int lanes = 1;
  while (lanes < pieces && lanes < 32) lanes *= 2;
  return lanes;
}

__device__ void split_k_down(const Params& p, Shared& s, const int* t, uint32_t& consumed, int ct) {
  const int warp = ct >> 5, lane = ct & 31, group = warp / GROUP_WARPS, gw = warp % GROUP_WARPS;
  const int width = t[F_ROW1] - t[F_ROW0], rb = 2 * width, rpp = PAGE_BYTES / rb, rows = t[F_K];
  const int pieces = width / 8, lanes = split_k_lanes(pieces), sub = lane % lanes;
  const int per_warp = 32 / lanes, step_rows = GROUP_WARPS * per_warp;
  const float4* h = reinterpret_cast<const float4*>(s.vec);
  long long* out = reinterpret_cast<long long*>(p.act + t[F_OUT]);
  for_each_page(p, s, rows, rpp, group, consumed, [&](const uint8_t* page, int r, int n) {
    for (int base = gw * per_warp; base < n; base += step_rows) {  // warp-uniform: shuffles below
      const int rr = base + lane / lanes;
      float y = 0.f;
      if (rr < n)
        for (int q = sub; q < pieces; q += lanes) {
          const uint4 w = *reinterpret_cast<const uint4*>(page + rr * rb + q * 16);
          y = Bf16Row::dot(make_uint2(w.x, w.y), h[2 * q], y);
          y = Bf16Row::dot(make_uint2(w.z, w.w), h[2 * q + 1], y);
        }
      for (int o = lanes / 2; o > 0; o >>= 1) y += __shfl_xor_sync(0xffffffffu, y, o);
      if (sub == 0 && rr < n) red_add_s64(out + r + rr, to_fixed(y));
    }
  });
}

__device__ void run_split_k(const Params& p, Shared& s, const int* t, uint32_t& consumed, int ct) {
  const int warp = ct >> 5, lane = ct & 31, group = warp / GROUP_WARPS, gw = warp % GROUP_WARPS;
  const int width = t[F_ROW1] - t[F_ROW0];
  for (int i = ct; i < 2 * width; i += NT) s.acc[i] = 0.f;
  stage_vector(p, s, t, ct);  // normed: x * gamma staged, 1/rms in s.red; ends with a barrier
  matvec_pages<false>(p, s, t, width, t[F_ROW_BYTES], rows_per_page(t), t[F_K] / 8, 2, consumed, lane, group, gw);
  compute_sync();  // every gate/up sum is in s.acc, and no warp reads the staged input any more
  const float rstd = s.red[COMPUTE_WARPS];
  for (int i = ct; i < width; i += NT) {  // as run_matvec's silu_mul epilogue
    const float g = s.acc[2 * i] * rstd;
    s.vec[i] = g / (1.f + __expf(-g)) * s.acc[2 * i + 1] * rstd;
  }
  compute_sync();
  split_k_down(p, s, t, consumed, ct);
}
#endif  // FFN_SPLIT_K
