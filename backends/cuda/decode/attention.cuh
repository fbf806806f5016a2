// ---- compute: chunked attention, GQA (below) or MLA (further below) ------------------------
#if !MLA  // an MLA model's attention is run_mla_attention
// A chunked attention task arrives on its group's counter once its chunk's results are written
// (release) and learns whether it was the step's last of the group's `chunks` arrivals
// (acquire: the other chunks' results are then visible), which merges the group.
__device__ bool last_to_arrive(const Params& p, Shared& s, const int* t, int g, long long step, int chunks,
                               int ct) {
  compute_sync();
  if (ct == 0) {
    const unsigned before = atom_add_acq_rel(&p.counters[t[F_ARRIVE] + g], 1u);
    s.flags[4] = before == static_cast<unsigned>((step + 1) * chunks - 1);
  }
  compute_sync();
  return s.flags[4];
}

// ---- compute: attention, one context chunk of one KV group --------------------------------
// The context of a KV group is cut into F_COUNT chunks at run time (the context grows every
// step), one task each, on different SMs. Every chunk task stages the group's query heads and
// applies qk-norm (if the model has it) and RoPE; the last chunk, which holds the current
// position, also does so for the new key and appends key and value to the cache. The chunk's
// past keys and values arrive in ring pages (the loader's `load_kv_chunk`), this step's key is
// in shared memory; each warp runs an online softmax over a share of the keys for a set of the
// GROUP query heads (all of them, up to 4), the warps merge in shared memory, and the chunk's
// (max, sum, output) goes to global scratch. The last chunk task of the group to finish merges
// all chunks and is the one that signals the attention op.
//
// Inside a warp, LANES_PER_KEY lanes hold one key: each lane reads KV_DIMS dims of the key's
// row and of its value in one 8-byte (or 16-byte) load, so a score is reduced over those lanes
// only (4 shuffles for head_dim 64, not 5) and the warp works on KEYS_PER_WARP keys at once. A
// warp reads KEY_ROUNDS such sets before using any and rescales its running softmax once per
// set, not once per key. A warp keeps running sums for SET_HEADS query heads: groups of more
// than 4 heads are split into HEAD_SETS sets, each key read from shared memory by one warp of
// each set, because 8 heads of 128 dims left the sums 32 registers more than the kernel's cap and
// the inner loop spilled (Qwen3-32B: 5.6 of a task's 12 µs). Sets of more than 2 heads take 4
// dims per lane, so that their sums fit in registers.
constexpr int head_sets(int d = 1) {
  return d == GROUP || (GROUP % d == 0 && GROUP / d <= 4 && GROUP_WARPS % d == 0) ? d : head_sets(d + 1);
}
constexpr int HEAD_SETS = head_sets(), SET_HEADS = GROUP / HEAD_SETS;
static_assert(GROUP_WARPS % HEAD_SETS == 0, "every page group has a warp of each head set");
constexpr int KEY_WARPS = COMPUTE_WARPS / HEAD_SETS;  // warps that read a key: one of each set
constexpr int KV_DIMS = SET_HEADS <= 2 ? 8 : 4;
static_assert(HEAD_DIM % KV_DIMS == 0, "cache rows are read in pieces of KV_DIMS dims");
constexpr int pow2_at_least(int n) { return n <= 1 ? 1 : 2 * pow2_at_least((n + 1) / 2); }
constexpr int LANES_PER_KEY = pow2_at_least(HEAD_DIM / KV_DIMS);
static_assert(LANES_PER_KEY <= 32, "a key's row must fit one warp's lanes");
constexpr int KEYS_PER_WARP = 32 / LANES_PER_KEY;
constexpr int KEY_ROUNDS = 8 / KV_DIMS;  // 4 registers of keys and 4 of values per lane
constexpr int PART = GROUP * (HEAD_DIM + 2);  // floats of one chunk's result: out, max, sum
constexpr int PART16 = (PART + 3) & ~3;       // PART rounded up to whole 16-byte pieces
using KvPiece = std::conditional_t<KV_DIMS == 8, uint4, uint2>;
// The warps' partial results are summed in shared memory without atomics: a float atomicAdd on
// shared memory is a compare-and-swap loop, and 16 warps adding to the same addresses took most
// of an attention task (Qwen3-30B-A3B, 8 query heads of 128: 16 µs). The warps of key warp k
// (one of each head set: warps k HEAD_SETS + [0, HEAD_SETS)) add their rescaled sums to slot
// k % WARP_SLOTS (slot 0 is the task's `out`; the others lie where the merge stages chunk
// results later, room for ATTN_MERGE_CHUNKS of them), one slot-sized round of key warps at a
// time, then each sum is taken over the slots in order: the same bits every run.
constexpr int WARP_SLOTS = KEY_WARPS < ATTN_MERGE_CHUNKS + 1 ? KEY_WARPS : ATTN_MERGE_CHUNKS + 1;
static_assert((KEY_WARPS + 1) * GROUP <= MISC_FLOATS, "the warps' and the chunk's maxima exceed s.red");

// KV_DIMS bf16 values of a cache row, widened.
__device__ __forceinline__ void widen(const KvPiece& q, float (&f)[KV_DIMS]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&q);
#pragma unroll
  for (int j = 0; j < KV_DIMS / 2; ++j) {
    const float2 v = __bfloat1622float2(h[j]);
    f[2 * j] = v.x;
    f[2 * j + 1] = v.y;
  }
}

// Folds a running softmax (m2, l2, acc2) into (m, l, acc), both over disjoint sets of keys.
__device__ __forceinline__ void merge_softmax(float& m, float& l, float (&acc)[KV_DIMS], float m2, float l2,
                                              const float (&acc2)[KV_DIMS]) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) return;  // neither saw a key
  const float f = __expf(m - mx), f2 = __expf(m2 - mx);
  l = l * f + l2 * f2;
#pragma unroll
  for (int j = 0; j < KV_DIMS; ++j) acc[j] = acc[j] * f + acc2[j] * f2;
  m = mx;
}

// A round of a warp's keys makes ROUND_SCORES scores that a key's lanes share out (KEY_ROUNDS
// keys x SET_HEADS heads, score i = h KEY_ROUNDS + u), ROUND_SCORES_P with padding; score i ends
// at the key's lanes i SCORE_SPREAD .. + SCORE_SPREAD - 1 (spread_sum).
constexpr int ROUND_SCORES = KEY_ROUNDS * SET_HEADS, ROUND_SCORES_P = pow2_at_least(ROUND_SCORES);
constexpr int SCORE_SPREAD = LANES_PER_KEY / ROUND_SCORES_P;
static_assert(ROUND_SCORES_P <= LANES_PER_KEY, "a key has a lane for each of its round's scores");

// Sums each of v's ROUND_SCORES_P values over the LANES_PER_KEY lanes of a key and leaves sum i
// at the lanes sub / SCORE_SPREAD == i: each butterfly step over a lane bit keeps half of the
// values (the upper half where the bit is set) and takes the partner's half, so that P =
// ROUND_SCORES_P sums cost P - 1 + log2(SCORE_SPREAD) shuffles instead of P log2(LANES_PER_KEY).
__device__ __forceinline__ float spread_sum(float (&v)[ROUND_SCORES_P], int sub) {
#pragma unroll
  for (int c = ROUND_SCORES_P, o = LANES_PER_KEY / 2; c > 1; c /= 2, o /= 2) {
    const bool upper = sub & o;
#pragma unroll
    for (int i = 0; i < c / 2; ++i) {
      const float keep = upper ? v[c / 2 + i] : v[i], send = upper ? v[i] : v[c / 2 + i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
  }
  float s = v[0];
#pragma unroll
  for (int o = SCORE_SPREAD / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

// m[h] of the head the lane's score belongs to, by selects: an index that varies by lane would
// put m in local memory.
__device__ __forceinline__ float head_value(const float (&m)[SET_HEADS], int h) {
  float v = m[0];
#pragma unroll
  for (int k = 1; k < SET_HEADS; ++k) v = h == k ? m[k] : v;
  return v;
}

// The online softmax of SET_HEADS queries (q, in shared memory) over n keys whose bf16 rows
// (`keys`) and values' rows (`values`) are in shared memory: warp w of `warps` takes keys
// w * KEYS_PER_WARP + [0, KEYS_PER_WARP), then every round of warps * KEYS_PER_WARP after.
// Bounds are warp-uniform because the scores are reduced with shuffles. Each of a key's lanes
// ends a round's reduction with one of its ROUND_SCORES scores (spread_sum), takes that score's
// weight e^(s - max) and its head's rescaling e^(m - max) (two exponentials, not ROUND_SCORES +
// SET_HEADS on every lane), and the lanes share them by shuffles: the inner loop was bound by its
// instructions (Qwen3-32B: 4.75 us of a 9 us task for 64 keys, 40 shuffles and 12 exponentials
// a lane a round).
__device__ __forceinline__ void attend(const float* q, const uint8_t* keys, const uint8_t* values, int n, int w,
                                       int warps, int sub, int kw, float scale, float (&acc)[SET_HEADS][KV_DIMS],
                                       float (&m)[SET_HEADS], float (&l)[SET_HEADS]) {
  const bool dims_on = sub * KV_DIMS < HEAD_DIM;
  const KvPiece* kp = reinterpret_cast<const KvPiece*>(keys) + sub;
  const KvPiece* vp = reinterpret_cast<const KvPiece*>(values) + sub;
  const int round = KEYS_PER_WARP * warps;
  for (int wbase = w * KEYS_PER_WARP; wbase < n; wbase += round * KEY_ROUNDS) {
    KvPiece kr[KEY_ROUNDS], vr[KEY_ROUNDS];
#pragma unroll
    for (int u = 0; u < KEY_ROUNDS; ++u) {
      const int key = wbase + u * round + kw;
      const bool on = key < n && dims_on;
      kr[u] = on ? kp[key * (HEAD_DIM / KV_DIMS)] : KvPiece{};
      vr[u] = on ? vp[key * (HEAD_DIM / KV_DIMS)] : KvPiece{};
    }
    float d[ROUND_SCORES_P];
#pragma unroll
    for (int u = 0; u < KEY_ROUNDS; ++u) {
      float kf[KV_DIMS];
      widen(kr[u], kf);
#pragma unroll
      for (int h = 0; h < SET_HEADS; ++h) {
        const float* qh = q + h * HEAD_DIM + sub * KV_DIMS;
        float dot = 0.f;
#pragma unroll
        for (int j = 0; j < KV_DIMS; ++j) dot = fmaf(dims_on ? qh[j] : 0.f, kf[j], dot);
        d[h * KEY_ROUNDS + u] = dot;
      }
    }
#pragma unroll
    for (int i = ROUND_SCORES; i < ROUND_SCORES_P; ++i) d[i] = 0.f;
    const float dot = spread_sum(d, sub);
    // (derived here rather than before the loop: kept live across it, they spilled the step's state)
    const int mine = opaque(sub) / SCORE_SPREAD, my_head = mine / KEY_ROUNDS, my_round = mine % KEY_ROUNDS;
    const bool on = mine < ROUND_SCORES && wbase + my_round * round + kw < n;
    const float sc = on ? dot * scale : -INFINITY;
    float mx = sc;
#pragma unroll
    for (int o = SCORE_SPREAD; o < SCORE_SPREAD * KEY_ROUNDS; o <<= 1)  // the head's other keys' scores
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float old = head_value(m, my_head);
    mx = fmaxf(mx, old);
    const float e = sc == -INFINITY ? 0.f : exp_ftz(sc - mx);
    const float corr = mx == -INFINITY ? 1.f : exp_ftz(old - mx);  // 0 at the head's first key
    float vf[KEY_ROUNDS][KV_DIMS];
#pragma unroll
    for (int u = 0; u < KEY_ROUNDS; ++u) widen(vr[u], vf[u]);
#pragma unroll
    for (int h = 0; h < SET_HEADS; ++h) {
      const int src = kw * LANES_PER_KEY + h * KEY_ROUNDS * SCORE_SPREAD;  // lane of the head's first score
      const float c = __shfl_sync(0xffffffffu, corr, src);
      m[h] = __shfl_sync(0xffffffffu, mx, src);
      l[h] *= c;
#pragma unroll
      for (int j = 0; j < KV_DIMS; ++j) acc[h][j] *= c;
#pragma unroll
      for (int u = 0; u < KEY_ROUNDS; ++u) {
        const float eu = __shfl_sync(0xffffffffu, e, src + u * SCORE_SPREAD);
        l[h] += eu;
#pragma unroll
        for (int j = 0; j < KV_DIMS; ++j) acc[h][j] = fmaf(eu, vf[u][j], acc[h][j]);
      }
    }
  }
}

// gamma (qk-norm weight) and cs (this position's [HEAD_DIM/2 cos | HEAD_DIM/2 sin]) are staged
// in shared memory.
__device__ void norm_and_rope(float* v, const float* gamma, const float* cs, int lane) {
  if (QK_NORM) {
    float ss = 0.f;
    for (int d = lane; d < HEAD_DIM; d += 32) ss += v[d] * v[d];
    const float rstd = rsqrtf(warp_sum(ss) / HEAD_DIM + QK_NORM_EPS);
    __syncwarp();
    for (int d = lane; d < HEAD_DIM; d += 32) v[d] *= rstd * gamma[d];
    __syncwarp();
  }
  for (int i = lane; i < HEAD_DIM / 2; i += 32) {
    const int ia = ROPE_INTERLEAVED ? 2 * i : i, ib = ROPE_INTERLEAVED ? 2 * i + 1 : i + HEAD_DIM / 2;
    const float c = cs[i], sn = cs[HEAD_DIM / 2 + i];
    const float a = v[ia], b = v[ib];
    v[ia] = a * c - b * sn;
    v[ib] = b * c + a * sn;
  }
  __syncwarp();
}

__device__ bool run_attention(const Params& p, Shared& s, const int* t, long long step, long long pos,
                              uint32_t& consumed, int ct) {
  const int warp = ct >> 5, lane = ct & 31, g = t[F_ROW0], chunks = t[F_COUNT], c = t[F_CHUNK];
  const bool last_chunk = c == chunks - 1;
  const float* qkv = p.act + t[F_IN];
  float* q = s.vec;                       // [GROUP][HEAD_DIM]
  float* kv = s.vec + GROUP * HEAD_DIM;   // [2][HEAD_DIM]
  float* cs = kv + 2 * HEAD_DIM;          // [HEAD_DIM]: RoPE cos | sin at this position
  float* gq = cs + HEAD_DIM;              // [HEAD_DIM]: qk-norm weight of the queries
  float* gk = gq + HEAD_DIM;              // [HEAD_DIM]: qk-norm weight of the key
  float* out = gk + HEAD_DIM;             // [GROUP][HEAD_DIM + 2]: sums, then max and l
  for (int i = ct; i < GROUP * HEAD_DIM; i += COMPUTE_WARPS * 32) q[i] = __ldcg(qkv + g * GROUP * HEAD_DIM + i);
  for (int i = ct; i < HEAD_DIM; i += COMPUTE_WARPS * 32) {
    cs[i] = __ldcg(p.act + p.rope_offset + pos * HEAD_DIM + i);
    if (QK_NORM) {
      gq[i] = __ldcg(p.act + t[F_AUX] + i);
      gk[i] = __ldcg(p.act + t[F_AUX2] + i);
    }
  }
  if (last_chunk)
    for (int i = ct; i < HEAD_DIM; i += COMPUTE_WARPS * 32) {
      kv[i] = __ldcg(qkv + (N_HEADS + g) * HEAD_DIM + i);
      kv[HEAD_DIM + i] = __ldcg(qkv + (N_HEADS + N_KV_HEADS + g) * HEAD_DIM + i);
    }
  compute_sync();
  for (int v = warp; v <= GROUP; v += COMPUTE_WARPS) {  // vectors 0..GROUP-1: queries; GROUP: key
    const bool is_key = v == GROUP;
    if (is_key && !last_chunk) continue;
    norm_and_rope(is_key ? kv : q + v * HEAD_DIM, is_key ? gk : gq, cs, lane);
  }
  compute_sync();
  __nv_bfloat16* kc = p.kv + t[F_KCACHE] + static_cast<long long>(g) * MAX_SEQ * HEAD_DIM;
  __nv_bfloat16* vc = p.kv + t[F_VCACHE] + static_cast<long long>(g) * MAX_SEQ * HEAD_DIM;
  // This step's key and value, rounded to bf16 as the cache holds them: appended to the cache
  // and kept in shared memory (`cur`) for this task's own use.
  uint8_t* cur = reinterpret_cast<uint8_t*>(out + PART16);  // [2][HEAD_DIM] bf16, 16-byte aligned
  if (last_chunk) {
    __nv_bfloat16* curh = reinterpret_cast<__nv_bfloat16*>(cur);
    for (int i = ct; i < HEAD_DIM; i += COMPUTE_WARPS * 32) {
      kc[pos * HEAD_DIM + i] = curh[i] = __float2bfloat16(kv[i]);
      vc[pos * HEAD_DIM + i] = curh[HEAD_DIM + i] = __float2bfloat16(kv[HEAD_DIM + i]);
    }
    compute_sync();
  }
  const float scale = __int_as_float(t[F_SCALE]);
  const int sub = lane % LANES_PER_KEY, kw = lane / LANES_PER_KEY;  // the lane's dims and key
  const int group = warp / GROUP_WARPS, gw = warp % GROUP_WARPS;
  // the warp's query heads: set * SET_HEADS + [0, SET_HEADS); its key warp: kwarp
  const int set = warp % HEAD_SETS, kwarp = warp / HEAD_SETS;
  const float* qs = q + set * SET_HEADS * HEAD_DIM;
  float acc[SET_HEADS][KV_DIMS], m[SET_HEADS], l[SET_HEADS];
#pragma unroll
  for (int h = 0; h < SET_HEADS; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.f;
#pragma unroll
    for (int j = 0; j < KV_DIMS; ++j) acc[h][j] = 0.f;
  }
  // The past keys, page by page as the loader streams them (pages are dealt to the page groups
  // as a matrix-vector task's are), then this step's key.
  const KvChunk ch = kv_chunk(t, pos);
  for_each_page(p, s, ch.past, static_cast<long long>(KV_KEYS_PER_PAGE), group, consumed,
                [&](const uint8_t* page, long long, long long n) {
                  attend(qs, page, page + KV_KEYS_PER_PAGE * KV_ROW_BYTES, static_cast<int>(n), gw / HEAD_SETS,
                         GROUP_WARPS / HEAD_SETS, sub, kw, scale, acc, m, l);
                });
  if (last_chunk) attend(qs, cur, cur + KV_ROW_BYTES, 1, kwarp, KEY_WARPS, sub, kw, scale, acc, m, l);
  // Merge the warp's keys (lanes with the same dims), then the warps: the chunk's max per head,
  // then rescaled sums accumulated in shared memory by the lanes of the warp's first key.
#pragma unroll
  for (int o = LANES_PER_KEY; o < 32; o <<= 1)
#pragma unroll
    for (int h = 0; h < SET_HEADS; ++h) {
      float acc2[KV_DIMS];
#pragma unroll
      for (int j = 0; j < KV_DIMS; ++j) acc2[j] = __shfl_xor_sync(0xffffffffu, acc[h][j], o);
      const float m2 = __shfl_xor_sync(0xffffffffu, m[h], o), l2 = __shfl_xor_sync(0xffffffffu, l[h], o);
      merge_softmax(m[h], l[h], acc[h], m2, l2, acc2);
    }
  // [KEY_WARPS][GROUP]: the warps' maxima (warp w's heads at w SET_HEADS), then the chunk's
  float* wm = s.red;
  float* chunk_max = wm + KEY_WARPS * GROUP;
  if (lane == 0)
    for (int h = 0; h < SET_HEADS; ++h) wm[warp * SET_HEADS + h] = m[h];
  compute_sync();  // also: every warp is done reading `cur`, which the first slot after `out` overwrites
  if (ct < GROUP) {
    float mx = -INFINITY;
    for (int w = 0; w < KEY_WARPS; ++w) mx = fmaxf(mx, wm[w * GROUP + ct]);
    chunk_max[ct] = mx;
  }
  compute_sync();
  for (int round = 0; round * WARP_SLOTS < KEY_WARPS; ++round) {
    if (kwarp / WARP_SLOTS == round) {
      // opaque: no spill in llama-3.2-1b
      float* slot = out + ((opaque(ct) >> 5) / HEAD_SETS % WARP_SLOTS) * PART + set * SET_HEADS * (HEAD_DIM + 2);
#pragma unroll
      for (int h = 0; h < SET_HEADS; ++h) {
        const float f = m[h] == -INFINITY ? 0.f : __expf(m[h] - chunk_max[set * SET_HEADS + h]);
        if (kw == 0 && sub * KV_DIMS < HEAD_DIM)
#pragma unroll
          for (int j = 0; j < KV_DIMS; ++j) {
            float& o = slot[h * (HEAD_DIM + 2) + sub * KV_DIMS + j];
            o = (round ? o : 0.f) + acc[h][j] * f;
          }
        if (lane == 0) {
          float& o = slot[h * (HEAD_DIM + 2) + HEAD_DIM + 1];
          o = (round ? o : 0.f) + l[h] * f;
        }
      }
    }
    compute_sync();
  }
  // The chunk's result: per head the slots' sums in slot order, and the warps' max.
  float* parts = p.act + t[F_AUX3] + static_cast<long long>(g) * chunks * PART;
  for (int i = ct; i < PART; i += COMPUTE_WARPS * 32) {
    float v = 0.f;
    if (i % (HEAD_DIM + 2) == HEAD_DIM)
      v = chunk_max[opaque(i) / (HEAD_DIM + 2)];
    else
      for (int b = 0; b < WARP_SLOTS; ++b) v += out[b * PART + i];
    __stcg(parts + c * PART + i, v);
  }
  if (!last_to_arrive(p, s, t, g, step, chunks, ct)) return false;
  // Merge the group's chunks: every chunk's max and sum per head, and the chunk results
  // ATTN_MERGE_CHUNKS at a time through shared memory (passes/tiling.py: as many as fit a third
  // of it). A batch arrives by asynchronous 16-byte copies, all of them in flight at once: one
  // round trip to L2 a batch (loads into registers kept 16 a thread in flight, three round trips
  // for Qwen3-32B's 66 KB); the maxima and sums are loaded while the first batch is on its way.
  // A warp per head turns the maxima into each chunk's factor and sums the denominator, a lane
  // a chunk; then each output is summed over the chunks in order.
  float* staged = out + PART16;  // 16-byte aligned, ATTN_MERGE_CHUNKS * PART + 8 floats
  float* stats = staged + ATTN_MERGE_CHUNKS * PART + 8;  // [chunks][GROUP][2]: max, then factor (-1: empty); sum
  float* den = stats + 2 * chunks * GROUP;               // [GROUP]
  // Copies chunk results k0.. from the 16-byte boundary at or below the first (PART is not a
  // multiple of 4 floats when GROUP is odd) and returns where the first landed; the copies end
  // at most 3 floats past the last result, inside the buffer's aligned end (passes/residency.py).
  const auto stage = [&](int k0) {
    const float* src = parts + k0 * PART;
    const int lead = static_cast<int>(reinterpret_cast<uintptr_t>(src) >> 2 & 3);
    const int pieces = (min(ATTN_MERGE_CHUNKS, chunks - k0) * PART + lead + 3) / 4;
    const uint4* from = reinterpret_cast<const uint4*>(src - lead);
    for (int i = ct; i < pieces; i += COMPUTE_WARPS * 32) cp_async16(staged + 4 * i, from + i);
    return static_cast<const float*>(staged + lead);
  };
  const float* batch = stage(0);
  // (opaque here and at the chunk's max above: their first addresses, hoisted out of the step
  // loop, were held through the kernel and spilled: llama-3.2-1b, qwen3-32b FP8, session 44)
  for (int i = opaque(ct); i < chunks * GROUP; i += COMPUTE_WARPS * 32) {
    const float* pk = parts + (i / GROUP) * PART + (i % GROUP) * (HEAD_DIM + 2) + HEAD_DIM;
    stats[2 * i] = __ldcg(pk);
    stats[2 * i + 1] = __ldcg(pk + 1);
  }
  cp_async_wait_all();
  compute_sync();
  for (int h = warp; h < GROUP; h += COMPUTE_WARPS) {  // a warp per head, a lane per chunk
    float mx = -INFINITY, sum = 0.f;
    for (int k = lane; k < chunks; k += 32) mx = fmaxf(mx, stats[2 * (k * GROUP + h)]);
    mx = warp_max(mx);
    for (int k = lane; k < chunks; k += 32) {
      float* st = stats + 2 * (k * GROUP + h);
      const bool empty = st[0] == -INFINITY;  // a chunk without keys (context shorter than the chunk count)
      st[0] = empty ? -1.f : __expf(st[0] - mx);
      if (!empty) sum += st[1] * st[0];
    }
    sum = warp_sum(sum);
    if (lane == 0) den[h] = sum;
  }
  compute_sync();
  constexpr int OUTS = (GROUP * HEAD_DIM + COMPUTE_WARPS * 32 - 1) / (COMPUTE_WARPS * 32);  // a thread's outputs
  float num[OUTS];
#pragma unroll
  for (int e = 0; e < OUTS; ++e) num[e] = 0.f;
  for (int k0 = 0;;) {
    const int kn = min(ATTN_MERGE_CHUNKS, chunks - k0);
#pragma unroll
    for (int e = 0; e < OUTS; ++e) {
      const int i = ct + e * COMPUTE_WARPS * 32, h = min(i / HEAD_DIM, GROUP - 1), d = i % HEAD_DIM;
      for (int k = 0; k < kn; ++k) {
        const float f = stats[2 * ((k0 + k) * GROUP + h)];
        if (f >= 0.f) num[e] += batch[k * PART + h * (HEAD_DIM + 2) + d] * f;
      }
    }
    k0 += ATTN_MERGE_CHUNKS;
    if (k0 >= chunks) break;
    compute_sync();  // every thread is done with the batch before the next overwrites it
    batch = stage(k0);
    cp_async_wait_all();
    compute_sync();
  }
  float* o = p.act + t[F_OUT] + g * GROUP * HEAD_DIM;
#pragma unroll
  for (int e = 0; e < OUTS; ++e) {
    const int i = ct + e * COMPUTE_WARPS * 32;
    if (i < GROUP * HEAD_DIM) __stcg(o + i, num[e] / den[i / HEAD_DIM]);
  }
  return true;
}
#endif  // !MLA
