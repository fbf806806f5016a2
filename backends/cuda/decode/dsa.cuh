// ---- compute: the DSA lightning indexer (ir/dsa.py) ----------------------------------------
#if DSA
// The layer's index key cache holds one bf16 row of DSA_DIM per position. A token's score is
// Σ_h w[h] · DSA_HEAD_WEIGHT_SCALE · relu(q[h] · k · DSA_SOFTMAX_SCALE) over the indexer's
// DSA_HEADS query heads q and head weights w; queries and keys are rotated on their first MLA_ROPE
// dims with MLA's RoPE table (codegen checks the parameters agree), paired DSA_ROPE_INTERLEAVED.
// Both scales are positive, so they are folded into w: relu(a · s) = s · relu(a).
static_assert(MLA, "the DSA indexer selects the tokens MLA attention attends to");
// The tensor-core tiling of run_dsa_score (passes/residency.py: dsa_staged_floats sizes it alike;
// DSA_KEYS key rows are staged and scored at a time):
constexpr int DSA_MT = (DSA_HEADS + 15) / 16;             // m-tiles of 16 heads, the last zero-padded
constexpr int DSA_KSTEPS = (DSA_DIM + 15) / 16;           // k-steps of a score, the last zero-padded
constexpr int DSA_ROW = (DSA_DIM + 63) / 64 * 64 + 8;     // bf16 a staged key row (or query) takes
constexpr int DSA_PIECES = DSA_DIM / 8;                   // 16-byte pieces of a key row
// DsaStage's parts, floats into s.vec
constexpr int DSA_ROWS_AT = DSA_MT * 16 * DSA_ROW, DSA_PART_AT = DSA_ROWS_AT + DSA_KEYS * DSA_ROW / 2;
constexpr int DSA_W_AT = DSA_PART_AT + DSA_MT * DSA_KEYS, DSA_NORM_AT = DSA_W_AT + DSA_MT * 16;
constexpr int DSA_STAGED = DSA_NORM_AT + DSA_DIM;
static_assert(DSA_DIM % 8 == 0 && DSA_DIM >= MLA_ROPE, "key rows are whole 16-byte pieces, rotated in front");
static_assert(MLA_ROPE % 8 == 0, "the queries' rotated dims are whole 4-dim units, partners' too");
static_assert(NT % DSA_KEYS == 0, "whole threads per staged key row");
static_assert(DSA_STAGED <= MAX_K, "the DSA indexer's staging exceeds s.vec");

// run_dsa_score's shared memory, carved from s.vec; rows and queries DSA_ROW bf16 apart (a
// multiple of 64, plus 8: a warp's fragment loads fall on 32 distinct banks, as MlaStage's).
struct DsaStage {
  float* vec;
  // [2][DSA_MT * 16][DSA_ROW]: the rotated queries, bf16 hi | lo, zero past DSA_HEADS and DSA_DIM
  __device__ __forceinline__ __nv_bfloat16* q() const { return reinterpret_cast<__nv_bfloat16*>(vec); }
  // [DSA_KEYS][DSA_ROW]: a block's key rows, zero past its keys
  __device__ __forceinline__ __nv_bfloat16* rows() const { return reinterpret_cast<__nv_bfloat16*>(vec + DSA_ROWS_AT); }
  __device__ __forceinline__ float* part() const { return vec + DSA_PART_AT; }  // [DSA_MT][DSA_KEYS]: per m-tile
  __device__ __forceinline__ float* w() const { return vec + DSA_W_AT; }        // [DSA_MT * 16]: 0 past DSA_HEADS
  __device__ __forceinline__ float* norm() const { return vec + DSA_NORM_AT; }  // [DSA_DIM]: the step's key
};

// The step's key, by one warp: LayerNorm of the key projection (F_AUX2; weight F_AUX3, bias
// F_NORM_BIAS, eps F_EPS, biased variance as torch's layer_norm), RoPE on its first MLA_ROPE dims
// (the table's cos | sin at pos), written as row `pos` of the index key cache (F_KCACHE) and, when
// `staged` is given, to that staged row. The key, weight and bias are loaded at once (one round
// trip to L2); mean and variance come from registers; the normed key goes through `norm` so that
// a lane can rotate dims another lane normed.
constexpr int DSA_PER_LANE = (DSA_DIM + 31) / 32;
__device__ void dsa_append_key(const Params& p, const int* t, const DsaStage& m, long long pos,
                               __nv_bfloat16* staged, int lane) {
  const float* k = p.act + t[F_AUX2];
  const float* gamma = p.act + t[F_AUX3];
  const float* beta = p.act + t[F_NORM_BIAS];
  float x[DSA_PER_LANE], g[DSA_PER_LANE], b[DSA_PER_LANE];
  float sum = 0.f;
#pragma unroll
  for (int u = 0; u < DSA_PER_LANE; ++u) {
    const int d = lane + 32 * u;
    const bool in = d < DSA_DIM;
    x[u] = in ? __ldcg(k + d) : 0.f;
    g[u] = in ? __ldcg(gamma + d) : 0.f;
    b[u] = in ? __ldcg(beta + d) : 0.f;
    sum += x[u];
  }
  const float mean = warp_sum(sum) / DSA_DIM;
  float ss = 0.f;
#pragma unroll
  for (int u = 0; u < DSA_PER_LANE; ++u)
    if (lane + 32 * u < DSA_DIM) ss += (x[u] - mean) * (x[u] - mean);
  const float rstd = rsqrtf(warp_sum(ss) / DSA_DIM + __int_as_float(t[F_EPS]));
#pragma unroll
  for (int u = 0; u < DSA_PER_LANE; ++u)
    if (lane + 32 * u < DSA_DIM) m.norm()[lane + 32 * u] = (x[u] - mean) * rstd * g[u] + b[u];
  __syncwarp();
  const float* cs = p.act + p.rope_offset + pos * MLA_ROPE;
  __nv_bfloat16* row = p.kv + t[F_KCACHE] + pos * DSA_DIM;
  for (int d = lane; d < 16 * DSA_KSTEPS; d += 32) {
    float v = d < DSA_DIM ? m.norm()[d] : 0.f;
    if (d < MLA_ROPE) {
      const int pair = rope_pair_of(d, DSA_ROPE_INTERLEAVED);
      const int2 at = rope_pair(pair, DSA_ROPE_INTERLEAVED);
      const float2 r = rope_rotate(m.norm()[at.x], m.norm()[at.y], cs, pair);
      v = d == at.x ? r.x : r.y;
    }
    const __nv_bfloat16 h = __float2bfloat16(v);
    if (d < DSA_DIM) row[d] = h;
    if (staged) staged[d] = h;
  }
}

// The queries (F_IN, [DSA_HEADS][DSA_DIM] fp32), rotated on their first MLA_ROPE dims at pos, as
// bf16 hi | lo, and the head weights (F_AUX) times both scales. A thread takes 4 dims of a head
// at a time (a 16-byte load, and its RoPE partners' 16 bytes), its loads in flight together.
constexpr int DSA_UNITS = DSA_MT * 16 * DSA_KSTEPS * 4;  // 4-dim units of the padded queries
__device__ void dsa_stage_queries(const Params& p, const int* t, const DsaStage& m, long long pos, int ct) {
  const float* q = p.act + t[F_IN];
  const float* cs = p.act + p.rope_offset + pos * MLA_ROPE;
#pragma unroll 4
  for (int i = ct; i < DSA_UNITS; i += NT) {
    const int h = i / (DSA_KSTEPS * 4), d0 = i % (DSA_KSTEPS * 4) * 4;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (h < DSA_HEADS && d0 < DSA_DIM) v = __ldcg(reinterpret_cast<const float4*>(q + h * DSA_DIM + d0));
    if (h < DSA_HEADS && d0 < MLA_ROPE) {  // partners: the same 4 dims (interleaved), or MLA_ROPE / 2 away
      const int o = DSA_ROPE_INTERLEAVED ? d0 : d0 < MLA_ROPE / 2 ? d0 + MLA_ROPE / 2 : d0 - MLA_ROPE / 2;
      const float4 w = __ldcg(reinterpret_cast<const float4*>(q + h * DSA_DIM + o));
      const float a[4] = {v.x, v.y, v.z, v.w}, b[4] = {w.x, w.y, w.z, w.w};
      float r[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int d = d0 + j, pair = rope_pair_of(d, DSA_ROPE_INTERLEAVED);
        const int2 at = rope_pair(pair, DSA_ROPE_INTERLEAVED);
        // this dim and its partner, in (x, y) order of the pair
        const float self = a[j], other = DSA_ROPE_INTERLEAVED ? a[j ^ 1] : b[j];
        const float2 rot = d == at.x ? rope_rotate(self, other, cs, pair) : rope_rotate(other, self, cs, pair);
        r[j] = d == at.x ? rot.x : rot.y;
      }
      v = make_float4(r[0], r[1], r[2], r[3]);
    }
    __nv_bfloat16* hi = m.q() + h * DSA_ROW + d0;
    __nv_bfloat16* lo = hi + DSA_MT * 16 * DSA_ROW;
    bf16_split(v.x, hi, lo);
    bf16_split(v.y, hi + 1, lo + 1);
    bf16_split(v.z, hi + 2, lo + 2);
    bf16_split(v.w, hi + 3, lo + 3);
  }
  for (int h = ct; h < DSA_MT * 16; h += NT)
    m.w()[h] = h < DSA_HEADS ? __ldcg(p.act + t[F_AUX] + h) * (DSA_HEAD_WEIGHT_SCALE * DSA_SOFTMAX_SCALE) : 0.f;
}

// Issues the copies of the block of keys [b0, min(b0 + DSA_KEYS, k1)) (zero past k1), NT / DSA_KEYS
// threads a row, asynchronously: the caller waits (cp_async_wait_all) and publishes them with a
// barrier. Row `skip`, the step's key being appended, is left to dsa_append_key.
constexpr int DSA_ROW_THREADS = NT / DSA_KEYS;
__device__ __forceinline__ void dsa_load_block(const Params& p, const int* t, const DsaStage& m, long long b0,
                                               long long k1, long long skip, int ct) {
  const int j = ct / DSA_ROW_THREADS;
  if (b0 + j == skip) return;
  stage_row(reinterpret_cast<uint4*>(m.rows() + j * DSA_ROW),
            reinterpret_cast<const uint4*>(p.kv + t[F_KCACHE] + (b0 + j) * DSA_DIM), b0 + j < k1, DSA_PIECES,
            2 * DSA_KSTEPS, ct % DSA_ROW_THREADS, DSA_ROW_THREADS);
}

// The staged block's scores, nb keys: S = Q K^T on the tensor cores, a warp's item an m-tile of 16
// heads times an n-tile of 8 keys over every k-step (Q hi and Q lo an mma each, fp32 sums); then
// in registers w[h] relu(S[h][key]), summed over the tile's 16 heads by a fixed shuffle tree, to
// part[m-tile][key]. Items of n-tiles past nb are skipped.
__device__ __forceinline__ void dsa_scores(const DsaStage& m, int nb, int warp, int lane) {
  const int g = lane >> 2, q = lane & 3, tiles = (nb + 7) / 8;
  for (int item = warp; item < DSA_MT * tiles; item += COMPUTE_WARPS) {
    const int mt = item % DSA_MT, n0 = item / DSA_MT * 8;
    const __nv_bfloat16* row = m.rows() + (n0 + g) * DSA_ROW + 2 * q;  // B: key n0 + g, dims 2q, 2q + 1
    const __nv_bfloat16* qs = m.q() + mt * 16 * DSA_ROW;
    float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int k = 0; k < DSA_KSTEPS; ++k) {
      const uint32_t b0 = bf16_pair(row + 16 * k), b1 = bf16_pair(row + 16 * k + 8);
      uint32_t a[4];
      mla_a_fragment(a, qs, DSA_ROW, 16 * k, lane);
      mma_bf16_16816(d, a, b0, b1);
      mla_a_fragment(a, qs + DSA_MT * 16 * DSA_ROW, DSA_ROW, 16 * k, lane);
      mma_bf16_16816(d, a, b0, b1);
    }
    const float w0 = m.w()[mt * 16 + g], w1 = m.w()[mt * 16 + g + 8];
    float s0 = fmaf(w0, fmaxf(d[0], 0.f), w1 * fmaxf(d[2], 0.f));  // key n0 + 2q
    float s1 = fmaf(w0, fmaxf(d[1], 0.f), w1 * fmaxf(d[3], 0.f));  // key n0 + 2q + 1
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {  // over g: lanes q, q + 4, ..., q + 28
      s0 += __shfl_xor_sync(0xffffffffu, s0, o);
      s1 += __shfl_xor_sync(0xffffffffu, s1, o);
    }
    if (g == 0) {
      m.part()[mt * DSA_KEYS + n0 + 2 * q] = s0;
      m.part()[mt * DSA_KEYS + n0 + 2 * q + 1] = s1;
    }
  }
}

// One context chunk of the indexer's scores (F_CHUNK of F_COUNT, cut as attention cuts it), on the
// tensor cores (mma.m16n8k16, bf16 in, fp32 sums; as mla_chunk): the first block's key rows are
// copied to shared memory (cp.async) while the queries are staged as bf16 hi + lo (so that scores
// keep ~16 significand bits of the fp32 reference's 24; the keys are bf16 as cached) and, in the
// last chunk, which holds the current position, one warp appends the step's key (to the cache and
// to its staged row). Each block of DSA_KEYS rows is scored by the warps (dsa_scores), and a thread
// per key adds its m-tiles' sums in order (deterministic) into F_OUT at the key's position.
__device__ void run_dsa_score(const Params& p, Shared& s, const int* t, long long pos, int ct) {
  const int warp = ct >> 5, lane = ct & 31, chunks = t[F_COUNT], c = t[F_CHUNK];
  const long long n = pos + 1, k0 = chunk_start(n, c, chunks), k1 = chunk_start(n, c + 1, chunks);
  const DsaStage m{s.vec};
  dsa_load_block(p, t, m, k0, k1, pos, ct);
  if (c == chunks - 1 && warp == COMPUTE_WARPS - 1)
    dsa_append_key(p, t, m, pos, pos < k0 + DSA_KEYS ? m.rows() + (pos - k0) * DSA_ROW : nullptr, lane);
  dsa_stage_queries(p, t, m, pos, ct);
  for (long long b0 = k0; b0 < k1; b0 += DSA_KEYS) {
    if (b0 != k0) dsa_load_block(p, t, m, b0, k1, -1, ct);  // after the last block's sums were read
    cp_async_wait_all();
    compute_sync();  // the rows (the appended one too, in the cache or staged), queries, weights
    const int nb = static_cast<int>(min(static_cast<long long>(DSA_KEYS), k1 - b0));
    dsa_scores(m, nb, warp, lane);
    compute_sync();
    for (int j = ct; j < nb; j += NT) {
      float score = 0.f;
#pragma unroll
      for (int mt = 0; mt < DSA_MT; ++mt) score += m.part()[mt * DSA_KEYS + j];
      __stcg(p.act + t[F_OUT] + b0 + j, score);
    }
  }
}

// The indexer's selection (ir/dsa.py: dsa_topk): of the n = pos + 1 tokens' scores (F_IN), the
// DSA_TOPK largest, equal scores going to the earlier token, written to F_OUT (int32) in
// increasing token order; up to DSA_TOPK tokens every one is chosen, and the list's unused
// entries are -1. Past DSA_TOPK, each thread takes a run of consecutive tokens, kth_largest finds
// the DSA_TOPK-th of the scores' order keys, every key above it is chosen and of those equal to
// it the first in token order (a block-wide prefix of the threads' counts of them); a second
// prefix places each thread's run. A thread's keys are read from L2 once and kept in shared
// memory (s.vec, unused by this task), its key j at j * NT + ct (no bank conflicts), as many as
// s.vec holds (TOPK_STAGED a thread: at 16 compute warps and MAX_K >= 4096, every key of a
// 4096-token context); any further ones are read from L2 where used, code compiled in only
// where the cache's capacity exceeds what s.vec holds (compiled into every kernel, that path
// cost the tp 8 DeepSeek-V3.2 kernel 8 B more of spills).
constexpr int TOPK_STAGED = MAX_K / NT;
constexpr bool TOPK_ALL_STAGED = TOPK_STAGED * NT >= MAX_SEQ;

__device__ void run_dsa_topk(const Params& p, Shared& s, const int* t, long long pos, int ct) {
  const int n = static_cast<int>(pos + 1);
  const float* scores = p.act + t[F_IN];
  int* ids = reinterpret_cast<int*>(p.act + t[F_OUT]);
  if (n <= DSA_TOPK) {
    for (int i = ct; i < DSA_TOPK; i += NT) __stcg(ids + i, i < n ? i : -1);
    return;
  }
  const int per = (n + NT - 1) / NT, lo = min(n, ct * per), hi = min(n, lo + per);
  // A score's order key, -0.0 taken as 0.0 (x + 0 is +0 for either zero): equal scores to the
  // interpreter's sort, whose tie rule then decides.
  auto key = [&](int i) { return order_key(__ldcg(scores + i) + 0.f); };
  uint32_t* staged = reinterpret_cast<uint32_t*>(s.vec) + ct;
  const int in_smem = min(per, TOPK_STAGED);
#pragma unroll 8
  for (int j = 0; j < in_smem; ++j) staged[j * NT] = lo + j < hi ? key(lo + j) : 0u;
  // f(key, token) for the thread's tokens in order, then (0, -1) for its run's places past the
  // context: as often in every lane of a warp
  auto tokens = [&](auto f) {
    for (int j = 0; j < per; ++j)
      f(lo + j >= hi ? 0u : TOPK_ALL_STAGED || j < in_smem ? staged[j * NT] : key(lo + j),
        lo + j < hi ? lo + j : -1);
  };
  const Kth kth = kth_largest(s, [&](auto f) { tokens([&](uint32_t k, int token) { f(k, token >= 0); }); },
                              DSA_TOPK, ct);
  int above = 0, equal = 0;
  tokens([&](uint32_t k, int token) {
    above += token >= 0 && k > kth.key;
    equal += token >= 0 && k == kth.key;
  });
  BlockCount sum{reinterpret_cast<int*>(s.red + SR_COUNT), 0};
  const int ties = max(0, min(equal, kth.ties - sum.before(equal, ct)));  // this thread's taken ties
  int at = sum.before(above + ties, ct), tied = 0;
  tokens([&](uint32_t k, int token) {
    if (token >= 0 && (k > kth.key || (k == kth.key && tied++ < ties))) __stcg(ids + at++, token);
  });
}
#endif  // DSA
