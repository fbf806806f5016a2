// ---- compute: absorbed MLA attention (ir/mla.py) -------------------------------------------
#if MLA
// The latent cache holds one row per position, shared by every head: the normed latent
// (MLA_RANK) and the rotated key rope part (MLA_ROPE), bf16. A head's score against row j is
// q_latent[h] · latent[j] + q_pe[h] · k_pe[j], i.e. the dot product of the row with the head's
// query [q_latent | rotated q_pe]; its output is Σ_j p[h, j] latent[j] (the value up-projection
// is the head_matvec that follows).
// (MLA_W, MLA_PIECES, MLA_KSTEPS and MLA_ROW, a cache row's and a staged row's geometry, are
// the loader's: loader.cuh, which stages a task's first key block.)
// The tensor-core tiling of mla_chunk (passes/residency.py: mla_staged_floats sizes it alike):
constexpr int MLA_M = 16;                                      // heads of a task: the rows of an mma tile
constexpr int MLA_PROW = MLA_KEYS + 8;                         // bf16 a head's probabilities take
constexpr int MLA_KSPLIT = 4;                                  // warps sharing a score tile's k-steps
constexpr int MLA_OT = (MLA_RANK / 8 + COMPUTE_WARPS - 1) / COMPUTE_WARPS;  // output tiles per warp
// MlaStage's parts, floats into s.vec
constexpr int MLA_ROWS_AT = MLA_M * MLA_ROW, MLA_PART_AT = MLA_ROWS_AT + MLA_KEYS * MLA_ROW / 2;
constexpr int MLA_PROB_AT = MLA_PART_AT + MLA_KSPLIT * MLA_M * MLA_KEYS, MLA_ST_AT = MLA_PROB_AT + MLA_M * MLA_PROW;
constexpr int MLA_STAGED = MLA_ST_AT + 3 * MLA_HEADS;
static_assert(MLA_W % 8 == 0 && MLA_ROPE % 2 == 0, "cache rows are whole 16-byte pieces; RoPE rotates pairs");
static_assert(MLA_RANK % 8 == 0, "the heads' outputs are whole 8-column mma tiles");
static_assert(MLA_HEADS <= MLA_M, "a task's heads are the rows of one mma tile");
static_assert(MLA_KEYS == 32, "the softmax takes a block's keys a lane each");
static_assert(MLA_STAGED <= MAX_K, "MLA attention's staging exceeds s.vec");

// RoPE pair i of the MLA_ROPE rotated dims (interleaved: 2i, 2i + 1; else i, i + MLA_ROPE / 2), the
// pair rotated dim d belongs to, and the pair (a, b) rotated by the position's cos | sin `cs`
// (ir/rope.py: apply_rope). The DSA indexer rotates as many dims with the same table, paired its
// own way.
__device__ __forceinline__ int2 rope_pair(int i, bool interleaved = MLA_ROPE_INTERLEAVED) {
  return interleaved ? make_int2(2 * i, 2 * i + 1) : make_int2(i, i + MLA_ROPE / 2);
}
__device__ __forceinline__ int rope_pair_of(int d, bool interleaved = MLA_ROPE_INTERLEAVED) {
  return interleaved ? d / 2 : d % (MLA_ROPE / 2);
}
__device__ __forceinline__ float2 rope_rotate(float a, float b, const float* cs, int i) {
  const float c = cs[i], sn = cs[MLA_ROPE / 2 + i];
  return make_float2(a * c - b * sn, b * c + a * sn);
}

// The latent prologue, run by the first q-absorption task (passes/fusion_mla.py says why
// there): from the kv_a part of the input projection (F_AUX2), RMS-normalize the latent with
// kv_a_layernorm (F_AUX, F_EPS), rotate k_pe, and write the row at `pos` of the layer's cache
// (F_KCACHE). Every compute thread takes dims (one each where MLA_RANK <= NT, as in DeepSeek-V3.2
// and GLM-5), so the row costs about one round trip to L2: one warp walking the dims took ~10 µs
// (a load behind each store), the longest task of DeepSeek-V3.2's q absorption, which attention
// waits for. The task's signal publishes the row to the attention tasks.
__device__ void mla_append_latent(const Params& p, Shared& s, const int* t, long long pos, int ct) {
  const float* kv = p.act + t[F_AUX2];
  const float* gamma = p.act + t[F_AUX];
  const float* cs = p.act + p.rope_offset + pos * MLA_ROPE;
  __nv_bfloat16* row = p.kv + t[F_KCACHE] + pos * MLA_W;
  float ss = 0.f;
  for (int d = ct; d < MLA_RANK; d += NT) {
    const float x = __ldcg(kv + d);
    ss += x * x;
  }
  ss = warp_sum(ss);
  compute_sync();  // the task's own reductions are done with s.red
  if ((ct & 31) == 0) s.red[ct >> 5] = ss;
  compute_sync();
  ss = 0.f;
  for (int w = 0; w < COMPUTE_WARPS; ++w) ss += s.red[w];
  const float rstd = rsqrtf(ss / MLA_RANK + __int_as_float(t[F_EPS]));
  for (int d = ct; d < MLA_RANK; d += NT) row[d] = __float2bfloat16(__ldcg(kv + d) * rstd * __ldcg(gamma + d));
  for (int i = ct; i < MLA_ROPE / 2; i += NT) {
    const int2 d = rope_pair(i);
    const float2 r = rope_rotate(__ldcg(kv + MLA_RANK + d.x), __ldcg(kv + MLA_RANK + d.y), cs, i);
    row[MLA_RANK + d.x] = __float2bfloat16(r.x);
    row[MLA_RANK + d.y] = __float2bfloat16(r.y);
  }
}

// run_mla_attention's shared memory, carved from s.vec. Rows and queries are MLA_ROW bf16 apart
// (a multiple of 64, plus 8): the 32-bit fragment loads of a warp (8 rows g, 4 column pairs q)
// then fall on 32 distinct banks, and a key's 16-bit value loads (4 rows q, 8 columns g) on 16
// distinct words.
struct MlaStage {  // one pointer (s.vec), the parts at constant offsets: few registers held
  float* vec;
  // [2][MLA_M][MLA_ROW]: the heads' queries times the softmax scale, bf16 hi | lo
  __device__ __forceinline__ __nv_bfloat16* q() const { return reinterpret_cast<__nv_bfloat16*>(vec); }
  // [MLA_KEYS][MLA_ROW]: a block's cache rows, zero past its keys and MLA_W (every other block's;
  // the others' are in a ring page: mla_chunk)
  __device__ __forceinline__ __nv_bfloat16* rows() const { return reinterpret_cast<__nv_bfloat16*>(vec + MLA_ROWS_AT); }
  // [MLA_KSPLIT][MLA_M][MLA_KEYS]: the block's scores, summed over each split's k-steps
  __device__ __forceinline__ float* part() const { return vec + MLA_PART_AT; }
  // [2][MLA_M][MLA_PROW]: the block's probabilities, bf16 hi | lo
  __device__ __forceinline__ __nv_bfloat16* prob() const { return reinterpret_cast<__nv_bfloat16*>(vec + MLA_PROB_AT); }
  // [3][MLA_HEADS]: max | sum | rescale of the old sums, per head
  __device__ __forceinline__ float* st() const { return vec + MLA_ST_AT; }
};

__device__ __forceinline__ uint32_t bf16_pair(const __nv_bfloat16* x) { return *reinterpret_cast<const uint32_t*>(x); }
// v as bf16 hi + lo (hi = bf16(v), lo = bf16(v - hi)): ~16 of fp32's 24 significand bits, which
// two bf16 products keep (a bf16 cache value times either half is exact in the fp32 sums).
__device__ __forceinline__ void bf16_split(float v, __nv_bfloat16* hi, __nv_bfloat16* lo) {
  *hi = __float2bfloat16(v);
  *lo = __float2bfloat16(v - __bfloat162float(*hi));
}
// The A fragment (mma_bf16_16816) of 16 rows `stride` bf16 apart, row-major, at k-step k0.
__device__ __forceinline__ void mla_a_fragment(uint32_t (&a)[4], const __nv_bfloat16* x, int stride, int k0, int lane) {
  const __nv_bfloat16* r = x + (lane >> 2) * stride + k0 + 2 * (lane & 3);
  a[0] = bf16_pair(r);
  a[1] = bf16_pair(r + 8 * stride);
  a[2] = bf16_pair(r + 8);
  a[3] = bf16_pair(r + 8 * stride + 8);
}

// The group's queries times the softmax scale, the A rows of the scores: q_latent (F_IN), then
// q's rope part (F_AUX) rotated at pos (`cs`, which the loader put in the task's ring page), as
// bf16 hi | lo; heads past MLA_HEADS and dims past MLA_W (the last k-step's padding) are zero. A
// thread loads all of its share first (q_latent four dims a load), then converts and stores it:
// item by item, a DeepSeek-V3.2 task's staging took 2.50 us, now 2.32 (H200). Its time is not
// the loads' round trips: with the cos | sin loaded beside them too it took 3.4
// (docs/performance.md, session 36).
constexpr int MLA_Q_LAT_ITEMS = (MLA_M * MLA_RANK / 4 + NT - 1) / NT;  // a thread's 4-dim pieces
constexpr int MLA_Q_TAIL = 16 * MLA_KSTEPS - MLA_RANK;                 // a staged query's dims past its latent
constexpr int MLA_Q_TAIL_ITEMS = (MLA_M * MLA_Q_TAIL + NT - 1) / NT;   // a thread's rope (or padding) dims
__device__ void mla_stage_queries(const Params& p, const int* t, const MlaStage& m, const float* cs, int g, int ct) {
  const float scale = __int_as_float(t[F_SCALE]);
  const float4* q_lat = reinterpret_cast<const float4*>(p.act + t[F_IN] + g * MLA_HEADS * MLA_RANK);
  const float* q_pe = p.act + t[F_AUX] + g * MLA_HEADS * (MLA_NOPE + MLA_ROPE) + MLA_NOPE;
  float4 lat[MLA_Q_LAT_ITEMS];
#pragma unroll
  for (int j = 0; j < MLA_Q_LAT_ITEMS; ++j) {
    const int i = ct + j * NT;
    lat[j] = i < MLA_M * MLA_RANK / 4 && i / (MLA_RANK / 4) < MLA_HEADS ? __ldcg(q_lat + i)
                                                                         : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  float2 pe[MLA_Q_TAIL_ITEMS];  // the dim's rope pair, unrotated (zero: padding or no head)
#pragma unroll
  for (int j = 0; j < MLA_Q_TAIL_ITEMS; ++j) {
    const int i = ct + j * NT, h = i / MLA_Q_TAIL, r = i % MLA_Q_TAIL;
    pe[j] = make_float2(0.f, 0.f);
    if (i < MLA_M * MLA_Q_TAIL && h < MLA_HEADS && r < MLA_ROPE) {
      const int2 at = rope_pair(rope_pair_of(r));
      const float* x = q_pe + h * (MLA_NOPE + MLA_ROPE);
      pe[j] = make_float2(__ldcg(x + at.x), __ldcg(x + at.y));
    }
  }
#pragma unroll
  for (int j = 0; j < MLA_Q_LAT_ITEMS; ++j) {
    const int i = ct + j * NT, h = i / (MLA_RANK / 4), d = 4 * (i % (MLA_RANK / 4));
    if (i >= MLA_M * MLA_RANK / 4) break;
    const float4 v = make_float4(lat[j].x * scale, lat[j].y * scale, lat[j].z * scale, lat[j].w * scale);
    const __nv_bfloat162 hi[2] = {__floats2bfloat162_rn(v.x, v.y), __floats2bfloat162_rn(v.z, v.w)};
    const float2 h0 = __bfloat1622float2(hi[0]), h1 = __bfloat1622float2(hi[1]);
    const __nv_bfloat162 lo[2] = {__floats2bfloat162_rn(v.x - h0.x, v.y - h0.y),
                                  __floats2bfloat162_rn(v.z - h1.x, v.w - h1.y)};
    *reinterpret_cast<uint2*>(m.q() + h * MLA_ROW + d) = *reinterpret_cast<const uint2*>(hi);
    *reinterpret_cast<uint2*>(m.q() + (MLA_M + h) * MLA_ROW + d) = *reinterpret_cast<const uint2*>(lo);
  }
#pragma unroll
  for (int j = 0; j < MLA_Q_TAIL_ITEMS; ++j) {
    const int i = ct + j * NT, h = i / MLA_Q_TAIL, d = MLA_RANK + i % MLA_Q_TAIL;
    if (i >= MLA_M * MLA_Q_TAIL) break;
    float v = 0.f;
    if (d < MLA_W) {  // pe[j] is zero past MLA_HEADS
      const int r = d - MLA_RANK, pair = rope_pair_of(r);
      const float2 rot = rope_rotate(pe[j].x * scale, pe[j].y * scale, cs, pair);
      v = r == rope_pair(pair).x ? rot.x : rot.y;
    }
    bf16_split(v, m.q() + h * MLA_ROW + d, m.q() + (MLA_M + h) * MLA_ROW + d);
  }
}

// A thread's share (pieces c0, c0 + step, ...) of staging a cache row of `pieces` 16-byte pieces
// at src to dst, zero past them up to `padded` (all zero when not live): the copies asynchronous
// (cp.async, no registers held), completed by the thread's cp_async_wait_all.
__device__ __forceinline__ void stage_row(uint4* dst, const uint4* src, bool live, int pieces, int padded, int c0,
                                          int step) {
#pragma unroll 1
  for (int c = c0; c < padded; c += step) {
    if (live && c < pieces) {
      cp_async16(dst + c, src + c);
    } else {
      dst[c] = uint4{};
    }
  }
}

// The block of keys [b0, min(b0 + MLA_KEYS, k1)) of the chunk is staged NT / MLA_KEYS threads a
// row: its rows, each of 2 MLA_KSTEPS 16-byte pieces, zero past MLA_W and past the block's keys.
// mla_block_row is the cache row of a thread's key (-1 past k1); with DSA, past DSA_TOPK
// positions, it is read from the indexer's list (F_AUX2), a round trip to L2 that the caller
// starts a block ahead. Up to DSA_TOPK positions the indexer chooses every token, in order
// (run_dsa_topk), so entry i of its list is i and attention neither reads the list nor waits for
// it (wait_deps skips the task's F_SELECTION_WAIT).
static_assert(NT % MLA_KEYS == 0, "whole threads per staged row");
constexpr int MLA_ROW_THREADS = NT / MLA_KEYS;
__device__ __forceinline__ long long mla_block_row(const Params& p, const int* t, long long pos, long long b0,
                                                   long long k1, int ct) {
  const long long key = b0 + ct / MLA_ROW_THREADS;
  if (key >= k1) return -1;
#if DSA  // the chunk's rows are the cache rows of the tokens the indexer selected
  if (!mla_selects_all(pos)) return __ldcg(reinterpret_cast<const int*>(p.act + t[F_AUX2]) + key);
#endif
  return key;
}
// Issues the thread's copies of its key's row (asynchronous, no registers held): the caller
// waits (cp_async_wait_all) and publishes the rows with a barrier, so that a block costs one
// round trip to HBM.
__device__ __forceinline__ void mla_load_block(const Params& p, const int* t, __nv_bfloat16* rows, long long row,
                                               int ct) {
  stage_row(reinterpret_cast<uint4*>(rows + ct / MLA_ROW_THREADS * MLA_ROW),
            reinterpret_cast<const uint4*>(p.kv + t[F_KCACHE] + max(row, 0ll) * MLA_W), row >= 0, MLA_PIECES,
            2 * MLA_KSTEPS, ct % MLA_ROW_THREADS, MLA_ROW_THREADS);
}

// S = Q K^T of the block staged in `rows`: a warp's item is an n-tile of 8 keys (B = the keys'
// rows, a key's consecutive dims being B's k) over one of MLA_KSPLIT ranges of the k-steps, Q hi
// and Q lo each an mma per k-step; the ranges' sums go to `part` (the softmax adds them in a fixed
// order).
__device__ __forceinline__ void mla_scores(const MlaStage& m, const __nv_bfloat16* rows, int warp, int lane) {
  for (int item = warp; item < MLA_KEYS / 8 * MLA_KSPLIT; item += COMPUTE_WARPS) {
    const int n0 = item % (MLA_KEYS / 8) * 8, split = item / (MLA_KEYS / 8);
    const __nv_bfloat16* key = rows + (n0 + (lane >> 2)) * MLA_ROW + 2 * (lane & 3);
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    for (int k = MLA_KSTEPS * split / MLA_KSPLIT; k < MLA_KSTEPS * (split + 1) / MLA_KSPLIT; ++k) {
      const uint32_t b0 = bf16_pair(key + 16 * k), b1 = bf16_pair(key + 16 * k + 8);
      uint32_t a[4];
      mla_a_fragment(a, m.q(), MLA_ROW, 16 * k, lane);
      mma_bf16_16816(d, a, b0, b1);
      mla_a_fragment(a, m.q() + MLA_M * MLA_ROW, MLA_ROW, 16 * k, lane);
      mma_bf16_16816(d, a, b0, b1);
    }
    float* out = m.part() + (split * MLA_M + (lane >> 2)) * MLA_KEYS + n0 + 2 * (lane & 3);
    out[0] = d[0];
    out[1] = d[1];
    out[8 * MLA_KEYS] = d[2];
    out[8 * MLA_KEYS + 1] = d[3];
  }
}

// The block's online softmax, a warp per head and a lane per key (nb keys): moves the head's
// state to the block's maximum (st: max, sum, and the factor that rescales the old sums) and
// leaves the probabilities as bf16 hi | lo, zero past nb and for rows past MLA_HEADS.
__device__ __forceinline__ void mla_softmax(const MlaStage& m, int nb, int warp, int lane) {
  for (int h = warp; h < MLA_M; h += COMPUTE_WARPS) {
    float e = 0.f;
    if (h < MLA_HEADS) {  // warp-uniform
      float x = 0.f;
#pragma unroll
      for (int s = 0; s < MLA_KSPLIT; ++s) x += m.part()[(s * MLA_M + h) * MLA_KEYS + lane];
      x = lane < nb ? x : -INFINITY;
      const float old = m.st()[h], mx = fmaxf(old, warp_max(x));
      e = lane < nb ? __expf(x - mx) : 0.f;
      const float l = warp_sum(e);
      __syncwarp();  // every lane has read the old state
      if (lane == 0) {
        const float corr = __expf(old - mx);  // 0 at the first block (old = -inf)
        m.st()[MLA_HEADS + h] = m.st()[MLA_HEADS + h] * corr + l;
        m.st()[2 * MLA_HEADS + h] = corr;
        m.st()[h] = mx;
      }
    }
    bf16_split(e, m.prob() + h * MLA_PROW + lane, m.prob() + (MLA_M + h) * MLA_PROW + lane);
  }
}

// O = O corr + P V of the block staged in `rows`: warp w owns the 8-column output tiles w,
// w + COMPUTE_WARPS, ... of every head (o[i]: rows g and g + 8, columns 2q, 2q + 1 of its tile i);
// A = P hi, then P lo, over the block's two k-steps of 16 keys; B (k = key, n = latent dim) pairs
// the 16-bit values of two consecutive keys' rows in a column.
__device__ __forceinline__ void mla_values(const MlaStage& m, const __nv_bfloat16* rows, float (&o)[MLA_OT][4],
                                           int warp, int lane) {
  const int g = lane >> 2, q = lane & 3;
  const float c0 = g < MLA_HEADS ? m.st()[2 * MLA_HEADS + g] : 0.f;
  const float c1 = g + 8 < MLA_HEADS ? m.st()[2 * MLA_HEADS + g + 8] : 0.f;
#pragma unroll
  for (int i = 0; i < MLA_OT; ++i) {
    o[i][0] *= c0;
    o[i][1] *= c0;
    o[i][2] *= c1;
    o[i][3] *= c1;
  }
  const uint16_t* v = reinterpret_cast<const uint16_t*>(rows) + 2 * q * MLA_ROW + g;
#pragma unroll
  for (int k = 0; k < MLA_KEYS / 16; ++k) {
    uint32_t hi[4], lo[4];
    mla_a_fragment(hi, m.prob(), MLA_PROW, 16 * k, lane);
    mla_a_fragment(lo, m.prob() + MLA_M * MLA_PROW, MLA_PROW, 16 * k, lane);
#pragma unroll
    for (int i = 0; i < MLA_OT; ++i) {
      const int n0 = (warp + i * COMPUTE_WARPS) * 8;
      if (n0 >= MLA_RANK) break;  // warp-uniform
      const uint16_t* col = v + 16 * k * MLA_ROW + n0;
      const uint32_t b0 = col[0] | static_cast<uint32_t>(col[MLA_ROW]) << 16;
      const uint32_t b1 = col[8 * MLA_ROW] | static_cast<uint32_t>(col[9 * MLA_ROW]) << 16;
      mma_bf16_16816(o[i], hi, b0, b1);
      mma_bf16_16816(o[i], lo, b0, b1);
    }
  }
}

// The chunk's rows [k0, k1) are taken MLA_KEYS at a time, on the tensor cores (mma.m16n8k16,
// bf16 in, fp32 sums; FlashMLA's scheme): every thread copies its share of the block's rows
// to shared memory (mla_load_block); the warps score the block (mla_scores), a warp per head
// moves its online softmax (mla_softmax), and the warps add the probability-weighted rows to the
// heads' sums, which stay in registers (mla_values). The queries and probabilities are split into
// bf16 hi + lo, so scores and sums keep ~16 significand bits of the fp32 reference's 24; the rows
// are bf16 as cached. Each row is read from L2 once. Blocks alternate between two buffers, the
// stage's rows and `spare` (a ring page), so that a block's copies are issued as the block before
// it begins and land while it is computed: with one buffer each block after the first began with
// a round trip, ~1 of its ~3 µs (docs/performance.md, session 36). The first block's copies are
// the caller's, issued before it stages the queries, or, `first_in_spare`, the loader's, into
// `spare` (load_mla_page; the next block then goes in the stage's rows); `next` is the row id of
// this thread's key in the second block, and each later block's is read a block ahead.
__device__ void mla_chunk(const Params& p, const int* t, const MlaStage& m, __nv_bfloat16* spare, long long pos,
                          long long k0, long long k1, long long next, bool first_in_spare, float (&o)[MLA_OT][4],
                          int ct) {
  const int warp = ct >> 5, lane = ct & 31;
  bool odd = first_in_spare;  // the block's rows are in spare
  for (long long b0 = k0; b0 < k1; b0 += MLA_KEYS, odd = !odd) {
    cp_async_wait_all();
    compute_sync();  // the block's rows (and, at the first, the queries); every warp is done with
                     // the block before, whose buffer the next block's copies take
    __nv_bfloat16* rows = odd ? spare : m.rows();
    if (b0 + MLA_KEYS < k1) mla_load_block(p, t, odd ? m.rows() : spare, next, ct);
    next = mla_block_row(p, t, pos, b0 + 2 * MLA_KEYS, k1, ct);
    mla_scores(m, rows, warp, lane);
    compute_sync();
    mla_softmax(m, static_cast<int>(min(static_cast<long long>(MLA_KEYS), k1 - b0)), warp, lane);
    compute_sync();
    mla_values(m, rows, o, warp, lane);
  }
}

// A chunk's result (the layout the merge reads): per head its MLA_RANK sums (o: mla_values'
// tiles), its max and its sum. Laid out in shared memory first (over the queries, which the
// last block's scores were the last to read), then copied out 8 bytes a thread, a warp's stores
// one run of 256 bytes: each thread storing its tiles' sums to global memory, 4 bytes at a time
// in rows 2056 bytes apart, took ~2.2 us a DeepSeek-V3.2 task, this ~1.2 (H200).
__device__ void mla_write_part(float* part, const MlaStage& m, const float (&o)[MLA_OT][4], int ct) {
  const int warp = ct >> 5, lane = ct & 31, g = lane >> 2;
  float* staged = reinterpret_cast<float*>(m.q());
  static_assert(MLA_PART <= MLA_ROWS_AT, "a chunk's result fits where the queries were staged");
  compute_sync();  // an empty chunk ran no block, whose barriers order the queries' staging first
#pragma unroll
  for (int i = 0; i < MLA_OT; ++i) {
    const int n = (warp + i * COMPUTE_WARPS) * 8 + 2 * (lane & 3);
    if (n >= MLA_RANK) break;
    for (int r = 0; r < 2; ++r) {
      if (g + 8 * r >= MLA_HEADS) break;
      *reinterpret_cast<float2*>(staged + (g + 8 * r) * (MLA_RANK + 2) + n) =
          make_float2(o[i][2 * r], o[i][2 * r + 1]);
    }
  }
  for (int h = ct; h < MLA_HEADS; h += NT)
    *reinterpret_cast<float2*>(staged + h * (MLA_RANK + 2) + MLA_RANK) =
        make_float2(m.st()[h], m.st()[MLA_HEADS + h]);
  compute_sync();
  for (int i = ct; i < MLA_PART / 2; i += NT)
    __stcg(reinterpret_cast<float2*>(part) + i, reinterpret_cast<const float2*>(staged)[i]);
}

// One context chunk (mla_keys) of one group of MLA_HEADS heads (F_ROW0): stage the heads'
// queries (mla_stage_queries); run the chunk; leave (sums, max, sum) per head in mla_partials
// (F_AUX3), which v expansion merges (stage_merged_heads). The task takes the ring's next page,
// in which the loader has put the RoPE factors and, when mla_first_block_early, the first key
// block's rows (load_mla_page), for every other block's rows (mla_chunk), and gives it back in
// mla_release_page, after its signal: the loader's next bulk copy into the slot would otherwise
// share the SM's path from L2 with the acknowledgements of the result's stores, which the
// signal's release waits for.
__device__ void run_mla_attention(const Params& p, Shared& s, const int* t, long long pos, uint32_t& consumed,
                                  int ct) {
  const int g = t[F_ROW0], chunks = t[F_COUNT], c = t[F_CHUNK];
  const MlaKeys ch = mla_keys(t, pos);
  const bool early = mla_first_block_early(pos, ch);
  const MlaStage stage{s.vec};
  const int slot = consumed % RING_PAGES;
  uint8_t* page = s.ring + slot * PAGE_BYTES;
  // the first two blocks' row ids (with DSA past DSA_TOPK a round trip to L2), then the first
  // block's copies, in flight while the queries stage
  const long long row = early ? -1 : mla_block_row(p, t, pos, ch.k0, ch.k1, ct);
  const long long second = mla_block_row(p, t, pos, ch.k0 + MLA_KEYS, ch.k1, ct);
  for (int h = ct; h < MLA_HEADS; h += NT) {
    stage.st()[h] = -INFINITY;
    stage.st()[MLA_HEADS + h] = 0.f;
  }
  if (!early) mla_load_block(p, t, stage.rows(), row, ct);
  ring_wait(p, &s.full[slot], (consumed / RING_PAGES) & 1, nullptr);  // the factors (and the block)
  mla_stage_queries(p, t, stage, reinterpret_cast<const float*>(page + MLA_FACTORS_AT), g, ct);
  float acc[MLA_OT][4] = {};
  mla_chunk(p, t, stage, reinterpret_cast<__nv_bfloat16*>(page), pos, ch.k0, ch.k1, second, early, acc, ct);
  // this thread's copies into the page (generic proxy) come before the loader's next bulk copies
  // into the slot (async proxy), which the page's release (mla_release_page) lets it issue
  fence_proxy_async_shared();
  mla_write_part(p.act + t[F_AUX3] + (static_cast<long long>(g) * chunks + c) * MLA_PART, stage, acc, ct);
}

// The page run_mla_attention took, given back once the task has signalled (`consumed` counts it):
// the signalling thread is then past its release, so the result's stores are acknowledged. After
// every warp's last read of the page; the page's group alone arrives (the slot's `empty` barrier
// counts one group's threads).
__device__ void mla_release_page(Shared& s, uint32_t& consumed, int ct) {
  compute_sync();
  if ((ct >> 5) / GROUP_WARPS == static_cast<int>(consumed % PAGE_GROUPS)) release_page(s, consumed % RING_PAGES);
  ++consumed;
}
#endif  // MLA
