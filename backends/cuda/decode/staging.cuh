// ---- compute: matrix-vector tasks ----------------------------------------------------------
// Stage the input vector in shared memory (normalized for norm_matvec), then stream the task's
// weight pages. A page holds `rpp` whole rows; WPR = COMPUTE_WARPS / rpp warps (a power of two)
// share each row, each taking a contiguous segment of it, so that every warp has work even
// when a page holds fewer rows than there are warps; segments are counted in groups of 8
// columns, whatever the weights' format. Weights are bf16, or (WEIGHT_FP8, per task) e4m3 with
// block scales, dequantized in the dot product; fp32 accumulation; the segments' sums meet in
// shared memory and the epilogue runs per row at the end of the task.
#if MLA
// A head_matvec's rows come in heads of F_HEAD_ROWS rows that each read their own F_K inputs,
// F_IN_STRIDE apart (q absorption: each head's q_nope; v expansion: each head's o_latent, which
// it merges from the attention's chunk results: stage_merged_heads). The task stages the inputs
// of the heads its rows span one after another; row i reads at HeadInputs(i), 0 in any other
// task. Made from the task row once, before the page loop: the loop stores to shared memory,
// after which the compiler read the task row again for every row (a v expansion page of 124
// rows: 5.9 us with those reads, 5.4 without; H200, docs/performance.md).
struct HeadInputs {
  int row0, first, k;  // k = 0: every row reads the one input
  Divisor head_rows;
  __device__ __forceinline__ int operator()(int i) const { return k ? head(i) * k : 0; }
  __device__ __forceinline__ int head(int i) const { return head_rows(row0 + i) - first; }  // the task's own count
};
__device__ __forceinline__ HeadInputs head_inputs(const int* t) {
  if (t[F_OPCODE] != OP_HEAD_MATVEC) return {0, 0, 0, Divisor(1)};
  const Divisor head_rows(t[F_HEAD_ROWS]);
  return {t[F_ROW0], head_rows(t[F_ROW0]), t[F_K], head_rows};
}
// MLA attention's result of a chunk of a head group (run_mla_attention): per head its MLA_RANK
// sums, its max and its sum.
constexpr int MLA_PART = MLA_HEADS * (MLA_RANK + 2);
static_assert(MLA_RANK % 2 == 0, "the merge reads a chunk's sums two at a time (8-byte aligned)");

// v expansion's input, heads h0..h1 of o_latent, merged from the attention's chunk results
// (F_COUNT chunks a head group, at F_AUX3; passes/fusion_mla.py says why here): chunk k's sums
// count exp(max_k - max) / den times, den the head's softmax sum; an empty chunk (max -inf) not
// at all. A warp per head weighs its chunks (a lane per chunk, its max and sum one load, the
// factors after the heads' inputs in s.vec), then each thread adds up two dims of a head over
// the chunks, MERGE_BATCH chunks' loads in flight at a time: it took three round trips to L2
// before the sums, then one a chunk, each chunk's load waited for by its product (the staging
// 4.3 µs a DeepSeek-V3.2 task, now 4.1; docs/performance.md, sessions 36 and 41; issuing the
// first batch before the weighing made the DeepSeek-V3.2 kernels spill). The task that holds a
// head's first row also leaves the head in o_latent (F_IN), the attention's output in the
// graph, which nothing downstream reads: what the tests and Engine's activations see.
constexpr int MERGE_BATCH = 8;
__device__ void stage_merged_heads(const Params& p, Shared& s, const int* t, int h0, int h1, int ct) {
  const int chunks = t[F_COUNT], n = h1 - h0, warp = ct >> 5, lane = ct & 31, items = n * MLA_RANK / 2;
  float* factor = s.vec + n * MLA_RANK;  // [n][chunks]
  const auto part = [&](int h, int k) {  // chunk k's result for head h
    return p.act + t[F_AUX3] + (static_cast<long long>(h / MLA_HEADS) * chunks + k) * MLA_PART +
           h % MLA_HEADS * (MLA_RANK + 2);
  };
  // item j: dims 2 (j % (MLA_RANK / 2)) and the next of head j / (MLA_RANK / 2); chunks past the
  // last are read as the last, weighed 0 (loads that exist: no guard, no spill)
  const auto load_batch = [&](float2 (&v)[MERGE_BATCH], int j, int k0) {
    const int i = j / (MLA_RANK / 2), d = 2 * (j % (MLA_RANK / 2));
#pragma unroll
    for (int b = 0; b < MERGE_BATCH; ++b)
      v[b] = __ldcg(reinterpret_cast<const float2*>(part(h0 + i, min(k0 + b, chunks - 1)) + d));
  };
  for (int i = warp; i < n; i += COMPUTE_WARPS) {
    const auto stats = [&](int k) {  // chunk k's (max, sum) for head h0 + i
      return __ldcg(reinterpret_cast<const float2*>(part(h0 + i, k) + MLA_RANK));
    };
    const float2 own = lane < chunks ? stats(lane) : make_float2(-INFINITY, 0.f);
    float mx = own.x, den = 0.f;
    for (int k = lane + 32; k < chunks; k += 32) mx = fmaxf(mx, stats(k).x);
    mx = warp_max(mx);
    for (int k = lane; k < chunks; k += 32) {
      const float2 ms = k == lane ? own : stats(k);
      const float f = ms.x == -INFINITY ? 0.f : __expf(ms.x - mx);
      factor[i * chunks + k] = f;
      den += f * ms.y;
    }
    den = warp_sum(den);
    for (int k = lane; k < chunks; k += 32) factor[i * chunks + k] /= den;
  }
  compute_sync();
  for (int j = ct; j < items; j += NT) {
    const int i = j / (MLA_RANK / 2), d = 2 * (j % (MLA_RANK / 2));
    float2 num = make_float2(0.f, 0.f);
    for (int k0 = 0; k0 < chunks; k0 += MERGE_BATCH) {
      float2 v[MERGE_BATCH];
      load_batch(v, j, k0);
#pragma unroll
      for (int b = 0; b < MERGE_BATCH; ++b) {
        const float f = k0 + b < chunks ? factor[i * chunks + k0 + b] : 0.f;
        num.x = fmaf(f, v[b].x, num.x);
        num.y = fmaf(f, v[b].y, num.y);
      }
    }
    s.vec[i * MLA_RANK + d] = num.x;
    s.vec[i * MLA_RANK + d + 1] = num.y;
    if ((h0 + i) * t[F_HEAD_ROWS] >= t[F_ROW0])
      __stcg(reinterpret_cast<float2*>(p.act + t[F_IN] + (h0 + i) * t[F_IN_STRIDE] + d), num);
  }
  compute_sync();
}

__device__ void stage_heads(const Params& p, Shared& s, const int* t, int ct) {
  const int k = t[F_K], h0 = t[F_ROW0] / t[F_HEAD_ROWS], h1 = (t[F_ROW1] - 1) / t[F_HEAD_ROWS] + 1;
  if (t[F_COUNT] > 0) {  // v expansion
    stage_merged_heads(p, s, t, h0, h1, ct);
    return;
  }
  const float* x = p.act + t[F_IN];
  const int stride = t[F_IN_STRIDE];
  for (int i = ct; i < (h1 - h0) * k; i += NT) s.vec[i] = __ldcg(x + (h0 + i / k) * stride + i % k);
  compute_sync();
}
#endif

#if FFN_SPLIT_K
// The fixed-point residual stream of a split-K FFN's output: value x2^FIXED_FRAC_BITS, rounded to
// nearest, as a signed 64-bit integer (passes/fusion.py: _fuse_split_k says why and the range).
constexpr float FIXED_SCALE = static_cast<float>(1ull << FIXED_FRAC_BITS);
__device__ __forceinline__ long long to_fixed(float x) { return __float2ll_rn(x * FIXED_SCALE); }
__device__ __forceinline__ float from_fixed(long long v) { return __ll2float_rn(v) * (1.f / FIXED_SCALE); }
__device__ __forceinline__ float4 fixed4(const float* base, int i) {
  const longlong2* v = reinterpret_cast<const longlong2*>(base) + 2 * i;
  const longlong2 a = __ldcg(v), b = __ldcg(v + 1);
  return make_float4(from_fixed(a.x), from_fixed(a.y), from_fixed(b.x), from_fixed(b.y));
}
#endif

// Where a matrix-vector task's input comes from: F_IN (F_FIXED_IN: fixed point, see fixed4); in
// a MoE down task every slot's activations times the slot's combine weight (F_AUX2), then
// (MOE_SHARED_K) the shared expert's activations (F_SHARED_IN) times 1. Made from the task row
// once, before the staging loop (see HeadInputs: the loop's stores to shared memory would have
// the task row read again each iteration, each read a round trip before that iteration's load).
struct TaskInput {
  const float4* x;
#if FFN_SPLIT_K
  bool fixed;
#endif
#if MOE
  const float* combine;  // a down task's combine weights, one per slot; null in any other task
#endif
#if MOE_SHARED_K
  const float4* shared;  // a down task's inputs from 4 routed4 on
  int routed4;
#endif
#if MOE
  // the combine weight of a down task's inputs 4 i .. 4 i + 3: their slot's (the shared expert's: 1)
  __device__ __forceinline__ float combine_weight(int i) const {
#if MOE_SHARED_K
    if (i >= routed4) return 1.f;
#endif
    return __ldcg(combine + 4 * i / MOE_SLOT_K);
  }
#endif
  // what unweighted(i) is still to be multiplied by: a down task's combine weight, else 1
  __device__ __forceinline__ float pending_weight(int i) const {
#if MOE
    if (combine) return combine_weight(i);
#endif
    return 1.f;
  }
  // where inputs 4 i .. 4 i + 3 are (not in a fixed-point input: see unweighted)
  __device__ __forceinline__ const float4* source(int i) const {
#if MOE_SHARED_K
    if (combine && i >= routed4) return shared + (i - routed4);
#endif
    return x + i;
  }
  // inputs 4 i .. 4 i + 3, a down task's without their combine weight
  __device__ __forceinline__ float4 unweighted(int i) const {
#if FFN_SPLIT_K
    if (fixed) return fixed4(reinterpret_cast<const float*>(x), i);
#endif
    return __ldcg(source(i));
  }
  // inputs 4 i .. 4 i + 3
  __device__ __forceinline__ float4 at(int i) const {
    float4 a = unweighted(i);
#if MOE
    if (combine) {
      const float c = combine_weight(i);
      a.x *= c; a.y *= c; a.z *= c; a.w *= c;
    }
#endif
    return a;
  }
};
__device__ __forceinline__ TaskInput task_input(const Params& p, const int* t) {
  TaskInput in;
  in.x = reinterpret_cast<const float4*>(p.act + t[F_IN]);
#if FFN_SPLIT_K
  in.fixed = t[F_FIXED_IN];
#endif
#if MOE
  const bool down = t[F_OPCODE] == OP_MOE_DOWN_ADD;
  in.combine = down ? p.act + t[F_AUX2] : nullptr;
#endif
#if MOE_SHARED_K
  in.shared = reinterpret_cast<const float4*>(p.act + t[F_SHARED_IN]);
  in.routed4 = (t[F_K] - MOE_SHARED_K) / 4;
#endif
  return in;
}

// Row row0 + i of a matvec_add's residual (F_AUX).
__device__ __forceinline__ float residual(const Params& p, const int* t, int row0, int i) {
#if FFN_SPLIT_K
  if (t[F_FIXED_RES]) return from_fixed(__ldcg(reinterpret_cast<const long long*>(p.act + t[F_AUX]) + row0 + i));
#endif
  return __ldcg(p.act + t[F_AUX] + row0 + i);
}

// The end of staging a task's input, whose squares this thread summed into `ss`: a barrier,
// and for a normed task its 1/rms in s.red[COMPUTE_WARPS] (thread 0, visible after the next
// barrier).
__device__ __forceinline__ void end_staging(Shared& s, const int* t, float ss, int ct) {
  if (!normed(t)) {
    compute_sync();
    return;
  }
  ss = warp_sum(ss);
  if ((ct & 31) == 0) s.red[ct >> 5] = ss;
  compute_sync();
  if (ct == 0) {
    float total = 0.f;
    for (int w = 0; w < COMPUTE_WARPS; ++w) total += s.red[w];
    s.red[COMPUTE_WARPS] = rsqrtf(total / t[F_K] + __int_as_float(t[F_EPS]));
  }
}

__device__ void stage_vector(const Params& p, Shared& s, const int* t, int ct) {
#if MLA
  if (t[F_OPCODE] == OP_HEAD_MATVEC) {
    stage_heads(p, s, t, ct);
    return;
  }
#endif
  const int k4 = t[F_K] / 4;
  const bool norm = normed(t);
  const TaskInput in = task_input(p, t);
  const float4* gamma = reinterpret_cast<const float4*>(p.act + t[F_AUX]);
  float4* v = reinterpret_cast<float4*>(s.vec);
  float ss = 0.f;
  // x and the norm weight are loaded together (one round trip to L2); x * gamma is staged and
  // the 1/rms scale, known only after the reduction, is applied to the row sums instead. (A
  // down task, whose inputs carry their combine weights, is not normed: ss goes unused.) The
  // norm weight is asked for first: asked for after x, nvcc issued its load behind the branch
  // of a down task's combine weight, which waits for x, so each stride cost two round trips
  // and the next stride's loads waited for this one's store (SASS of the DeepSeek-V3.2 kernel,
  // session 67); now two strides' loads are in flight at once. Loading more strides before
  // using any spilled registers there (4 strides: 336 bytes of spill stores; 2: 96).
  for (int i = ct; i < k4; i += COMPUTE_WARPS * 32) {
    const float4 g = norm ? __ldcg(gamma + i) : float4{};
    float4 a = in.at(i);
    ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
    if (norm) {
      a.x *= g.x; a.y *= g.y; a.z *= g.z; a.w *= g.w;
    }
    v[i] = a;
  }
  end_staging(s, t, ss, ct);
}
