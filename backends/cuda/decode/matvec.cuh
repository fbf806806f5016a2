// ---- compute: a matrix-vector task's pages and epilogue (its input: staging.cuh) ----------------
#if MLA && WEIGHT_FP8
// A head_matvec's FP8 rows (MLA's q absorption, k = 128 or 192, and v expansion, k = 512: each
// head's rows read their own x) on the tensor cores in e4m3 (wgmma, A from registers), where the
// rows and their scale blocks are whole k32 steps (the last block may be partial) and a head has
// at least 64 rows: the weights go in as they lie in the page, and x as TILE_DIGITS e4m3 digits
// per column (tile_digits.cuh: x's 16-bit fixed point per scale block, as the FP8 tiles take
// it). On Hopper mma.sync with e4m3 operands is no tensor-core instruction: ptxas turns each
// m16n8k32 into 12 conversions to f16 (F2FP) and two f16 mma, and those conversions held a v
// expansion page (124 rows of k = 512) at ~2.3 us and a q absorption page (462 of k = 128) at
// ~3.4, where an FP8 tile page of as many bytes (wgmma) takes ~1.5 (H100, docs/performance.md,
// sessions 58-59). wgmma takes e4m3 as it is.
//
// The task's heads' digits go after their inputs as wgmma's B wants them, K-major core
// matrices: [k / 16][column][16 bytes], column 4 h + t digit t of head h, for the heads and one
// more of zeros (a tile in the last head reads its columns); then a factor 2^(E + 5) per head and
// block. A warpgroup takes an m-tile of 64 rows (with few m-tiles, half of its blocks, the halves
// added in s.acc), a warp its 16 rows' bytes as A; B is the 8 columns of the tile's first row's
// head and of the head after it (a tile spans at most two heads). A block's k32 steps go into D,
// whose columns (digits) a lane then weighs, times the row's scale and its head's factor, for the
// rows of the head its columns belong to.
__device__ __forceinline__ bool head_rows_on_mma(const int* t, int k8, int scale_shift) {
  const int k = 8 * k8, span = min(4 << scale_shift, k);  // a block may be wider than the row
  return t[F_OPCODE] == OP_HEAD_MATVEC && k % 32 == 0 && span % 32 == 0 && span <= 128 && t[F_HEAD_ROWS] >= 64;
}
__device__ void head_rows_fp8(const Params& p, Shared& s, const int* t, int rows, int rb, int rpp, int k8,
                              int scale_shift, uint32_t& consumed, int lane, int group, int gw) {
  const HeadInputs head_input = head_inputs(t);
  // span: a scale block, or the whole row where that is narrower, so that block b has scale b
  const int k = 8 * k8, span = min(4 << scale_shift, k), blocks = (k + span - 1) / span;
  const int g = lane >> 2, q = lane & 3, heads = head_input.head(rows - 1) + 1, cols = 4 * (heads + 1);
  uint8_t* digits = reinterpret_cast<uint8_t*>(s.vec + heads * k);
  float* factor = reinterpret_cast<float*>(digits + cols * k);  // [head][block]
  // a warp a (head, block) at a time, a lane 4 columns of it; the head past the last: zeros
  for (int item = group * GROUP_WARPS + gw; item < (heads + 1) * blocks; item += COMPUTE_WARPS) {
    const int h = item / blocks, c = item % blocks * span + 4 * lane;
    const bool mine = 4 * lane < span && c < k;
    const float4 x = mine && h < heads ? *reinterpret_cast<const float4*>(s.vec + h * k + c) : make_float4(0.f, 0.f, 0.f, 0.f);
    float m = fmaxf(fmaxf(fabsf(x.x), fabsf(x.y)), fmaxf(fabsf(x.z), fabsf(x.w)));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const int E = block_exponent(m);
    if (mine) {
      const FixedColumns f = fixed_columns(x, E);
#pragma unroll
      for (int n = 0; n < TILE_DIGITS; ++n)
        *reinterpret_cast<uint32_t*>(digits + (c / 16 * cols + 4 * h + n) * 16 + c % 16) = digit_word(f, n);
    }
    if (lane == 0) factor[item] = block_factor(E);
  }
  fence_proxy_async_shared();  // the digits (generic stores) before wgmma reads them (async proxy)
  compute_sync();
  // lane q's D columns 2q, 2q + 1: digits 2 (q % 2) and + 1 of head first + q / 2
  const float f0 = q & 1 ? 0x1p-8f : 1.f, f1 = f0 * 0x1p-4f;
  constexpr int WG = GROUP_WARPS / 4;  // warpgroups of a page group
  static_assert(GROUP_WARPS % 4 == 0, "a page group is whole warpgroups (wgmma)");
  const int wg = gw / 4, w = gw % 4;
  for_each_page(p, s, rows, rpp, group, consumed, [&](const uint8_t* page, int r, int n) {
    const int tiles = (n + 63) / 64, split = 2 * tiles <= WG && blocks % 2 == 0 ? 2 : 1;
    for (int item = wg; item < tiles * split; item += WG) {  // warpgroup-uniform
      const int t0 = 64 * (item / split), m0 = t0 + 16 * w, b0 = item % split * (blocks / split);
      const int i0 = min(m0 + g, n - 1), i1 = min(m0 + g + 8, n - 1);  // past the page: repeats, unstored
      const uint32_t* w0 = reinterpret_cast<const uint32_t*>(page + i0 * rb) + q;
      const uint32_t* w1 = reinterpret_cast<const uint32_t*>(page + i1 * rb) + q;
      const int first = head_input.head(r + t0);
      const uint8_t* b_cols = digits + 64 * first;  // columns 4 first .. + 7
      const float* xf = factor + (first + q / 2) * blocks;  // this lane's D columns' head
      float y[2] = {0.f, 0.f};  // rows g and g + 8
      for (int b = b0; b < b0 + blocks / split; ++b) {
        float d[4] = {0.f, 0.f, 0.f, 0.f};
        // a k32 step at a time: with two steps' A in registers at once the DeepSeek-V3.2 and
        // GLM-5 kernels spilled
        for (int j = 0; j < (min((b + 1) * span, k) - b * span) / 32; ++j) {
          const int at = b * span / 4 + 8 * j;  // the step's 8 words of a row
          const uint32_t a[4] = {w0[at], w1[at], w0[at + 4], w1[at + 4]};
          const uint8_t* chunk = b_cols + (b * span / 16 + 2 * j) * cols * 16;  // its k16 halves of B
          wgmma_fence();
          wgmma_m64n8k32_rs(d, a, smem_desc(chunk, cols * 16, 128), j);
          wgmma_commit();
          wgmma_wait_all();
        }
        const float s0 = reinterpret_cast<const float*>(page + i0 * rb + k)[b];
        const float s1 = reinterpret_cast<const float*>(page + i1 * rb + k)[b];
        y[0] = fmaf(fmaf(d[0], f0, d[1] * f1), s0 * xf[b], y[0]);
        y[1] = fmaf(fmaf(d[2], f0, d[3] * f1), s1 * xf[b], y[1]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // rows g and g + 8: the lanes of the row's own head
        const int i = m0 + g + 8 * h;
        float v = head_input.head(r + min(i, n - 1)) - first == q / 2 ? y[h] : 0.f;
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        if (q != 0 || i >= n) continue;
        if (split == 1) s.acc[r + i] = v;
        else atomicAdd(&s.acc[r + i], v);  // two halves add up alike in either order
      }
    }
  });
}
#endif

// The row sums of a matrix-vector task's `rows` rows (`halves` sums per row: gate/up pairs) from
// its weight pages, into s.acc; the input vector is staged. Consumes the task's pages. The
// caller derives the thread's lane, page group and warp in the group first thing in the task (in
// run_matvec that order gives the machine code it had before this loop was its own function).
// ENDS_TASK as for_each_page's.
template <bool ENDS_TASK = true>
__device__ __forceinline__ void matvec_pages(const Params& p, Shared& s, const int* t, int rows, int rb, int rpp,
                                             int k8, int halves, uint32_t& consumed, int lane, int group,
                                             int gw) {
#if WEIGHT_FP8
  const bool fp8 = t[F_W_FORMAT] == WF_FP8;
#if MLA  // a head_matvec's rows may have finer scales (F_SCALE_SHIFT)
  const int scale_shift = t[F_OPCODE] == OP_HEAD_MATVEC ? t[F_SCALE_SHIFT] : Fp8Row::BLOCK_SHIFT;
#else
  constexpr int scale_shift = Fp8Row::BLOCK_SHIFT;
#endif
#endif
#if MLA && WEIGHT_FP8
  if (fp8 && head_rows_on_mma(t, k8, scale_shift)) {
    head_rows_fp8(p, s, t, rows, rb, rpp, k8, scale_shift, consumed, lane, group, gw);
    return;
  }
#endif
  const int wpr = warps_per_row(min(rpp, rows)), seg = (k8 + wpr - 1) / wpr;
  const int begin = (gw % wpr) * seg, end = min(k8, begin + seg);
  // Every task field the page loop needs is read here (see HeadInputs).
#if MLA
  const HeadInputs head_input = head_inputs(t);
#endif
#if MOE  // a routed down row: `slots` pieces of piece_bytes, then the shared expert's
  const bool down = t[F_OPCODE] == OP_MOE_DOWN_ADD;
  const int slots = down ? t[F_SLOTS] : 1, piece_bytes = (rb - MOE_SHARED_BYTES) / slots;
#endif
#if MOE && TP > 1  // a down row's groups [skip0, skip1): the pieces of its slots without an expert here
  const int busy = down ? busy_slots(p, t) : 0, pk8 = down ? (k8 - MOE_SHARED_K / 8) / slots : 0;
  const int skip0 = down ? busy * pk8 : k8, skip1 = down ? slots * pk8 : k8;
#endif
#if WEIGHT_FP8
  // Whole FP8 rows are taken two at a time by a warp when a page has more rows than the group has
  // warps: a row's time is mostly latency (its loads, then a warp sum), which the pair's two rows
  // share; one at a time, a MLA q absorption row (k = 128) took ~0.4 µs of a warp's time. Not in
  // an MLA kernel: its FP8 rows (the head rows) run on the tensor cores (head_rows_fp8) but in odd
  // shapes, and the pairs' registers made the DeepSeek-V3.2 and GLM-5 kernels spill.
#if MOE
  const bool whole_rows = fp8 && halves == 1 && !down;
#else
  const bool whole_rows = fp8 && halves == 1;
#endif
  const bool short_rows = whole_rows && wpr == 1 && 2 * k8 <= SHORT_ROW_GROUPS;
#endif
  for_each_page<false, ENDS_TASK>(p, s, rows, rpp, group, consumed, [&](const uint8_t* page, int r, int n) {
#if MLA
    const auto input = [&](int i) { return s.vec + head_input(r + i); };  // row i's x
#else
    const auto input = [&](int) { return s.vec; };
#endif
#if WEIGHT_FP8
    if (short_rows) {  // SHORT_ROWS_PER_WARP rows a warp at a time (dot_short_row)
      const int sub = lane / SHORT_ROW_LANES, sl = lane % SHORT_ROW_LANES;
      for (int rr = gw * SHORT_ROWS_PER_WARP; rr < n; rr += GROUP_WARPS * SHORT_ROWS_PER_WARP) {
        const int i = min(rr + sub, n - 1);  // lanes past the page's last row repeat it, unstored
        const float y = dot_short_row(Fp8Row::at(page + i * rb, 8 * k8, scale_shift), input(i), 2 * k8, sl);
        if (sl == 0 && rr + sub < n) s.acc[r + i] = y;
      }
      return;
    }
#endif
#if WEIGHT_FP8 && !MLA
    const int per_warp = whole_rows && wpr == 1 && n > GROUP_WARPS ? 2 : 1;
#else
    constexpr int per_warp = 1;
#endif
    for (int rr = gw / wpr * per_warp; rr < n; rr += GROUP_WARPS / wpr * per_warp) {
      const auto put = [&](int i, int h, float y) {  // the sum of the page's row i's half h
        if (lane == 0) {
          if (wpr == 1) s.acc[(r + i) * halves + h] = y;
          else atomicAdd(&s.acc[(r + i) * halves + h], y);
        }
      };
#if WEIGHT_FP8
      // An FP8 gate/up row: both halves in one pass over x, the up half halfway (both halves have
      // the same padded size); or two whole FP8 rows that read the same x. bf16 rows keep one pass
      // per half: their x loads cost half as much per weight byte, and the pair's registers made
      // bf16 MLA builds spill.
      const bool two_rows = per_warp == 2 && rr + 1 < n && input(rr + 1) == input(rr);
      if ((fp8 && halves == 2) || two_rows) {
        float y[2];
        dot_segment_fp8_pair(page + rr * rb, two_rows ? rb : rb / 2, 8 * k8, input(rr), begin, end, lane,
                             scale_shift, y);
        put(rr, 0, y[0]);
        put(rr + two_rows, two_rows ? 0 : 1, y[1]);
        continue;
      }
#endif
      for (int i = rr; i < min(n, rr + per_warp); ++i) {  // one row, or each of two that read two x
        const uint4* w = reinterpret_cast<const uint4*>(page + i * rb);
        const float* x = input(i);
        for (int h = 0; h < halves; ++h) {  // an FP8 row here is a whole row (halves == 1)
#if WEIGHT_FP8 && MOE && TP > 1  // as below, skipping the pieces of slots without an expert here
          const float y = !fp8 ? dot_skipping(w + h * k8, x, begin, end, skip0, skip1, lane)
                          : down ? dot_segment_fp8_pieces(page + i * rb, slots, piece_bytes, k8, MOE_SHARED_K / 8, x,
                                                          begin, end, lane, busy)
                              : dot_segment_fp8(page + i * rb, 8 * k8, x, begin, end, lane, scale_shift);
#elif WEIGHT_FP8 && MOE  // a routed down row's pieces (and the shared expert's) each carry their own scales
          const float y = !fp8 ? dot_segment(w + h * k8, x, begin, end, lane)
                          : down ? dot_segment_fp8_pieces(page + i * rb, slots, piece_bytes, k8, MOE_SHARED_K / 8, x,
                                                          begin, end, lane)
                              : dot_segment_fp8(page + i * rb, 8 * k8, x, begin, end, lane, scale_shift);
#elif WEIGHT_FP8
          const float y = fp8 ? dot_segment_fp8(page + i * rb, 8 * k8, x, begin, end, lane, scale_shift)
                              : dot_segment(w + h * k8, x, begin, end, lane);
#elif MOE && TP > 1
          const float y = dot_skipping(w + h * k8, x, begin, end, skip0, skip1, lane);
#else
          const float y = dot_segment(w + h * k8, x, begin, end, lane);
#endif
          put(i, h, y);
        }
      }
    }
  });
}

// A matrix-vector task's row sums start at zero: s.acc, and a tile task's other warpgroups' at the
// end of s.vec (tile_sums), whose place depends on the task's rows, so all the room any task's
// could take (ACC_FLOATS a warpgroup; staging, which comes after, never writes there: passes/
// residency.py). Done before every task's dependency wait (run_compute), whose barrier orders it
// before the task: in the task it took ~0.3 us of each matrix-vector task's start (H100, session
// 57); before a task of another kind it is a few stores a thread.
__device__ __forceinline__ void zero_row_sums(Shared& s, int ct) {
  for (int i = ct; i < ACC_FLOATS; i += COMPUTE_WARPS * 32) s.acc[i] = 0.f;
#if FP8_MMA
  for (int i = ct; i < (TILE_WARPGROUPS - 1) * ACC_FLOATS; i += COMPUTE_WARPS * 32)
    s.vec[MAX_K - (TILE_WARPGROUPS - 1) * ACC_FLOATS + i] = 0.f;
#endif
}

__device__ void run_matvec(const Params& p, Shared& s, const int* t, uint32_t& consumed, int ct) {
#if MOE && TP > 1  // a gate/up task whose slot holds no expert of this rank: no pages, no output
  if (t[F_OPCODE] == OP_MOE_GATE_UP && busy_slots(p, t) == 0) return;
#endif
  const int warp = ct >> 5, lane = ct & 31, group = warp / GROUP_WARPS, gw = warp % GROUP_WARPS;
  const int row0 = t[F_ROW0], rows = t[F_ROW1] - row0, rb = t[F_ROW_BYTES], rpp = rows_per_page(t);
  const int k8 = t[F_K] / 8, epi = t[F_EPILOGUE], halves = row_halves(t);
#if TP > 1  // an exchanging task adds the residual to the sum of the ranks' rows (exchange_rows)
  const bool add = adds_residual(t) && t[F_XCHG] < 0;
#else
  const bool add = adds_residual(t);
#endif
  const float res = add && ct < rows ? residual(p, t, row0, ct) : 0.f;  // prefetched
#if READY_DIGITS  // and the digits' consumer's norm weight of this thread's first row
  const int first = digit_first_row(t, ct);
  const float gamma0 = t[F_DIGITS_OUT] >= 0 && t[F_DIGITS_GAMMA] >= 0 && first >= 0 && first < rows
                           ? p.act[t[F_DIGITS_GAMMA] + row0 + first] : 1.f;
#endif
#if FP8_MMA
  if (t[F_W_FORMAT] == WF_FP8_TILES) {
    tile_task(p, s, t, consumed, ct);
  } else
#endif
  {
    stage_vector(p, s, t, ct);
    matvec_pages(p, s, t, rows, rb, rpp, k8, halves, consumed, lane, group, gw);
  }
  compute_sync();
  float* out = p.act + t[F_OUT];
  const float rstd = normed(t) ? s.red[COMPUTE_WARPS] : 1.f;
  float best = -INFINITY;
  int best_row = 0x7fffffff;
  for (int i = ct; i < rows; i += COMPUTE_WARPS * 32) {
    float y = s.acc[i * halves] * rstd;
    if (epi == EPI_SILU_MUL) y = y / (1.f + __expf(-y)) * s.acc[i * 2 + 1] * rstd;
    if (add) y += i == ct ? res : residual(p, t, row0, i);
#if TP > 1
    if (t[F_XCHG] >= 0) {  // a partial sum: to every rank, summed there (exchange_rows)
      publish_partial(p, t, row0 + i, y);
      continue;
    }
#endif
    __stcg(out + row0 + i, y);
#if READY_DIGITS  // for put_ready_digits (only this thread reads the row's sums)
    if (t[F_DIGITS_OUT] >= 0) s.acc[i * halves] = y;
#endif
#if FFN_SPLIT_K  // the start value of a split-K FFN's sum
    if (t[F_FIXED_OUT] >= 0) __stcg(reinterpret_cast<long long*>(p.act + t[F_FIXED_OUT]) + row0 + i, to_fixed(y));
#endif
    if (y > best) {  // rows visited in increasing order: the first maximum wins ties
      best = y;
      best_row = row0 + i;
    }
  }
  if (epi == EPI_ARGMAX) write_best(p, s, t, best, best_row, ct);  // of the logits
#if READY_DIGITS
  if (t[F_DIGITS_OUT] >= 0) put_ready_digits(p, s, t, rows, halves, gamma0, ct);
#endif
}

// lm_head, after its greedy (max logit, row) pair was written: temperature-only sampling
// replaces the pair with the best Gumbel-max score's; top-k / top-p add the task's record of
// candidates. The logits are still in s.acc (row sums) and s.red (1/rms) until the next task.
__device__ void sample_lm_head(const Params& p, Shared& s, const int* t, long long pos, int ct) {
  const int mode = sample_mode(s);
  if (mode == SAMPLE_GREEDY) return;
  const Sampling sp = sampling(p);
  const float rstd = s.red[COMPUTE_WARPS];
  compute_sync();  // thread 0 has merged the warps' pairs: their slots may be rewritten
  if (mode == SAMPLE_FILTERED) {
    lm_head_candidates(p, sp, s, t, rstd, ct);
    return;
  }
  float best;
  int best_row;
  gumbel_best(sp, s, t[F_ROW0], t[F_ROW1] - t[F_ROW0], rstd, pos, ct, best, best_row);
  write_best(p, s, t, best, best_row, ct);
}
