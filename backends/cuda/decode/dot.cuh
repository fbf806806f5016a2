// ---- compute: a row's dot product with the staged input --------------------------------
// The loop every row format shares: a segment's 4-column groups [2 begin, 2 end) of N rows of
// one format (a row, or an FP8 gate/up row's two halves), lane l taking groups l, l + 32, ...,
// so that a warp's loads are contiguous (for bf16: 256 B of weights and 512 B of x; a lane
// reading a whole 16-byte piece would read x at a 32-byte stride, twice the shared-memory
// wavefronts). Four groups at a time, loads first, into four independent sums per row, so that
// a page's time on the compute warps (part of its ring slot's time) is short. The N rows share
// each load of x (16 bytes of shared memory per 4 weights: for an FP8 row 4x its weight bytes,
// most of its shared-memory traffic). A row's sums are the ones N = 1 computes, from the same
// groups in the same order, so its result does not depend on N. `Row` says how a group's
// weights are loaded (`load`) and multiplied with 4 inputs (`dot`); y[n] is row n's warp sum.
template <class Row, int N>
__device__ __forceinline__ void dot_groups(const Row (&row)[N], const float* x, int begin, int end, int lane,
                                           float (&y)[N]) {
  static_assert(N == 1 || N == 2, "a row or a pair of rows");
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float acc[4 * N] = {};  // row n's four sums: acc[4 n], ..., acc[4 n + 3]
  int i = 2 * begin + lane;
  const int stop = 2 * end;
  for (; i + 96 < stop; i += 128) {
    typename Row::Group q[N][4];
    float4 a[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
#pragma unroll
      for (int n = 0; n < N; ++n) q[n][u] = row[n].load(i + 32 * u);
      a[u] = x4[i + 32 * u];
    }
#pragma unroll
    for (int j = 0; j < 4 * N; ++j) acc[j] = Row::dot(q[j / 4][j % 4], a[j % 4], acc[j]);
  }
  for (; i < stop; i += 32) {
#pragma unroll
    for (int n = 0; n < N; ++n) acc[4 * n] = Row::dot(row[n].load(i), x4[i], acc[4 * n]);
  }
  const auto sum = [&](int n) { return (acc[4 * n] + acc[4 * n + 1]) + (acc[4 * n + 2] + acc[4 * n + 3]); };
  // spelled out, not a loop over n: that loop around warp_sum's own changed the one-row
  // kernels' machine code elsewhere (nvcc 13 unrolls the kernel's other loops differently)
  y[0] = warp_sum(sum(0));
  if (N == 2) y[N - 1] = warp_sum(sum(N - 1));
}

// dot_groups of one row.
template <class Row>
__device__ __forceinline__ float dot_row(const Row& row, const float* x, int begin, int end, int lane) {
  const Row rows[1] = {row};
  float y[1];
  dot_groups(rows, x, begin, end, lane, y);
  return y[0];
}

// A bf16 row: a group is 4 weights, 8 bytes.
struct Bf16Row {
  using Group = uint2;
  const uint2* w;
  __device__ __forceinline__ Group load(int i) const { return w[i]; }
  __device__ __forceinline__ static float dot(const Group q, const float4 a, float acc) {
    const float2 w0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&q.x));
    const float2 w1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&q.y));
    acc = fmaf(w0.x, a.x, acc); acc = fmaf(w0.y, a.y, acc);
    acc = fmaf(w1.x, a.z, acc); acc = fmaf(w1.y, a.w, acc);
    return acc;
  }
};

// Partial dot product of 16-byte pieces [begin, end) of a bf16 row with the fp32 vector x.
__device__ __forceinline__ float dot_segment(const uint4* w, const float* x, int begin, int end, int lane) {
  return dot_row(Bf16Row{reinterpret_cast<const uint2*>(w)}, x, begin, end, lane);
}

#if MOE && TP > 1
// Expert parallelism: the slots of a routed task that hold an expert of this rank (they come
// first: route_local); a gate/up task's one slot, or a down task's every slot.
__device__ __forceinline__ int busy_slots(const Params& p, const int* t) {
  const int* ids = reinterpret_cast<const int*>(p.act + t[F_IDS]) + t[F_SLOT0];
  int n = 0;
  for (int j = 0; j < t[F_SLOTS]; ++j) n += __ldcg(ids + j) >= 0;
  return n;
}

// dot_segment over [begin, end) without the groups [skip0, skip1) (a down row's pieces that
// were not loaded).
__device__ __forceinline__ float dot_skipping(const uint4* w, const float* x, int begin, int end, int skip0,
                                              int skip1, int lane) {
  float y = 0.f;
  if (begin < min(end, skip0)) y += dot_segment(w, x, begin, min(end, skip0), lane);
  if (max(begin, skip1) < end) y += dot_segment(w, x, max(begin, skip1), end, lane);
  return y;
}
#endif

#if WEIGHT_FP8
// FP8 rows (ir/fp8.py: packed_row_bytes): k e4m3 bytes, then one fp32 scale per FP8_BLOCK_COLS
// columns (the row's block row of weight_scale_inv; a q absorption row's: per fewer columns),
// padded to 16 bytes.
static_assert(FP8_BLOCK_COLS % 4 == 0 && ((FP8_BLOCK_COLS / 4) & (FP8_BLOCK_COLS / 4 - 1)) == 0,
              "a lane's 4 columns must lie in one scale block, found by a shift");
constexpr int log2_exact(int n) { return n > 1 ? 1 + log2_exact(n / 2) : 0; }

// Two e4m3 values (the low byte first) as floats, through f16x2 in one instruction (exact: every
// e4m3 value is an f16 value).
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t pair) {
  return __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), __NV_E4M3)));
}

// An FP8 row of k columns: a group is 4 e4m3 weights (4 bytes) and the scale of their block.
// The pairs convert to f16x2 in one instruction, exactly (every e4m3 value is an f16 value); the
// block scale multiplies the 4-term sum, not each weight. A warp's lanes read at most two block scales.
struct Fp8Row {
  // log2 of the 4-column groups one scale covers: FP8_BLOCK_COLS / 4 (a power of two), or fewer
  // in a row derived from a checkpoint weight (scale_shift)
  static constexpr int BLOCK_SHIFT = log2_exact(FP8_BLOCK_COLS / 4);
  struct Group {
    uint32_t q;
    float scale;
  };
  const uint32_t* w;
  const float* scale;
  int scale_shift;
  // the packed row at `row`: k e4m3 values, then its scales
  __device__ __forceinline__ static Fp8Row at(const uint8_t* row, int k, int scale_shift) {
    return {reinterpret_cast<const uint32_t*>(row), reinterpret_cast<const float*>(row + k), scale_shift};
  }
  __device__ __forceinline__ Group load(int i) const { return {w[i], scale[i >> scale_shift]}; }
  __device__ __forceinline__ static float dot(const Group g, const float4 a, float acc) {
    const float2 w0 = e4m3x2_to_float2(g.q & 0xffffu), w1 = e4m3x2_to_float2(g.q >> 16);
    float d = w0.x * a.x;
    d = fmaf(w0.y, a.y, d);
    d = fmaf(w1.x, a.z, d);
    d = fmaf(w1.y, a.w, d);
    return fmaf(d, g.scale, acc);
  }
};

// dot_segment for an FP8 row of k columns: the same 8-column groups [begin, end). Its scales
// cover FP8_BLOCK_COLS columns each, or 4 << scale_shift (MLA's q absorption, whose rows run
// down kv_b's blocks: ir/mla.py: derived_scale_cols).
__device__ __forceinline__ float dot_segment_fp8(const uint8_t* row, int k, const float* x, int begin, int end,
                                                 int lane, int scale_shift = Fp8Row::BLOCK_SHIFT) {
  return dot_row(Fp8Row::at(row, k, scale_shift), x, begin, end, lane);
}

// dot_segment_fp8 of a gate/up row's two FP8 halves of k columns, the up half `half_bytes` after
// the gate half, in one pass over x: y = {gate, up}, each bit for bit its dot_segment_fp8.
__device__ __forceinline__ void dot_segment_fp8_pair(const uint8_t* row, int half_bytes, int k, const float* x,
                                                     int begin, int end, int lane, int scale_shift, float (&y)[2]) {
  const Fp8Row rows[2] = {Fp8Row::at(row, k, scale_shift), Fp8Row::at(row + half_bytes, k, scale_shift)};
  dot_groups(rows, x, begin, end, lane, y);
}

// An FP8 routed down row (MoE): one piece per slot (a row of that slot's expert: its values, then
// its own scales) of piece_bytes, then shared_k8 > 0: the shared expert's piece (its values and
// scales) with shared_k8 groups of 8 columns; [begin, end) counts groups over the row's k8.
__device__ float dot_segment_fp8_pieces(const uint8_t* row, int slots, int piece_bytes, int k8, int shared_k8,
                                        const float* x, int begin, int end, int lane, int busy = 0) {
  const int pk8 = (k8 - shared_k8) / slots;
  float y = 0.f;
  for (int j = 0; j <= slots; ++j) {  // piece `slots`: the shared expert's (empty without one)
#if TP > 1  // pieces [busy, slots): slots without an expert of this rank, not loaded (busy_slots)
    if (j >= busy && j < slots) continue;
#endif
    const int p0 = j * pk8, p1 = j < slots ? p0 + pk8 : k8;
    const int lo = max(begin, p0), hi = min(end, p1);
    if (lo < hi) y += dot_segment_fp8(row + j * piece_bytes, 8 * (p1 - p0), x + 8 * p0, lo - p0, hi - p0, lane);
  }
  return y;
}

// A whole FP8 row of at most SHORT_ROW_GROUPS 4-column groups (a small model's projection, or an
// MLA head row that head_rows_fp8 cannot take: matvec.cuh) is all latency in dot_groups: a group
// or two a lane, then a warp sum. A warp takes SHORT_ROWS_PER_WARP of them at once instead,
// SHORT_ROW_LANES lanes a row (lane l of the row: groups l, l + SHORT_ROW_LANES, ..., in two
// sums), and sums over its row's lanes only; every lane gets its row's sum. A round of 4 groups
// is loaded before any is multiplied: a guard around each group's loads and sum made each group's
// loads wait for the previous group's sum (a q absorption page of 462 rows: ~3.4 us).
constexpr int SHORT_ROW_LANES = 8, SHORT_ROWS_PER_WARP = 32 / SHORT_ROW_LANES;
constexpr int SHORT_ROW_GROUPS = 8 * SHORT_ROW_LANES;  // 8 groups a lane at most: k <= 256
constexpr int SHORT_ROUND = 4;  // groups a lane loads at once (8: spills at 96 registers)
__device__ __forceinline__ float dot_short_row(const Fp8Row& row, const float* x, int groups, int sl) {
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float acc[2] = {0.f, 0.f};
#pragma unroll 1  // unrolled, the rounds spilled registers
  for (int u = 0; u < SHORT_ROW_GROUPS / SHORT_ROW_LANES; u += SHORT_ROUND) {
    if (u * SHORT_ROW_LANES >= groups) break;  // warp-uniform
    Fp8Row::Group q[SHORT_ROUND] = {};  // a group past the row: 0 x 0, which leaves the sum as it is
    float4 a[SHORT_ROUND] = {};
#pragma unroll
    for (int j = 0; j < SHORT_ROUND; ++j) {
      const int g = sl + (u + j) * SHORT_ROW_LANES;
      if (g < groups) {
        q[j] = row.load(g);
        a[j] = x4[g];
      }
    }
#pragma unroll
    for (int j = 0; j < SHORT_ROUND; ++j) acc[j & 1] = Fp8Row::dot(q[j], a[j], acc[j & 1]);  // u is even: group u + j's sum
  }
  float y = acc[0] + acc[1];
#pragma unroll
  for (int o = SHORT_ROW_LANES / 2; o > 0; o >>= 1) y += __shfl_xor_sync(0xffffffffu, y, o);
  return y;
}
#endif
