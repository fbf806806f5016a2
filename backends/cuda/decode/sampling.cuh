// ---- sampling (ir/sampling.py defines what this computes, and why) -------------------------
// (v, r) takes the place of (best, best_row) if it is larger, or equal with a lower row: of equal
// values the lowest row wins, as in torch.argmax.
__device__ __forceinline__ void keep_best(float v, int r, float& best, int& best_row) {
  if (v > best || (v == best && r < best_row)) {
    best = v;
    best_row = r;
  }
}

// Every lane ends with its warp's best (value, row) pair.
__device__ __forceinline__ void warp_best(float& best, int& best_row) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    keep_best(__shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, best_row, o), best, best_row);
}

// Greedy: the (max logit, row) reduction. Temperature only: the same reduction over Gumbel-max
// scores logit / T + g, g = -log(-log u) with a counter-based u per (seed, position, row).
// top-k / top-p: each lm_head task leaves its SAMPLE_SLOTS best logits and its softmax partial
// sum; the sampler merges them, filters, and draws by Gumbel-max over the kept candidates.
enum SampleMode : int { SAMPLE_GREEDY, SAMPLE_GUMBEL, SAMPLE_FILTERED };
struct Sampling {
  float temp;    // temperature (0: greedy)
  double top_p;  // a float32 value
  int top_k;     // 0: off
  uint64_t seed;
  __device__ int mode() const {
    if (temp == 0.f) return SAMPLE_GREEDY;
    return top_k > 0 || top_p < 1.0 ? SAMPLE_FILTERED : SAMPLE_GUMBEL;
  }
};
// The sampling code runs once per step; loop invariants the compiler would hoist out of the step
// loop (the float temperature, the seed's hash) would hold registers across every task, and
// spill where attention needs them all. So the parameters are loaded where they are used
// (volatile: not hoisted). The mode, which greedy decoding checks too, is read once per launch
// into shared memory.
__device__ __forceinline__ Sampling sampling(const Params& p) {
  const volatile SampleArgs* a = p.sample;
  return {static_cast<float>(a->temperature), a->top_p, static_cast<int>(a->top_k), a->seed};
}
constexpr int FLAG_SAMPLE_MODE = 5;
__device__ __forceinline__ int sample_mode(const Shared& s) { return s.flags[FLAG_SAMPLE_MODE]; }

// sample_partials: [SAMPLE_TASKS] (m, s) pairs, then every task's SAMPLE_SLOTS candidate logits,
// then their rows (int32); consecutive candidates are consecutive words, so that the sampler's
// threads read them at fixed offsets from one base. An unused slot has logit bits 0xffffffff
// (order key 0, below every float's) and row -1.
constexpr int NT = COMPUTE_WARPS * 32;  // compute threads
constexpr int SAMPLE_WANT = SAMPLE_K < VOCAB ? SAMPLE_K : VOCAB;  // candidates the sampler sorts
constexpr int CANDIDATES = SAMPLE_TASKS * SAMPLE_SLOTS;
constexpr int CANDIDATE_LOGITS = 2 * SAMPLE_TASKS, CANDIDATE_ROWS = CANDIDATE_LOGITS + CANDIDATES;
constexpr int CANDIDATES_PER_THREAD = (CANDIDATES + NT - 1) / NT;
constexpr int NO_CANDIDATE = -1;  // the bits of an unused slot's logit, and its row
static_assert(SAMPLE_K <= 64, "the draw gives each lane of one warp two candidates");

// s.red while sampling, past the matrix-vector reductions' slots [0, 4 * COMPUTE_WARPS + 2).
constexpr int SR_TOP = 4 * COMPUTE_WARPS + 4;  // the task's largest logit, broadcast
constexpr int SR_FILL = SR_TOP + 1;            // int: next free candidate slot
constexpr int SR_WSUM = SR_TOP + 2;            // [COMPUTE_WARPS] per-warp float sums
constexpr int SR_COUNT = SR_WSUM + COMPUTE_WARPS;                 // int [2][COMPUTE_WARPS]
constexpr int SR_LIST = (SR_COUNT + 2 * COMPUTE_WARPS + 1) & ~1;  // float2 [SAMPLE_K], unsorted
constexpr int SR_SORTED = SR_LIST + 2 * SAMPLE_K;                 // float2 [SAMPLE_K], best first
constexpr int SR_MASS = SR_SORTED + 2 * SAMPLE_K;                 // double [SAMPLE_K]
static_assert(SR_MASS + 2 * SAMPLE_K <= MISC_FLOATS, "sampling scratch exceeds s.red");

// SplitMix64's output function: bit-identical to ir/sampling.py's mix64 (integers mod 2^64).
__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ uint64_t stream_key(const Sampling& sp, long long pos) {
  return mix64(mix64(sp.seed) ^ static_cast<uint64_t>(pos));
}
// logit / T + g in float32 with IEEE division and addition (no contraction), g from a 52-bit
// uniform in float64, as ir/sampling.py: gumbel_scores computes it.
__device__ __forceinline__ float gumbel_score(float logit, float temp, uint64_t key, int row) {
  const uint64_t h = mix64(key ^ static_cast<uint64_t>(row));
  const double u = (static_cast<double>(h >> 12) + 0.5) * 0x1p-52;
  return __fadd_rn(__fdiv_rn(logit, temp), static_cast<float>(-log(-log(u))));
}
// The lm_head logit of task row i, bit-identical to what the epilogue stored (and never fused
// into a later operation).
__device__ __forceinline__ float lm_logit(const Shared& s, int i, float rstd) { return __fmul_rn(s.acc[i], rstd); }

// float -> uint32 with the same order, and back.
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Block-wide sum of one count per compute thread, with one barrier. Warps leave their sums in a
// bank of slots that alternates between calls, so that a bank is rewritten only after every
// thread has passed the barrier that follows its last reading.
struct BlockCount {
  int* bank;  // int [2][COMPUTE_WARPS] in s.red
  int round;
  __device__ int operator()(int n, int ct) {
    int* b = bank + (round++ & 1) * COMPUTE_WARPS;
    const int warp_total = static_cast<int>(__reduce_add_sync(0xffffffffu, static_cast<unsigned>(n)));
    if ((ct & 31) == 0) b[ct >> 5] = warp_total;
    compute_sync();
    int total = 0;
#pragma unroll
    for (int w = 0; w < COMPUTE_WARPS; ++w) total += b[w];
    return total;
  }
  // The sum of the counts of the compute threads before this one (a warp scan, then the totals of
  // the warps before), with one barrier.
  __device__ int before(int n, int ct) {
    int* b = bank + (round++ & 1) * COMPUTE_WARPS;
    int upto = n;  // this lane's and the lanes' below it
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, upto, o);
      if ((ct & 31) >= o) upto += v;
    }
    if ((ct & 31) == 31) b[ct >> 5] = upto;
    compute_sync();
    for (int w = 0; w < (ct >> 5); ++w) upto += b[w];
    return upto - n;
  }
};

// The want-th largest of the block's keys, found without sorting by a radix selection: a round
// counts the keys that share the digits found so far by their next KTH_DIGIT_BITS (a block-wide
// histogram, the lanes of a warp with equal digits adding once) and warp 0 finds the digit of the
// key still wanted, so that four rounds of two barriers find it (bit by bit, 32 rounds of a
// block-wide count each had). `each(f)` calls f(key, live) for each of this thread's items, as
// often in every lane of a warp (f is warp-collective); at least `want` items are live.
struct Kth {
  uint32_t key;
  int ties, equal;  // of the items equal to key, how many are among the `want` largest; how many
};
constexpr int KTH_DIGIT_BITS = 8, KTH_BINS = 1 << KTH_DIGIT_BITS;
// s.red during the search, past BlockCount's bank: two histograms, a round's and the next's
// (cleared while this one is read), then the round's digit, the count of keys above it and its own.
constexpr int KTH_HIST = SR_LIST, KTH_FOUND = KTH_HIST + 2 * KTH_BINS;
static_assert(KTH_FOUND + 3 <= MISC_FLOATS, "the radix selection's histograms exceed s.red");
static_assert(KTH_BINS == 8 * 32, "warp 0 reads the histogram 8 bins a lane");
template <class Each>
__device__ Kth kth_largest(Shared& s, Each each, int want, int ct) {
  int* hist = reinterpret_cast<int*>(s.red + KTH_HIST);
  int* found = reinterpret_cast<int*>(s.red + KTH_FOUND);
  for (int b = ct; b < 2 * KTH_BINS; b += NT) hist[b] = 0;
  compute_sync();
  uint32_t kth = 0;  // the digits found so far
  for (int round = 0; round < 32 / KTH_DIGIT_BITS; ++round) {
    const int shift = 32 - KTH_DIGIT_BITS * (round + 1);
    const uint32_t known = static_cast<uint32_t>(~0ull << (shift + KTH_DIGIT_BITS));
    int* h = hist + (round & 1) * KTH_BINS;
    each([&](uint32_t k, bool live) {
      live = live && (k & known) == kth;
      const int digit = live ? static_cast<int>(k >> shift) & (KTH_BINS - 1) : -1;
      const unsigned peers = __match_any_sync(0xffffffffu, digit);
      if (live && (ct & 31) == __ffs(peers) - 1) atomicAdd(h + digit, __popc(peers));
    });
    compute_sync();
    if (ct < 32) {
      // lane l's 8 bins, the largest digits first: the count of keys with a digit >= a bin's
      // crosses `want` in exactly one bin
      const int top = KTH_BINS - 8 * ct;
      int mine = 0;
#pragma unroll
      for (int b = 1; b <= 8; ++b) mine += h[top - b];
      int upto = mine;  // this lane's bins and the larger digits' lanes
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, upto, o);
        if (ct >= o) upto += v;
      }
      int above = upto - mine;
      if (above < want && upto >= want) {
        for (int b = top - 1; b >= top - 8; --b) {
          if (above + h[b] >= want) {
            found[0] = b;
            found[1] = above;
            found[2] = h[b];
            break;
          }
          above += h[b];
        }
      }
    }
    for (int b = ct; b < KTH_BINS; b += NT) hist[((round + 1) & 1) * KTH_BINS + b] = 0;
    compute_sync();
    kth |= static_cast<uint32_t>(found[0]) << shift;
    want -= found[1];
  }
  return {kth, want, found[2]};  // the last round's bin: the keys equal to kth in every digit
}

// The `want` largest of the block's (key, row) items: those with key > kth, and those with
// key == kth and row <= last (the lowest rows among equal keys). kth by kth_largest, then, only
// if more keys equal kth than fit, `last` bit by bit over the row bits. ir/sampling.py:
// select_top finds the same items (kth by counting bit by bit). `each` as kth_largest's;
// count_tie(kth, x): this thread's items with key == kth and row < x.
struct Cut {
  uint32_t kth;
  int last;
};
__device__ __forceinline__ bool taken(const Cut& c, uint32_t key, int row) {
  return key > c.kth || (key == c.kth && row <= c.last);
}
template <class Each, class CountTie>
__device__ Cut select_top(Shared& s, BlockCount& sum, int want, Each each, CountTie count_tie, int ct) {
  const Kth k = kth_largest(s, each, want, ct);
  if (k.ties == k.equal) return {k.key, 0x7fffffff};
  int last = 0;  // the largest row with fewer than `ties` tied rows below it: the ties-th row
  for (int b = SAMPLE_ROW_BITS - 1; b >= 0; --b) {
    const int probe = last | (1 << b);
    if (sum(count_tie(k.key, probe), ct) < k.ties) last = probe;
  }
  return {k.key, last};
}

// Temperature only, lm_head side: this thread's best (score, row) by Gumbel-max score instead
// of logit; the (max, row) reduction that follows is the greedy one.
__device__ void gumbel_best(const Sampling& sp, const Shared& s, int row0, int rows, float rstd, long long pos,
                            int ct, float& best, int& best_row) {
  const uint64_t key = stream_key(sp, pos);
  best = -INFINITY;
  best_row = 0x7fffffff;
  for (int i = ct; i < rows; i += NT) {  // rows in increasing order: the first maximum wins ties
    const float v = gumbel_score(lm_logit(s, i, rstd), sp.temp, key, row0 + i);
    if (v > best) {
      best = v;
      best_row = row0 + i;
    }
  }
}

// top-k / top-p, lm_head side (ir/sampling.py: task_record): the task's (m, s) in
// sample_partials are its largest logit m and s = sum exp((logit - m) / T) over its rows (the
// sampler merges these into the softmax normalizer over the vocabulary); its candidates are its
// SAMPLE_SLOTS largest logits with their rows, in no particular order. The largest logit is the
// greedy pair thread 0 wrote to argmax_partials.
__device__ void lm_head_candidates(const Params& p, const Sampling& sp, Shared& s, const int* t, float rstd, int ct) {
  const int row0 = t[F_ROW0], rows = t[F_ROW1] - row0, task = t[F_CHUNK];
  float* part = p.act + t[F_AUX3];
  float* logits = part + CANDIDATE_LOGITS + task * SAMPLE_SLOTS;
  int* cand_rows = reinterpret_cast<int*>(part + CANDIDATE_ROWS) + task * SAMPLE_SLOTS;
  int* fill = reinterpret_cast<int*>(s.red + SR_FILL);
  if (ct == 0) {
    s.red[SR_TOP] = __ldcg(p.act + t[F_AUX2]);
    *fill = 0;
  }
  compute_sync();
  const float top = s.red[SR_TOP];
  float mass = 0.f;
  for (int i = ct; i < rows; i += NT) mass += expf(__fdiv_rn(__fsub_rn(lm_logit(s, i, rstd), top), sp.temp));
  mass = warp_sum(mass);
  if ((ct & 31) == 0) s.red[SR_WSUM + (ct >> 5)] = mass;
  compute_sync();
  if (ct == 0) {
    float total = 0.f;
    for (int w = 0; w < COMPUTE_WARPS; ++w) total += s.red[SR_WSUM + w];
    __stcg(part + 2 * task, top);
    __stcg(part + 2 * task + 1, total);
  }
  if (rows <= SAMPLE_SLOTS) {  // every row is a candidate
    for (int i = ct; i < SAMPLE_SLOTS; i += NT) {
      __stcg(logits + i, i < rows ? lm_logit(s, i, rstd) : __int_as_float(NO_CANDIDATE));
      __stcg(cand_rows + i, i < rows ? row0 + i : NO_CANDIDATE);
    }
    return;
  }
  BlockCount sum{reinterpret_cast<int*>(s.red + SR_COUNT), 0};
  auto each = [&](auto f) {  // every lane the same number of times
    for (int i = ct; i < (rows + NT - 1) / NT * NT; i += NT) f(i < rows ? order_key(lm_logit(s, i, rstd)) : 0u, i < rows);
  };
  auto count_tie = [&](uint32_t kth, int x) {
    int n = 0;
    for (int i = ct; i < rows; i += NT) n += order_key(lm_logit(s, i, rstd)) == kth && row0 + i < x;
    return n;
  };
  const Cut cut = select_top(s, sum, SAMPLE_SLOTS, each, count_tie, ct);
  for (int i = ct; i < rows; i += NT) {
    const float y = lm_logit(s, i, rstd);
    if (!taken(cut, order_key(y), row0 + i)) continue;
    const int slot = atomicAdd(fill, 1);
    __stcg(logits + slot, y);
    __stcg(cand_rows + slot, row0 + i);
  }
}

// top-k / top-p, the draw (ir/sampling.py: merge_records, after the sort), by warp 0 over the
// sorted candidates: keeps the top_k best, then the smallest prefix whose softmax mass reaches
// top_p (normalized over the top_k kept, or over the vocabulary from the tasks' (m, s) when
// top_k is off), then draws by Gumbel-max over the kept ones. Masses are float64; lane 0 sums
// them in order, as the reference does. Returns the token in lane 0; counts a nucleus cut to
// the candidates in the status words.
__device__ int draw_sorted(const Params& p, const Sampling& sp, const float2* sorted, double* mass, const float* part,
                           long long pos, int lane) {
  const int k = sp.top_k > 0 ? min(sp.top_k, SAMPLE_WANT) : SAMPLE_WANT;
  int n = k;
  if (sp.top_p < 1.0) {
    const double t64 = sp.temp, top = sorted[0].x;
    double z = 0.0;
    for (int j = lane; j < k; j += 32) {
      mass[j] = exp((static_cast<double>(sorted[j].x) - top) / t64);
      z += mass[j];
    }
    if (sp.top_k == 0) {  // the normalizer over the vocabulary
      z = 0.0;
      for (int i = lane; i < SAMPLE_TASKS; i += 32)
        z += static_cast<double>(__ldcg(part + 2 * i + 1)) * exp((static_cast<double>(__ldcg(part + 2 * i)) - top) / t64);
    }
    z = warp_sum_d(z);
    __syncwarp();
    if (lane == 0) {  // keep a candidate while the ones before it hold less than top_p
      const double limit = sp.top_p * z;
      double before = 0.0;
      for (n = 0; n < k && (n == 0 || before < limit); ++n) before += mass[n];
      if (sp.top_k == 0 && n == SAMPLE_WANT && SAMPLE_WANT < VOCAB && before < limit)
        atomicAdd(&p.status[ST_NUCLEUS_CUT], 1);
    }
    n = __shfl_sync(0xffffffffu, n, 0);
  }
  const uint64_t key = stream_key(sp, pos);
  float best = -INFINITY;
  int best_row = 0x7fffffff;
  for (int j = lane; j < n; j += 32) {
    const int r = __float_as_int(sorted[j].y);
    keep_best(gumbel_score(sorted[j].x, sp.temp, key, r), r, best, best_row);
  }
  warp_best(best, best_row);
  return best_row;
}

// top-k / top-p, sampler side (ir/sampling.py: merge_records): the SAMPLE_WANT best of every
// task's candidates (the global best are among each task's best), found by select_top with the
// candidates' order keys in registers (rows are read where needed: ties and the chosen), sorted
// by rank in shared memory, then drawn by warp 0. Returns the token in thread 0.
__device__ int sample_filtered(const Params& p, const Sampling& sp, Shared& s, const int* t, long long pos, int ct) {
  const float* part = p.act + t[F_AUX];
  const float* logits = part + CANDIDATE_LOGITS + ct;  // this thread's candidates: every NT-th
  const int* rows = reinterpret_cast<const int*>(part + CANDIDATE_ROWS) + ct;
  int* fill = reinterpret_cast<int*>(s.red + SR_FILL);
  if (ct == 0) *fill = 0;  // the selection's first barrier orders this before its use
  uint32_t key[CANDIDATES_PER_THREAD];  // 0: no candidate
#pragma unroll
  for (int j = 0; j < CANDIDATES_PER_THREAD; ++j)
    key[j] = ct + j * NT < CANDIDATES ? order_key(__ldcg(logits + j * NT)) : 0u;
  BlockCount sum{reinterpret_cast<int*>(s.red + SR_COUNT), 0};
  auto each = [&](auto f) {
#pragma unroll
    for (int j = 0; j < CANDIDATES_PER_THREAD; ++j) f(key[j], true);
  };
  auto count_tie = [&](uint32_t kth, int x) {
    int n = 0;
#pragma unroll
    for (int j = 0; j < CANDIDATES_PER_THREAD; ++j) n += key[j] == kth && __ldcg(rows + j * NT) < x;
    return n;
  };
  const Cut cut = select_top(s, sum, SAMPLE_WANT, each, count_tie, ct);
  float2* list = reinterpret_cast<float2*>(s.red + SR_LIST);
#pragma unroll
  for (int j = 0; j < CANDIDATES_PER_THREAD; ++j) {
    if (key[j] < cut.kth) continue;
    const int r = __ldcg(rows + j * NT);
    if (taken(cut, key[j], r)) list[atomicAdd(fill, 1)] = make_float2(key_float(key[j]), __int_as_float(r));
  }
  compute_sync();
  float2* sorted = reinterpret_cast<float2*>(s.red + SR_SORTED);
  for (int j = ct; j < SAMPLE_WANT; j += NT) {  // rank: the candidates that come first
    const float2 me = list[j];                   // (logit descending, row ascending)
    int rank = 0;
    for (int i = 0; i < SAMPLE_WANT; ++i) {
      const float2 o = list[i];
      rank += o.x > me.x || (o.x == me.x && __float_as_int(o.y) < __float_as_int(me.y));
    }
    sorted[rank] = me;
  }
  compute_sync();
  return ct < 32 ? draw_sorted(p, sp, sorted, reinterpret_cast<double*>(s.red + SR_MASS), part, pos, ct) : 0;
}
