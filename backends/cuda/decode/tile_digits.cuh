// ---- FP8 tiles on the tensor cores (--tune fp8_mma=1) ----------------------------------------
#if FP8_MMA
// An FP8 tile task (WF_FP8_TILES; passes/tiling.py decides which, ir/fp8.py: pack_tiles packs
// them) multiplies its weights with wgmma, e4m3 in, f32 accumulation. Its rows of k columns are
// cut into S segments (tile_segments) and come in tiles of R = 64 / S rows of one matrix (a
// gate/up task: the rows' gate tile, then their up tile), so that a tile is A's 64 rows (m = R j
// + r: segment j of row r) over k / S columns. A tile streams as units of C columns of every
// segment (unit_cols), the values in core-matrix order, then the unit's S x C / 128 fp32 block
// scales (segment j's block b at j C / 128 + b: the tile's rows share one 128-row block). B is
// the input as TILE_DIGITS e4m3 digits per column (stage_digits), N = 4 S columns, so that
// D[m][4 j' + t] is row m's dot with digit t of segment j' of x; a row's sum takes its own
// segment's (j' = j).
constexpr int TILE_M = 64;
static_assert(FP8_BLOCK_COLS == 128, "a scale block is 4 k32 steps");
#endif  // FP8_MMA

#if FP8_MMA || (MLA && WEIGHT_FP8)  // MLA's FP8 head rows take x as digits too (matvec.cuh)
constexpr int TILE_DIGITS = 4;  // e4m3 digits of an input value
// Digits of x (stage_digits; MLA's head rows: head_rows_fp8): a block of columns (128, or a head
// row's scale block) with max |x| < 2^E scales to the 16-bit fixed point M = rint(|x| 2^(16 - E))
// (exact to 2^-17 of the block's largest |x|); digit t is nibble t of M, most significant first,
// with x's sign: an e4m3 byte whose value is n 2^-9 for nibble n, so that
// x = sum_t digit_t 2^(E + 5 - 4 t).
__device__ __forceinline__ int block_exponent(float amax) {  // the least E with amax < 2^E; a zero block: -100
  return max(((__float_as_int(amax) >> 23) & 0xff) - 126, -100);
}
// The scale 2^(16 - E) of a block's fixed point, and |x| at it: |x| up + 2^23 holds
// M = rint(|x| up) in its low 16 bits (0x4b00ffff: 2^23 + 0xffff, the largest M).
__device__ __forceinline__ float fixed_scale(int E) { return __int_as_float((127 + 16 - E) << 23); }
__device__ __forceinline__ uint32_t fixed_magnitude(float x, float up) {
  return min(__float_as_uint(fmaf(fabsf(x), up, 8388608.f)), 0x4b00ffffu);
}
// A block's factor: x = sum_t digit_t 2^(E + 5 - 4 t) (the fold's digit weights bring the t)
__device__ __forceinline__ float block_factor(int E) { return __int_as_float((127 + E + 5) << 23); }
// 4 columns x as 16-bit fixed-point magnitudes M, their nibbles a byte each (lo: nibbles 0
// and 2 of M0, then of M1 (M2, M3); hi: nibbles 1 and 3), and their signs (0xff or 0 a byte)
struct FixedColumns {
  uint32_t lo01, hi01, lo23, hi23, sign;
};
__device__ __forceinline__ FixedColumns fixed_columns(const float4& x, int E) {
  const float up = fixed_scale(E), v[4] = {x.x, x.y, x.z, x.w};
  uint32_t M[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) M[e] = fixed_magnitude(v[e], up);
  const uint32_t m01 = __byte_perm(M[0], M[1], 0x5410), m23 = __byte_perm(M[2], M[3], 0x5410);
  const uint32_t s01 = prmt(__float_as_uint(x.x), __float_as_uint(x.y), 0xfb);  // bytes 0, 1
  const uint32_t s23 = prmt(__float_as_uint(x.z), __float_as_uint(x.w), 0xfb);
  return {m01 & 0x0f0f0f0fu, (m01 >> 4) & 0x0f0f0f0fu, m23 & 0x0f0f0f0fu, (m23 >> 4) & 0x0f0f0f0fu,
          __byte_perm(s01, s23, 0x5410)};
}
// Digit n (nibble 3 - n of M, hi words for even n) of the 4 columns, signed: an e4m3 byte each
__device__ __forceinline__ uint32_t digit_word(const FixedColumns& f, int n) {
  const uint32_t word = prmt(n % 2 ? f.lo01 : f.hi01, n % 2 ? f.lo23 : f.hi23, n & 2 ? 0x6420 : 0x7531);
  return word | (f.sign & 0x80808080u);
}
#endif

#if FP8_MMA
// Stages an FP8 tile task's input as B, in place of stage_vector's fp32 copy (with the norm
// weight and 1/rms as there): per 16 columns of a segment (a chunk), 64 S bytes holding column
// n = 4 j + t (segment j's digit t) at 16 n, k in a row (K-major core matrices: a k32 step's B
// is 128 S bytes, its k halves 64 S bytes apart, groups of 8 columns 128 B apart); then each
// block's factor 2^(E + 5), times a MoE down piece's combine weight (k / 128 floats). A tile
// task's K (a piece's too) is a multiple of 512 (tiling.py: _fp8_tiles_fit): whole 4 blocks.
//
// Two passes, because a block's digits need its largest |x| first. The first copies x from L2
// (cp.async: every copy of the task in flight at once, no registers held), each chunk's 64
// bytes where that chunk's digits go (a chunk's digits take as many bytes as its fp32 values),
// and a normed task's norm weight past the factors (passes/residency.py leaves room). The
// second converts the chunks in place: a warp takes STAGE_BLOCKS blocks at a time (those of 4
// consecutive segments at one column offset), 8 lanes a block and a lane a chunk, times the
// norm weight, the block's largest |x| in 3 shuffles. (Loading, reducing and converting a round
// at a time waited for L2 once per round: 7.3 us at qwen3-32b's down, K = 25600, 4 rounds,
// against stage_vector's 2.4; tools/stream_probe.py, docs/performance.md.) A lane reads its
// chunk's 16-byte quarters in a rotated order, so that the 8 lanes of a quarter-warp read 8
// different bank groups (two segments of different parity x 4 quarters); its digit words go
// to the same 8 banks a store (4-way conflicts: rotating the digits too, which spreads them
// over 32, cost registers that made the DeepSeek-V3.2 kernels spill).
#if FFN_SPLIT_K  // its tasks read x as stored (unweighted); a fixed-point input needs converting
#error "split-K FFNs take bf16 weights (passes/fusion.py), never FP8 tiles"
#endif
constexpr int STAGE_BLOCKS = 4;
__device__ void stage_digits(const Params& p, Shared& s, const int* t, int ct) {
  const int k = t[F_K], kp = tile_k(t), sbits = tile_shift(kp), S = tile_segments(kp), blocks = k / FP8_BLOCK_COLS;
  const int per_piece = kp / FP8_BLOCK_COLS, kseg = kp >> sbits;
  const int chunks = kp / 16;  // chunk records of a piece
  const bool norm = normed(t);
  const TaskInput in = task_input(p, t);
  const float4* __restrict__ gamma = reinterpret_cast<const float4*>(p.act + t[F_AUX]);
  uint8_t* __restrict__ b = reinterpret_cast<uint8_t*>(s.vec);
  float* __restrict__ factor = s.vec + k;
  float4* __restrict__ gamma_s = reinterpret_cast<float4*>(factor + blocks);
  // pass 1: thread ct copies B's 16-byte quarters ct, ct + NT, ... (quarter q of the chunk at
  // 64 (chunk S + j) of its piece: columns 16 chunk + 4 q of segment j), and the norm weight's;
  // from one quarter to the thread's next the chunk moves on by NT / 4 / S in the same segment
  // (a piece's chunks are whole 32s), or past the piece's end into the next piece's
  static_assert(COMPUTE_WARPS * 32 / 4 % 8 == 0, "a thread's quarters keep their segment");
  const int q = ct & 3, j = (ct >> 2) & (S - 1);
  int piece = 0, r = ct >> 2;  // the quarter's chunk record (chunk S + j) within its piece
  for (; r >= chunks; r -= chunks) ++piece;
  for (int f = ct; f < k / 4; f += COMPUTE_WARPS * 32) {
    const int col = piece * kp + j * kseg + (r >> sbits) * 16 + 4 * q;
    cp_async16(b + 16 * f, in.source(col / 4));
    if (norm) cp_async16(gamma_s + f, gamma + f);
    for (r += COMPUTE_WARPS * 32 / 4; r >= chunks; r -= chunks) ++piece;
  }
  // (a MoE down task's combine weight: the piece's factors carry it, one load a block, while
  // the copies are in flight)
  for (int blk = ct; blk < blocks; blk += COMPUTE_WARPS * 32)
    factor[blk] = in.pending_weight(blk * (FP8_BLOCK_COLS / 4));
  cp_async_wait_all();
  compute_sync();
  // pass 2: a piece's blocks taken in the order (column offset, segment), so that a warp's 4
  // blocks of a round lie in 4 consecutive segments; lane bs takes the round's block bs, c is
  // the lane's chunk of it, whose quarter (u + bs / 2 + 2 c) % 4 is the lane's u-th
  const int warp = ct >> 5, lane = ct & 31, bs = lane & 3, c = lane >> 2;
  const auto quarter = [&](int u) { return (u + (bs >> 1) + 2 * c) & 3; };
  float ss = 0.f;
  // the block's piece and place in that order (segment o % S, column offset o / S), moving on
  // as pass 1's chunk records do
  int bpiece = 0, o = STAGE_BLOCKS * warp + bs;
  for (; o >= per_piece; o -= per_piece) ++bpiece;
  for (int first = STAGE_BLOCKS * warp; first < blocks; first += STAGE_BLOCKS * COMPUTE_WARPS) {
    const int jb = o & (S - 1), chunk = (o >> sbits) * 8 + c, col = bpiece * kp + jb * kseg + chunk * 16;
    const struct {
      uint8_t* at;  // the chunk's fp32 values, then its digits
      int blk, i;   // its block; its first 4 columns' index
    } ch{b + bpiece * TILE_DIGITS * kp + (chunk * S + jb) * 16 * TILE_DIGITS, col / FP8_BLOCK_COLS, col / 4};
    for (o += STAGE_BLOCKS * COMPUTE_WARPS; o >= per_piece; o -= per_piece) ++bpiece;
    float4 a[4];
    float m = 0.f;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      a[u] = *reinterpret_cast<const float4*>(ch.at + 16 * quarter(u));
      if (norm) {  // (a task without a norm has no use for the sum of squares)
        ss += a[u].x * a[u].x + a[u].y * a[u].y + a[u].z * a[u].z + a[u].w * a[u].w;
        const float4 g = gamma_s[ch.i + quarter(u)];
        a[u].x *= g.x; a[u].y *= g.y; a[u].z *= g.z; a[u].w *= g.w;
      }
      m = fmaxf(m, fmaxf(fmaxf(fabsf(a[u].x), fabsf(a[u].y)), fmaxf(fabsf(a[u].z), fabsf(a[u].w))));
    }
#pragma unroll
    for (int x = 4; x < 32; x <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, x));
    const int E = block_exponent(m);
    // every read of the chunk came first: its digits overwrite it
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const FixedColumns f = fixed_columns(a[u], E);
#pragma unroll
      for (int n = 0; n < TILE_DIGITS; ++n)
        *reinterpret_cast<uint32_t*>(ch.at + 16 * n + 4 * quarter(u)) = digit_word(f, n);
    }
    if (c == 0) factor[ch.blk] *= block_factor(E);
  }
  fence_proxy_async_shared();
  end_staging(s, t, ss, ct);
}
#endif  // FP8_MMA
