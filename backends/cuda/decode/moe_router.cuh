// ---- compute: the MoE router (ir/moe.py: route) ---------------------------------------------
#if MOE
// Scores in fp32: the softmax of the experts' logits (Qwen3-MoE) or each logit's sigmoid
// (MOE_SIGMOID, DeepSeek-V3). Experts are selected by their scores plus the correction bias
// (MOE_BIAS), within the MOE_TOPK_GROUP of MOE_GROUPS groups whose two best such values sum
// highest (the others' values set to -inf, as route() masks them: limit_groups); the MOE_TOP_K
// best, best first (equal values: the lower expert first, as ir/moe.py: top defines it;
// run_moe_topk). The weights are the chosen experts' scores, renormalized when
// MOE_NORM_TOPK_PROB, times MOE_SCALING. The order is total (NaN above every value, as torch's
// sort puts it), so that every expert has its own rank and even NaN logits give valid, distinct
// ids: the loader trusts them.
__device__ __forceinline__ bool routed_before(float v, int e, float w, int f) {
  if ((v != v) != (w != w)) return v != v;
  return v > w || (!(v < w) && e < f);
}

#if TP > 1
// Expert parallelism (passes/sharding.py): every rank routes the token alike, and rank r keeps
// the chosen experts it holds, [r MOE_LOCAL, (r + 1) MOE_LOCAL), best first, in slots
// [0, n) as indices among its own experts, with their combine weights; slots [n, MOE_SLOTS)
// get id -1 (no expert here: neither loaded nor computed, see busy_slots) and weight 0. Lane k
// holds the k-th choice; its slot is the number of local choices before it (a scan over lanes).
__device__ void route_local(const Params& p, const int* t, int ct, float weight, int id) {
  const int here = ct < MOE_TOP_K && id / MOE_LOCAL == p.rank;
  int before = here;  // inclusive scan of `here` over lanes
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, before, o);
    if (ct >= o) before += v;
  }
  const int n = __shfl_sync(0xffffffffu, before, 31);
  int* ids = reinterpret_cast<int*>(p.act + t[F_OUT]);
  if (here) {
    __stcg(ids + before - 1, id - static_cast<int>(p.rank) * MOE_LOCAL);
    __stcg(p.act + t[F_AUX] + before - 1, weight * MOE_SCALING);
  }
  if (ct >= n && ct < MOE_SLOTS) {  // lane ct >= n is not the slot of a local choice
    __stcg(ids + ct, -1);
    __stcg(p.act + t[F_AUX] + ct, 0.f);
  }
}
#endif

// A selection value's order as a 32-bit key, larger first: NaN above every number, -0 equal to
// 0. Every value's key is at least value_key(-inf) > 0, so 0 marks a slot without an expert.
__device__ __forceinline__ uint32_t value_key(float v) { return v != v ? 0xffffffffu : order_key(v + 0.f); }
// The total order: the value's key, then the lower expert. Expert f is chosen before e iff its
// key is larger.
__device__ __forceinline__ unsigned long long route_key(uint32_t value, int e) {
  return static_cast<unsigned long long>(value) << 32 | (0xffffffffu - static_cast<uint32_t>(e));
}
__device__ __forceinline__ int route_expert(unsigned long long key) {  // route_key's e
  return static_cast<int>(0xffffffffu - static_cast<uint32_t>(key));
}

// The router's slots: compute thread ct holds slots ct, ct + NT, ...; a slot holds one expert or
// none (key 0), in expert order. Under a group limit a group takes a power of two of slots, its
// experts first, so that a group's slots are an aligned run of a warp's lanes (or whole warps)
// and its two best values a butterfly of shuffles over them; otherwise slot e is expert e.
#if MOE_TOPK_GROUP < MOE_GROUPS
static_assert(MOE_EXPERTS % MOE_GROUPS == 0, "groups of equal size");
constexpr int GROUP_EXPERTS = MOE_EXPERTS / MOE_GROUPS;
constexpr int pow2_at_least(int n) { return n <= 1 ? 1 : 2 * pow2_at_least((n + 1) / 2); }
constexpr int GROUP_SLOTS = pow2_at_least(GROUP_EXPERTS);
constexpr int ROUTE_SLOTS = MOE_GROUPS * GROUP_SLOTS;
constexpr int PIECE_SLOTS = GROUP_SLOTS < 32 ? GROUP_SLOTS : 32;  // a group's slots in one warp
constexpr int PIECES_PER_GROUP = GROUP_SLOTS / PIECE_SLOTS, ROUTE_PIECES = ROUTE_SLOTS / PIECE_SLOTS;
__device__ __forceinline__ bool slot_has_expert(int s) { return s < ROUTE_SLOTS && s % GROUP_SLOTS < GROUP_EXPERTS; }
__device__ __forceinline__ int slot_expert(int s) { return s / GROUP_SLOTS * GROUP_EXPERTS + s % GROUP_SLOTS; }
#else
constexpr int ROUTE_SLOTS = MOE_EXPERTS, ROUTE_PIECES = 0;
__device__ __forceinline__ bool slot_has_expert(int s) { return s < MOE_EXPERTS; }
__device__ __forceinline__ int slot_expert(int s) { return s; }
#endif
constexpr int SLOTS_PER_THREAD = (ROUTE_SLOTS + NT - 1) / NT;
constexpr int ROUTE_CHUNKS = (ROUTE_SLOTS + 31) / 32;       // a warp's 32 slots at a time
constexpr int SCORE_WARPS = ROUTE_CHUNKS < COMPUTE_WARPS ? ROUTE_CHUNKS : COMPUTE_WARPS;  // with slots
constexpr int ROUTE_CANDIDATES = ROUTE_CHUNKS * MOE_TOP_K;  // each chunk's MOE_TOP_K best
static_assert(MOE_TOP_K <= 32 && MOE_TOP_K <= MOE_EXPERTS, "a chunk ranks 32 slots; lane k holds the k-th choice");
// s.vec: the candidates' keys and scores, the choices and their scores, then (8-byte aligned)
// the softmax's warp maxima and sums and the group limit's pieces' two best keys.
constexpr int ROUTE_PARTIAL_AT = (3 * ROUTE_CANDIDATES + 2 * MOE_TOP_K + 1) / 2 * 2;
constexpr int ROUTE_PIECES_AT = ROUTE_PARTIAL_AT + (MOE_SIGMOID ? 0 : 2 * SCORE_WARPS);
static_assert(ROUTE_PIECES_AT + 2 * ROUTE_PIECES <= MAX_K,
              "the router's candidates, choices, warp sums and group pieces are staged in s.vec");

#if MOE_TOPK_GROUP < MOE_GROUPS
// The two largest of a lane's and another's (a, b) pairs (a >= b), as order keys: no branches,
// so a warp's lanes never diverge (a branchy keep-two ran 24 µs per DeepSeek layer on one warp).
__device__ __forceinline__ void top_two(uint32_t& a, uint32_t& b, uint32_t a2, uint32_t b2) {
  b = max(min(a, a2), max(b, b2));
  a = max(a, a2);
}
// A group's score: the sum of its two largest selection values, merged from its pieces' pairs.
__device__ __forceinline__ float group_score(const uint2* piece, int g) {
  const uint2* mine = piece + g * PIECES_PER_GROUP;
  uint2 best = mine[0];
#pragma unroll
  for (int q = 1; q < PIECES_PER_GROUP; ++q) top_two(best.x, best.y, mine[q].x, mine[q].y);
  return key_float(best.x) + key_float(best.y);
}
// Masks the experts outside the chosen groups (their keys become -inf's): a group's score is the
// sum of its two largest selection values; the MOE_TOPK_GROUP best groups are kept (NaN above
// every number; equal sums: the lower group first). The lanes of a piece (a group's slots in one
// warp) find its two largest keys by a butterfly and its first lane stores them; after one sync
// every thread ranks its slots' groups among all.
__device__ void limit_groups(uint32_t (&key)[SLOTS_PER_THREAD], uint2* piece, int ct) {
  const uint32_t minus_inf = order_key(-INFINITY);  // below every value, above a slot without one
#pragma unroll
  for (int j = 0; j < SLOTS_PER_THREAD; ++j) {
    const int slot = ct + j * NT;
    if (slot / 32 >= ROUTE_CHUNKS) break;  // the whole warp
    uint32_t a = max(key[j], minus_inf), b = minus_inf;
#pragma unroll
    for (int o = PIECE_SLOTS / 2; o > 0; o >>= 1)
      top_two(a, b, __shfl_xor_sync(0xffffffffu, a, o), __shfl_xor_sync(0xffffffffu, b, o));
    if (slot % PIECE_SLOTS == 0 && slot < ROUTE_SLOTS) piece[slot / PIECE_SLOTS] = make_uint2(a, b);
  }
  compute_sync();
#pragma unroll
  for (int j = 0; j < SLOTS_PER_THREAD; ++j) {
    const int slot = ct + j * NT, g = slot / GROUP_SLOTS;
    if (!slot_has_expert(slot)) continue;
    const float mine = group_score(piece, g);
    int rank = 0;
#pragma unroll
    for (int h = 0; h < MOE_GROUPS; ++h) rank += routed_before(group_score(piece, h), h, mine, g);
    if (rank >= MOE_TOPK_GROUP) key[j] = minus_inf;
  }
}
#endif

// The selection, in two stages. Stage one: each warp ranks its chunk's 32 slots among themselves
// by shuffles of their keys (equal keys: the lower lane, i.e. the lower expert, first), and the
// slot of chunk rank r < MOE_TOP_K becomes candidate MOE_TOP_K chunk + r. Nothing is lost: an
// expert of rank r < MOE_TOP_K among all has at most r experts above it in its chunk, so it is a
// candidate, and so is every expert above it (each of rank < r): its rank among the candidates
// is r again. Any other candidate has those MOE_TOP_K above it, so its rank among them is
// MOE_TOP_K or more (a slot without an expert's too: a chunk ranks its experts first, so at least
// MOE_TOP_K experts are candidates). Stage two: ROUTE_LANES threads per candidate count the
// candidates above it, and those of rank < MOE_TOP_K take their places. Ranking every expert
// against every other instead (MOE_EXPERTS² shared-memory compares; here 32 shuffles per slot
// and ROUTE_CANDIDATES² compares) took 2.4 µs of DeepSeek-V3's 5.6 µs router; a warp-wide
// argmax per choice, before that, 5 µs per Qwen3-30B-A3B layer.
constexpr int route_lanes(int lanes) {
  return lanes < 32 && ROUTE_CANDIDATES * lanes * 2 <= NT ? route_lanes(2 * lanes) : lanes;
}
constexpr int ROUTE_LANES = route_lanes(1);

// Every compute thread does its slots' part: it loads their logits and biases together (one L2
// round trip, where one warp loading the bias after the scores took two) and computes their
// scores and keys in registers; the softmax combines the warps' maxima and sums after one sync.
// Then the group limit (one sync), the two stages (one each), and the first warp normalizes and
// stores the choices.
__device__ void run_moe_topk(const Params& p, Shared& s, const int* t, int ct) {
  unsigned long long* cand = reinterpret_cast<unsigned long long*>(s.vec);  // [ROUTE_CANDIDATES] keys
  float* cand_score = s.vec + 2 * ROUTE_CANDIDATES;                         // [ROUTE_CANDIDATES]
  int* choice = reinterpret_cast<int*>(cand_score + ROUTE_CANDIDATES);      // [MOE_TOP_K] best first
  float* chosen = reinterpret_cast<float*>(choice + MOE_TOP_K);             // [MOE_TOP_K] their scores
  const int lane = ct & 31;
  const float* logits = p.act + t[F_IN];
  const float* biases = MOE_BIAS ? p.act + t[F_AUX2] : nullptr;
  float score[SLOTS_PER_THREAD], bias[SLOTS_PER_THREAD];  // score: the logit until computed
#pragma unroll
  for (int j = 0; j < SLOTS_PER_THREAD; ++j) {
    const int slot = ct + j * NT;
    const bool here = slot_has_expert(slot);
    score[j] = here ? __ldcg(logits + slot_expert(slot)) : -INFINITY;
    bias[j] = MOE_BIAS && here ? __ldcg(biases + slot_expert(slot)) : 0.f;
  }
#if MOE_SIGMOID
#pragma unroll
  for (int j = 0; j < SLOTS_PER_THREAD; ++j) score[j] = 1.f / (1.f + expf(-score[j]));
#else
  float2* partial = reinterpret_cast<float2*>(s.vec + ROUTE_PARTIAL_AT);  // [SCORE_WARPS] max, sum
  float mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < SLOTS_PER_THREAD; ++j) mx = fmaxf(mx, score[j]);
  mx = warp_max(mx);
  float sum = 0.f;  // -inf's add 0, also where a warp's maximum is -inf (expf(-inf - -inf) is NaN)
#pragma unroll
  for (int j = 0; j < SLOTS_PER_THREAD; ++j) sum += score[j] == -INFINITY ? 0.f : expf(score[j] - mx);
  sum = warp_sum(sum);
  if (lane == 0 && ct < 32 * SCORE_WARPS) partial[ct >> 5] = make_float2(mx, sum);
  compute_sync();
  float top = -INFINITY, total = 0.f;
#pragma unroll
  for (int w = 0; w < SCORE_WARPS; ++w) top = fmaxf(top, partial[w].x);
#pragma unroll
  for (int w = 0; w < SCORE_WARPS; ++w) total += partial[w].y * expf(partial[w].x - top);
#pragma unroll
  for (int j = 0; j < SLOTS_PER_THREAD; ++j) score[j] = expf(score[j] - top) / total;
#endif
  uint32_t key[SLOTS_PER_THREAD];
#pragma unroll
  for (int j = 0; j < SLOTS_PER_THREAD; ++j)
    key[j] = slot_has_expert(ct + j * NT) ? value_key(MOE_BIAS ? score[j] + bias[j] : score[j]) : 0u;
#if MOE_TOPK_GROUP < MOE_GROUPS
  limit_groups(key, reinterpret_cast<uint2*>(s.vec + ROUTE_PIECES_AT), ct);
#endif
#pragma unroll
  for (int j = 0; j < SLOTS_PER_THREAD; ++j) {  // stage one: ranks within chunks
    const int slot = ct + j * NT, chunk = slot / 32;
    if (chunk >= ROUTE_CHUNKS) break;  // the whole warp
    // The lanes above: those of a larger key, or of an equal key and a lower lane (route_key
    // with the lane for the expert: one 64-bit comparison each, its low word a constant).
    const unsigned long long mine = route_key(key[j], lane);
    int rank = 0;
#pragma unroll
    for (int l = 0; l < 32; ++l) rank += route_key(__shfl_sync(0xffffffffu, key[j], l), l) > mine;
    if (rank < MOE_TOP_K) {
      cand[chunk * MOE_TOP_K + rank] = route_key(key[j], slot_expert(slot));
      cand_score[chunk * MOE_TOP_K + rank] = score[j];
    }
  }
  compute_sync();
  for (int base = 0; base < ROUTE_CANDIDATES; base += NT / ROUTE_LANES) {  // stage two (uniform: shuffles)
    const int i = base + ct / ROUTE_LANES, part = ct % ROUTE_LANES;
    const unsigned long long mine = i < ROUTE_CANDIDATES ? cand[i] : ~0ull;
    const float mine_score = i < ROUTE_CANDIDATES ? cand_score[i] : 0.f;
    int rank = 0;
#pragma unroll
    for (int f = part; f < ROUTE_CANDIDATES; f += ROUTE_LANES) rank += cand[f] > mine;
#pragma unroll
    for (int o = 1; o < ROUTE_LANES; o <<= 1) rank += __shfl_xor_sync(0xffffffffu, rank, o);
    if (i < ROUTE_CANDIDATES && part == 0 && rank < MOE_TOP_K) {
      choice[rank] = route_expert(mine);
      chosen[rank] = mine_score;
    }
  }
  compute_sync();
  if (ct >= 32) return;
  const int mine_id = ct < MOE_TOP_K ? choice[ct] : 0;
  float mine = ct < MOE_TOP_K ? chosen[ct] : 0.f;  // lane k: the score of the k-th choice
  if (MOE_NORM_TOPK_PROB) mine = mine / (warp_sum(mine) + 1e-20f);
#if TP > 1
  route_local(p, t, ct, mine, mine_id);
#else
  if (ct < MOE_TOP_K) {
    __stcg(reinterpret_cast<int*>(p.act + t[F_OUT]) + ct, mine_id);
    __stcg(p.act + t[F_AUX] + ct, mine * MOE_SCALING);
  }
#endif
}
#endif
