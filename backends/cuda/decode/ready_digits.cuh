// ---- Ready digits (passes/digits.py) ---------------------------------------------------------
#if FP8_MMA && READY_DIGITS
// A producer of an FP8 tile task's input writes that input's digits for its own rows, in
// stage_digits' layout, each group of DIGIT_GROUP rows with its own exponent E = 4 q, the least
// multiple of 4 above its largest |x| (a block's groups come from several tasks, none of which
// knows the block's largest |x|); beside them q as an int8 per group and, for a normalizing
// consumer, each group's sum of squares. The consumer copies them in and aligns each block's
// groups on its largest q by whole digits (stage_ready_digits). The buffer: 4 k digit bytes,
// k / 8 exponents, (k / 8 sums).
constexpr int DIGIT_GROUP = 8;

// Where digit 0 of column c of a one-piece tile input of k columns lies (stage_digits' layout:
// a chunk of 16 columns of a segment is 64 bytes, its digit n 16 bytes, n 16 bytes on).
__device__ __forceinline__ int digit_byte(int k, int c) {
  const int S = tile_segments(k), kseg = k >> tile_shift(k), j = c / kseg, o = c - j * kseg;
  return ((o >> 4) * S + j) * 64 + (o & 15);
}

// A producer's rows as its consumer's digits, after its epilogue left each row's value y in
// s.acc[i * halves]. A lane a row, its rows placed so that a chunk's 16 columns are a
// half-warp's lanes: a group meets by shuffles on its exponent, and a chunk the task holds
// whole is written as its 64 bytes, a word a lane (whole 32-byte sectors: L2 merges no partial
// ones); a chunk shared with the neighbouring task (at most one at each end) a byte at a time.
// `gamma0`: the consumer's norm weight of this thread's first row, loaded with the residual so
// that the tail waits for no load (digit_first_row says which row that is).
__device__ __forceinline__ int digit_first_row(const int* t, int ct) { return ct - (t[F_ROW0] & 15); }
__device__ void put_ready_digits(const Params& p, Shared& s, const int* t, int rows, int halves, float gamma0,
                                 int ct) {
  constexpr int NT = COMPUTE_WARPS * 32;
  compute_sync();
  const int k = t[F_DIGITS_K], row0 = t[F_ROW0], lane = ct & 31, e = lane & 15;
  uint8_t* __restrict__ digits = reinterpret_cast<uint8_t*>(p.act + t[F_DIGITS_OUT]);
  int8_t* __restrict__ exps = reinterpret_cast<int8_t*>(digits + 4 * k);
  float* __restrict__ sums = reinterpret_cast<float*>(exps + k / DIGIT_GROUP);
  const bool norm = t[F_DIGITS_GAMMA] >= 0;
  for (int i = digit_first_row(t, ct); i - lane < rows; i += NT) {  // warp-uniform
    const bool mine = i >= 0 && i < rows;
    const float y = mine ? s.acc[i * halves] : 0.f;
    const float v = norm && mine ? y * (i == digit_first_row(t, ct) ? gamma0 : p.act[t[F_DIGITS_GAMMA] + row0 + i]) : y;
    float m = fabsf(v), ss = y * y;
#pragma unroll
    for (int x = 1; x < DIGIT_GROUP; x <<= 1) {
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, x));
      ss += __shfl_xor_sync(0xffffffffu, ss, x);
    }
    const int q = (block_exponent(m) + 3) >> 2, c = row0 + i, chunk = c - e;
    const uint32_t M = fixed_magnitude(v, fixed_scale(4 * q));
    const uint32_t sign = __float_as_uint(v) >> 31 << 7;
    uint32_t mine4 = 0;  // byte n: this column's digit n
#pragma unroll
    for (int n = 0; n < TILE_DIGITS; ++n) mine4 |= ((M >> (12 - 4 * n) & 15) | sign) << (8 * n);
    // lane e's word of the chunk: digit e / 4 of columns 4 (e % 4) .. + 3
    uint32_t word = 0;
#pragma unroll
    for (int u = 0; u < 4; ++u)
      word |= (__shfl_sync(0xffffffffu, mine4, (lane & 16) + 4 * (e & 3) + u) >> (8 * (e >> 2)) & 0xff) << (8 * u);
    uint8_t* at = digits + digit_byte(k, chunk);
    if (chunk >= row0 && chunk + 16 <= row0 + rows) {
      __stcg(reinterpret_cast<uint32_t*>(at) + e, word);
    } else if (mine) {
#pragma unroll
      for (int n = 0; n < TILE_DIGITS; ++n) __stcg(at + 16 * n + e, static_cast<uint8_t>(mine4 >> (8 * n)));
    }
    if (mine && c % DIGIT_GROUP == 0) {
      __stcg(exps + c / DIGIT_GROUP, static_cast<int8_t>(q));
      if (norm) __stcg(sums + c / DIGIT_GROUP, ss);
    }
  }
}

// Stages a ready-digit task's input: its digits, the groups' exponents and (normed) sums of
// squares copied in (one round trip); then a lane a group, the 16 lanes of a 128-column block
// meeting by shuffles on the block's largest q: a group below it moves down by q_block - q
// digits (the lowest dropped), and the block's factor is 2^(4 q_block + 5), as stage_digits'
// 2^(E + 5). A warp takes two blocks at one column offset of neighbouring segments, and a lane
// visits its group's digits from digit (its chunk's index) % 4 on, so that the 8-byte accesses
// of a warp fall in distinct banks.
__device__ void stage_ready_digits(const Params& p, Shared& s, const int* t, int ct) {
  constexpr int NT = COMPUTE_WARPS * 32, PER_BLOCK = FP8_BLOCK_COLS / DIGIT_GROUP;
  const int k = t[F_K], groups = k / DIGIT_GROUP, digits16 = k / 4, S = tile_segments(k), kseg = k >> tile_shift(k);
  const bool norm = normed(t);
  const uint8_t* __restrict__ src = reinterpret_cast<const uint8_t*>(p.act + t[F_DIGITS_IN]);
  uint8_t* __restrict__ b = reinterpret_cast<uint8_t*>(s.vec);
  float* __restrict__ factor = s.vec + k;
  uint8_t* __restrict__ side = reinterpret_cast<uint8_t*>(factor + k / FP8_BLOCK_COLS);  // exponents, sums
  for (int f = ct; f < digits16 + groups * (norm ? 5 : 1) / 16; f += NT)
    cp_async16(f < digits16 ? b + 16 * f : side + 16 * (f - digits16), src + 16 * f);
  cp_async_wait_all();
  compute_sync();
  const int8_t* exps = reinterpret_cast<const int8_t*>(side);
  const int warp = ct >> 5, lane = ct & 31, gi = lane & 15, h = gi & 1, r = (gi >> 1) & 3;
  // the pairs of blocks (offset-major): pair w + COMPUTE_WARPS n is at segments j, j + 1 with
  // j = 2 w % S for every n, its offset moving on by 2 COMPUTE_WARPS / S blocks
  static_assert(2 * COMPUTE_WARPS % 8 == 0, "a warp's segments stay");
  const int j = (2 * warp) % S + (lane >> 4);
  float ss = 0.f;
  for (int pair = warp; pair < k / (2 * FP8_BLOCK_COLS); pair += COMPUTE_WARPS) {  // warp-uniform
    const int o = 2 * pair / S * FP8_BLOCK_COLS + DIGIT_GROUP * gi, g = (j * kseg + o) / DIGIT_GROUP;
    const int q = exps[g];
    int top = q;
#pragma unroll
    for (int x = 1; x < PER_BLOCK; x <<= 1) top = max(top, __shfl_xor_sync(0xffffffffu, top, x));
    if (const int shift = top - q) {
      uint8_t* at = b + ((o >> 4) * S + j) * 64 + 8 * h;
      unsigned long long d[TILE_DIGITS];  // d[u]: digit (u + r) % 4
#pragma unroll
      for (int u = 0; u < TILE_DIGITS; ++u) d[u] = *reinterpret_cast<const unsigned long long*>(at + 16 * ((u + r) & 3));
#pragma unroll
      for (int u = 0; u < TILE_DIGITS; ++u) {  // digit n = (u + r) % 4 takes digit n - shift
        const int n = (u + r) & 3;
        unsigned long long moved = 0;
#pragma unroll
        for (int from = 0; from < TILE_DIGITS; ++from) moved = n >= shift && ((from + r) & 3) == n - shift ? d[from] : moved;
        *reinterpret_cast<unsigned long long*>(at + 16 * n) = moved;
      }
    }
    if (gi == 0) factor[g / PER_BLOCK] = block_factor(4 * top);
    if (norm) ss += reinterpret_cast<const float*>(exps + groups)[g];
  }
  fence_proxy_async_shared();
  end_staging(s, t, ss, ct);
}
#endif
