// ---- the loader warp ------------------------------------------------------------------------
#if MOE
// A routed task's row is made of pieces: one per slot (the slot's expert's row), and in a down
// task of a model with a shared expert (MOE_SHARED_K) a last one, the shared expert's row.
constexpr int MOE_PIECES = MOE_TOP_K + (MOE_SHARED_K > 0);
#if WEIGHT_FP8  // its FP8 row (ir/fp8.py: packed_row_bytes): values, its own scales, padding
constexpr int MOE_SHARED_BYTES = (MOE_SHARED_K + 4 * ((MOE_SHARED_K + FP8_BLOCK_COLS - 1) / FP8_BLOCK_COLS) + 15) / 16 * 16;
#else
constexpr int MOE_SHARED_BYTES = MOE_SHARED_K * 2;  // bf16
#endif

// A routed task's weights are known only once the router of this step has run: the loader
// acquires the router's counter (as compute's waits do), reads the ids of the task's slots and
// points `piece[j]` at slot j's expert (packed expert-major, `F_EXPERT_STRIDE` apart). Returns
// false when the launch is ending or failing. Weights of every other task still stream ahead;
// the cost is that this SM's loader stalls here until the router is done (docs/artifact.md).
__device__ bool route_pieces(const Params& p, const Shared& s, const int* t, long long step, int task,
                             const uint8_t* base, const uint8_t* (&piece)[MOE_PIECES]) {
  if (!acquire(p, t[F_ROUTE], static_cast<unsigned>(step + 1), task, &s.flags[0])) return false;
  const int* ids = reinterpret_cast<const int*>(p.act + t[F_IDS]) + t[F_SLOT0];
  const long long stride = static_cast<long long>(t[F_EXPERT_STRIDE]) * 16;
#pragma unroll
  for (int j = 0; j < MOE_TOP_K; ++j)
#if TP > 1  // expert parallelism: a slot without an expert of this rank has no piece (route_local)
    if (j < t[F_SLOTS]) piece[j] = __ldcg(ids + j) < 0 ? nullptr : base + __ldcg(ids + j) * stride;
#else
    if (j < t[F_SLOTS]) piece[j] = base + __ldcg(ids + j) * stride;
#endif
#if MOE_SHARED_K  // the shared rows lie in the SM's static region, like a dense task's
  piece[MOE_TOP_K] = p.weights + ((static_cast<long long>(t[F_SHARED_HI]) << 32) |
                                  static_cast<uint32_t>(t[F_SHARED_LO])) * 16;
#endif
  return true;
}

#if TP > 1
// The bytes of a routed row that the loader copies: a down row without the pieces of its slots
// that hold no expert of this rank (all busy ones come first: route_local).
__device__ __forceinline__ int loaded_row_bytes(const int* t, const uint8_t* const (&piece)[MOE_PIECES]) {
  const int rb = t[F_ROW_BYTES];
  if (t[F_OPCODE] != OP_MOE_DOWN_ADD) return rb;
  int empty = 0;
#pragma unroll
  for (int j = 0; j < MOE_TOP_K; ++j) empty += j < t[F_SLOTS] && !piece[j];
  return rb - empty * ((rb - MOE_SHARED_BYTES) / t[F_SLOTS]);
}
#endif

// Whether a routed task's pages are gathered piece by piece (copy_pieces): a down task's rows
// come from several experts (and the shared one); a gate/up task's are one expert's, contiguous.
// A macro, not a function: as a function it changed the machine code of kernels without a
// shared expert.
#define GATHERS_PIECES(t) ((t)[F_SLOTS] > 1 || (MOE_SHARED_K && (t)[F_OPCODE] == OP_MOE_DOWN_ADD))

// One page of a routed task with several pieces per row (the MoE down projection: a row is
// the down rows of every slot's expert side by side, then the shared expert's): one bulk copy
// per row and piece.
// A down task of FP8 tiles streams units instead (stream_rows), piece by piece: a piece's units
// of the task's tiles lie in a row in its expert's tiles, so a page is one or two bulk copies.
// (Tile by tile, each tile's pieces in turn, a page of 4 units was 4 copies from 4 experts and
// took 3.5 us from issue to arrival against ~2.2 for a contiguous one; H200, docs/performance.md.)
__device__ void copy_pieces(uint8_t* page, const uint8_t* const (&piece)[MOE_PIECES], const int* t, int r, int n,
                            uint64_t* bar) {
#if FP8_MMA
  if (t[F_W_FORMAT] == WF_FP8_TILES) {
    const int ub = t[F_ROW_BYTES], per_piece = piece_units(t);
    for (int i = 0; i < n;) {
      const int u = r + i, j = u / per_piece, run = min(n - i, per_piece - u % per_piece);
      const uint8_t* src = piece[MOE_TOP_K];  // the shared expert's, unless a slot's (indexed
#pragma unroll                                // by a constant: piece stays in registers)
      for (int q = 0; q < MOE_TOP_K; ++q)
        if (q == j && j < t[F_SLOTS]) src = piece[q];
      bulk_copy(page + i * ub, src + static_cast<long long>(u % per_piece) * ub, run * ub, bar);
      i += run;
    }
    return;
  }
#endif
  const int rb = t[F_ROW_BYTES], slots = t[F_SLOTS], bytes = (rb - MOE_SHARED_BYTES) / slots;
  for (int rr = 0; rr < n; ++rr) {
#pragma unroll
    for (int j = 0; j < MOE_TOP_K; ++j)
#if TP > 1  // a slot without an expert of this rank: its piece is not loaded (nor read)
      if (j < slots && piece[j])
#else
      if (j < slots)
#endif
        bulk_copy(page + rr * rb + j * bytes, piece[j] + static_cast<long long>(r + rr) * bytes, bytes, bar);
#if MOE_SHARED_K
    bulk_copy(page + rr * rb + slots * bytes, piece[MOE_TOP_K] + static_cast<long long>(r + rr) * MOE_SHARED_BYTES,
              MOE_SHARED_BYTES, bar);
#endif
  }
}
#endif

// Waits until ring slot `issued % RING_PAGES` is free for page `issued` and returns it; null
// when the launch is ending or failing.
__device__ uint8_t* claim_page(const Params& p, Shared& s, uint32_t issued) {
  const int slot = issued % RING_PAGES;
  const uint32_t parity = ((issued / RING_PAGES) & 1) ^ 1;
  if (!ring_wait(p, &s.empty[slot], parity, &s.flags[0])) return nullptr;
  while (s.flags[FLAG_HOLD] != 0)  // pages.cuh: hold_copies (a volatile read, as the other flags)
    if (quit_seen(&s.flags[0])) return nullptr;
  // The compute warps' reads of the slot's last page (generic proxy) come before this copy's
  // writes (async proxy).
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  return s.ring + slot * PAGE_BYTES;
}

// The next page of the ring, for `bytes` of bulk copies: claims it (claim_page), arms its slot's
// `full` barrier for those bytes and counts it issued. Null when the launch is ending or failing.
__device__ __forceinline__ uint8_t* start_page(const Params& p, Shared& s, uint32_t& issued, uint32_t bytes,
                                               uint64_t*& full) {
  uint8_t* page = claim_page(p, s, issued);
  if (!page) return nullptr;
  full = &s.full[issued++ % RING_PAGES];
  mbar_expect_tx(full, bytes);
  return page;
}

#if !MLA  // MLA attention reads its latent cache itself (run_mla_attention)
// Attention streams the past keys and values of its context chunk (positions before this
// step's, which the chunk's task adds itself) through the ring as matrix-vector tasks stream
// weights, so that they arrive while compute still waits for the queries. A page holds
// KV_KEYS_PER_PAGE keys' rows, then their values' rows.
constexpr int KV_ROW_BYTES = HEAD_DIM * 2;
static_assert(KV_ROW_BYTES % 16 == 0, "bulk copies move whole 16-byte pieces of cache rows");
constexpr int KV_KEYS_PER_PAGE = PAGE_BYTES / (2 * KV_ROW_BYTES);
static_assert(KV_KEYS_PER_PAGE >= 1, "a ring page holds at least one key and its value");

struct KvChunk {
  long long k0, past;  // the chunk's first key; its keys before this step's position
};
__device__ __forceinline__ KvChunk kv_chunk(const int* t, long long pos) {
  const long long n = pos + 1;
  const int chunks = t[F_COUNT], c = t[F_CHUNK];
  const long long k0 = chunk_start(n, c, chunks), k1 = chunk_start(n, c + 1, chunks);
  return {k0, max(0LL, min(k1, pos) - k0)};
}

// The cache rows were written by other SMs in earlier steps (generic proxy) and are read here
// by bulk copies (async proxy). Compute on this SM may be far behind the loader, so nothing
// else orders those writes before these reads: the loader acquires the layer's attention
// counter as of the previous step (each KV group's merge signals it once per step, after its
// chunk tasks and so after the append), then fences the proxies.
__device__ bool load_kv_chunk(const Params& p, Shared& s, const int* t, long long step, int task, uint32_t& issued) {
  const KvChunk ch = kv_chunk(t, p.start_pos + step);
  if (ch.past == 0) return true;
  if (step > 0 && !acquire(p, t[F_SIGNAL], static_cast<unsigned>(N_KV_HEADS * step), task, &s.flags[0]))
    return false;
  asm volatile("fence.proxy.async.global;" ::: "memory");
  const long long row0 = static_cast<long long>(t[F_ROW0]) * MAX_SEQ + ch.k0;
  const __nv_bfloat16* k = p.kv + t[F_KCACHE] + row0 * HEAD_DIM;
  const __nv_bfloat16* v = p.kv + t[F_VCACHE] + row0 * HEAD_DIM;
  for (long long r = 0; r < ch.past; r += KV_KEYS_PER_PAGE) {
    const uint32_t bytes = static_cast<uint32_t>(min(static_cast<long long>(KV_KEYS_PER_PAGE), ch.past - r)) *
                           KV_ROW_BYTES;
    uint64_t* full;
    uint8_t* page = start_page(p, s, issued, 2 * bytes, full);
    if (!page) return false;
    bulk_copy(page, k + r * HEAD_DIM, bytes, full);
    bulk_copy(page + KV_KEYS_PER_PAGE * KV_ROW_BYTES, v + r * HEAD_DIM, bytes, full);
  }
  return true;
}

#endif  // !MLA

#if MLA
// A latent cache row (MLA_W bf16 values, MLA_PIECES 16-byte pieces) as MLA attention stages it:
// MLA_ROW values, padded to a multiple of 64 plus 8 so that fragment loads hit distinct banks;
// pieces past MLA_W and before 2 MLA_KSTEPS are zero (the scores' last k-step reads them).
constexpr int MLA_W = MLA_RANK + MLA_ROPE;
constexpr int MLA_PIECES = MLA_W / 8;
constexpr int MLA_KSTEPS = (MLA_W + 15) / 16;
constexpr int MLA_ROW = (MLA_W + 63) / 64 * 64 + 8;

// The keys [k0, k1) of an attention task's context chunk (F_CHUNK of F_COUNT, cut as GQA
// attention cuts it; with DSA, a chunk of the indexer's selection, the first min(pos + 1,
// DSA_TOPK) entries of its list). Up to DSA_TOPK positions the indexer chooses every token, in
// order (run_dsa_topk), so entry i of its list is i: attention neither reads the list nor waits
// for it (wait_deps skips the task's F_SELECTION_WAIT).
struct MlaKeys {
  long long k0, k1;
};
__device__ __forceinline__ bool mla_selects_all(long long pos) {
#if DSA
  return pos + 1 <= DSA_TOPK;
#else
  return true;
#endif
}
__device__ __forceinline__ MlaKeys mla_keys(const int* t, long long pos) {
#if DSA
  const long long n = min(pos + 1, static_cast<long long>(DSA_TOPK));
#else
  const long long n = pos + 1;
#endif
  return {chunk_start(n, t[F_CHUNK], t[F_COUNT]), chunk_start(n, t[F_CHUNK] + 1, t[F_COUNT])};
}

// Whether the loader stages a task's first key block: a whole block of keys known without the
// indexer (mla_selects_all), all before pos, so appended in earlier steps.
__device__ __forceinline__ bool mla_first_block_early(long long pos, const MlaKeys& ch) {
  return mla_selects_all(pos) && ch.k0 + MLA_KEYS <= min(ch.k1, pos);
}

// An attention task's ring page: every other key block's rows (run_mla_attention), and past a
// block the position's RoPE cos | sin, which the queries' staging reads.
constexpr int MLA_FACTORS_AT = MLA_KEYS * MLA_ROW * 2;  // bytes into the page
static_assert(MLA_FACTORS_AT % 16 == 0 && MLA_ROPE % 4 == 0, "the factors are whole 16-byte pieces");
static_assert(MLA_FACTORS_AT + MLA_ROPE * 4 <= PAGE_BYTES,
              "a ring page holds a block's cache rows and the RoPE factors (passes/residency.py)");

// The page's contents: the factors and, `early`, the first block's rows, by bulk copies of
// mla_page_bytes that complete on `bar`; the rows' zero padding (zero_mla_padding) is ordinary
// stores, which come first, published by the caller's arrival on `bar`.
__device__ __forceinline__ uint32_t mla_page_bytes(bool early) {
  return MLA_ROPE * 4 + (early ? MLA_KEYS * MLA_W * 2 : 0);
}
__device__ __forceinline__ void zero_mla_padding(uint8_t* page) {
  for (int r = 0; r < MLA_KEYS; ++r)
    for (int c = MLA_PIECES; c < 2 * MLA_KSTEPS; ++c) reinterpret_cast<uint4*>(page + r * MLA_ROW * 2)[c] = uint4{};
}
__device__ void fill_mla_page(const Params& p, const int* t, long long pos, uint8_t* page, uint64_t* bar, bool early) {
  bulk_copy_shared_data(page + MLA_FACTORS_AT, p.act + p.rope_offset + pos * MLA_ROPE, MLA_ROPE * 4, bar);
  if (!early) return;
  const long long k0 = mla_keys(t, pos).k0;
#pragma unroll 1  // one thread issues them: unrolled they would only lengthen the loader's code
  for (int r = 0; r < MLA_KEYS; ++r)
    bulk_copy_shared_data(page + r * MLA_ROW * 2, p.kv + t[F_KCACHE] + (k0 + r) * MLA_W, MLA_W * 2, bar);
}

// The loader's page of an MLA attention task (fill_mla_page). The first key block's rows were
// appended by other SMs in earlier steps (generic proxy) and are read here by bulk copies (async
// proxy), which nothing else orders: the loader first acquires the task's producers as of the
// previous step (the q absorption, whose first task appends the latent row; not the indexer's
// selection), then fences the proxies.
__device__ bool load_mla_page(const Params& p, Shared& s, const int* t, long long step, int task, uint32_t& issued) {
  const long long pos = p.start_pos + step;
  const bool early = mla_first_block_early(pos, mla_keys(t, pos));
  if (early && step > 0) {
    for (int w = 0; w < 2; ++w) {
      const int c = t[F_WAIT0 + 2 * w];
#if DSA
      if (w == t[F_SELECTION_WAIT]) continue;
#endif
      const unsigned n = wait_per_step(t, w);
      if (c >= 0 && !acquire(p, c, static_cast<unsigned>(n * step), task, &s.flags[0])) return false;
    }
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }
  uint8_t* page = claim_page(p, s, issued);
  if (!page) return false;
  if (early) zero_mla_padding(page);
  uint64_t* full = &s.full[issued++ % RING_PAGES];
  mbar_expect_tx(full, mla_page_bytes(early));
  fill_mla_page(p, t, pos, page, full, early);
  return true;
}
#endif  // MLA

#if FFN_SPLIT_K
// `rows` rows of `rb` bytes from `src`, in pages of whole rows (as compute cuts them).
__device__ bool load_rows(const Params& p, Shared& s, const uint8_t* src, int rows, int rb, uint32_t& issued) {
  const int rpp = PAGE_BYTES / rb;
  for (int r = 0; r < rows; r += rpp) {
    const uint32_t bytes = min(rpp, rows - r) * rb;
    uint64_t* full;
    uint8_t* page = start_page(p, s, issued, bytes, full);
    if (!page) return false;
    bulk_copy(page, src + static_cast<long long>(r) * rb, bytes, full);
  }
  return true;
}

// A split-K FFN task streams rows of two sizes from one region: its slice's gate/up pairs
// (F_ROW_BYTES each), then its slice of W_down's columns as F_K rows of 2 x width bytes.
__device__ bool load_split_k(const Params& p, Shared& s, const int* t, uint32_t& issued) {
  const int width = t[F_ROW1] - t[F_ROW0], rb = t[F_ROW_BYTES];
  const uint8_t* src = task_weights(p, t);
  return load_rows(p, s, src, width, rb, issued) &&
         load_rows(p, s, src + static_cast<long long>(width) * rb, t[F_K], 2 * width, issued);
}
#endif

// Walks the same stream as compute and cuts each task's weights into pages of whole rows, in
// the same order compute consumes them. Stops when compute raises `quit`, then waits for the
// copies still in flight so that none lands after the CTA is gone.
__device__ void run_loader(const Params& p, Shared& s) {
  if ((threadIdx.x & 31) != 0) return;
  const int begin = p.stream_offsets[blockIdx.x], end = p.stream_offsets[blockIdx.x + 1];
  uint32_t issued = 0;
  for (long long step = 0; step < p.n_steps; ++step) {
    for (int i = begin; i < end; ++i) {
      const int* t = task_row(p, p.stream_tasks[i]);
#if !MLA
      if (t[F_OPCODE] == OP_ATTENTION) {
        if (!load_kv_chunk(p, s, t, step, p.stream_tasks[i], issued)) goto drain;
        continue;
      }
#endif
#if FFN_SPLIT_K
      if (t[F_OPCODE] == OP_FFN_SPLIT_K) {
        if (!load_split_k(p, s, t, issued)) goto drain;
        continue;
      }
#endif
#if MLA
      if (t[F_OPCODE] == OP_MLA_ATTENTION) {  // its slot holds the task's key blocks in turn with
        if (!load_mla_page(p, s, t, step, p.stream_tasks[i], issued)) goto drain;  // s.vec (mla_chunk)
        continue;
      }
#endif
      if (!has_weights(t)) continue;
      const int rows = stream_rows(t), rb = t[F_ROW_BYTES], rpp = rows_per_page(t);
      const uint8_t* src = task_weights(p, t);
#if MOE
      const uint8_t* piece[MOE_PIECES];
      const bool routed = t[F_OPCODE] == OP_MOE_GATE_UP || t[F_OPCODE] == OP_MOE_DOWN_ADD;
      if (routed) {
        if (!route_pieces(p, s, t, step, p.stream_tasks[i], src, piece)) goto drain;
        src = piece[0];  // one piece per row: the expert's rows are contiguous, as a dense task's
      }
#endif
#if MOE && TP > 1  // a gate/up task whose slot holds no expert of this rank: nothing to load
      if (routed && t[F_OPCODE] == OP_MOE_GATE_UP && !piece[0]) continue;
      const int lrb = routed ? loaded_row_bytes(t, piece) : rb;
#else
      const int lrb = rb;
#endif
      for (int r = 0; r < rows; r += rpp) {
        const uint32_t bytes = min(rpp, rows - r) * lrb;
        uint64_t* full;
        uint8_t* page = start_page(p, s, issued, bytes, full);
        if (!page) goto drain;
#if MOE
        if (routed && GATHERS_PIECES(t))
          copy_pieces(page, piece, t, r, min(rpp, rows - r), full);
        else
#endif
          bulk_copy(page, src + static_cast<long long>(r) * rb, bytes, full);
      }
    }
  }
drain:
  while (!quit_seen(&s.flags[0])) __nanosleep(256);
  __threadfence_block();
  const uint32_t consumed = atomicAdd(const_cast<int*>(&s.flags[1]), 0);
  for (uint32_t c = consumed; c < issued; ++c)
    if (!ring_wait(p, &s.full[c % RING_PAGES], (c / RING_PAGES) & 1, nullptr)) break;
}
