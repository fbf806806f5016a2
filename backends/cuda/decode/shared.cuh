// ---- shared memory ------------------------------------------------------------------------
constexpr int FLAG_HOLD = 6;  // see Shared::flags
// The last word is the probes' (tools/phase_probe.py: the marks' count; tools/stream_probe.py:
// where a task's stamps lie): a static shared word of their own left no room in kernels whose
// ring fills shared memory.
constexpr int FLAG_PROBE = 7;
static_assert(FLAG_HOLD < FLAG_PROBE && FLAG_PROBE < FLAG_WORDS, "the flag words hold both");
struct Shared {
  uint8_t* ring;         // RING_PAGES x PAGE_BYTES weight pages
  float* vec;            // MAX_K fp32: the input vector of a task (attention: q/k/v heads)
  float* red;            // reduction scratch, MISC_FLOATS
  float* acc;            // ACC_FLOATS: a matrix-vector task's row sums
  uint64_t* full;        // RING_PAGES: page holds weights
  uint64_t* empty;       // RING_PAGES: the page's warp group is done with it
  volatile int* flags;   // FLAG_WORDS: [0] quit, [1] pages consumed; [2..4] broadcasts (see users); [5] sample mode;
                         // [FLAG_HOLD] the loader's copies held (pages.cuh: hold_copies); [FLAG_PROBE] the probes' (above)
  int* task;             // [TASK_SLOTS][TASK_SLOT]: compute's task rows (run_compute)
};
static_assert(TASK_FIELDS <= TASK_SLOT, "a task row fits its shared-memory slot (passes/residency.py)");

__device__ __forceinline__ Shared carve(uint8_t* base) {
  Shared s;
  s.ring = base;
  s.vec = reinterpret_cast<float*>(base + RING_PAGES * PAGE_BYTES);
  s.red = s.vec + MAX_K;
  s.acc = s.red + MISC_FLOATS;
  s.full = reinterpret_cast<uint64_t*>(s.acc + ACC_FLOATS);
  s.empty = s.full + RING_PAGES;
  s.flags = reinterpret_cast<volatile int*>(s.empty + RING_PAGES);
  s.task = const_cast<int*>(s.flags) + FLAG_WORDS;
  return s;
}

__device__ __forceinline__ const int* task_row(const Params& p, int id) { return p.tasks + id * TASK_FIELDS; }
// A task's weights: F_W_HI:F_W_LO counts 16-byte units into the packed weights.
__device__ __forceinline__ const uint8_t* task_weights(const Params& p, const int* t) {
  return p.weights + ((static_cast<long long>(t[F_W_HI]) << 32) | static_cast<uint32_t>(t[F_W_LO])) * 16;
}
// Division of n >= 0 by a d >= 1 that is fixed for a task (read from its row) and divides many
// values: its reciprocal m = ceil(2^32 / d) taken once, then each quotient one multiply-high,
// where the compiler's division by a value it cannot see is ~20 dependent instructions
// (tools/divisions.py counts them). Exact while n d < 2^32: n m / 2^32 = n / d + n e / (d 2^32)
// with e = m d - 2^32 < d, and that excess stays under the 1 / d between n / d and the next
// integer. d = 1 (m would be 2^32) keeps m = 0 and takes n itself.
struct Divisor {
  uint32_t m;
  __device__ __forceinline__ explicit Divisor(int d) : m(d == 1 ? 0u : 0xffffffffu / d + 1) {}
  __device__ __forceinline__ int operator()(int n) const { return m ? __umulhi(n, m) : n; }
};
// Matrix-vector tasks: norm_matvec and a MoE gate/up stage an RMS-normalized input;
// matvec_add and a MoE down projection add a residual. The MoE opcodes exist only in MoE
// kernels, so that a dense kernel tests for what it always did.
__device__ __forceinline__ bool has_weights(const int* t) {
#if MOE
  if (t[F_OPCODE] == OP_MOE_GATE_UP || t[F_OPCODE] == OP_MOE_DOWN_ADD) return true;
#endif
#if MLA
  if (t[F_OPCODE] == OP_HEAD_MATVEC) return true;
#endif
  return t[F_OPCODE] == OP_NORM_MATVEC || t[F_OPCODE] == OP_MATVEC_ADD;
}
__device__ __forceinline__ bool normed(const int* t) {
#if MOE
  if (t[F_OPCODE] == OP_MOE_GATE_UP) return true;
#endif
#if FFN_SPLIT_K
  if (t[F_OPCODE] == OP_FFN_SPLIT_K) return true;
#endif
  return t[F_OPCODE] == OP_NORM_MATVEC;
}
__device__ __forceinline__ bool adds_residual(const int* t) {
#if MOE
  if (t[F_OPCODE] == OP_MOE_DOWN_ADD) return true;
#endif
  return t[F_OPCODE] == OP_MATVEC_ADD;
}
__device__ __forceinline__ int rows_per_page(const int* t) { return PAGE_BYTES / t[F_ROW_BYTES]; }
// The sums of an output row: a gate/up pair's two (EPI_SILU_MUL), else one.
__device__ __forceinline__ int row_halves(const int* t) { return t[F_EPILOGUE] == EPI_SILU_MUL ? 2 : 1; }
#if FP8_MMA  // an FP8 tile task's geometry (tile_pages)
// Its counts are powers of two, taken by shifts: warp 0 works them out at every tile task's start,
// on the way to its staging, where ~10 integer divisions by values read from the task row (a
// chain of ~20 dependent instructions each) took 0.76-0.94 us a task (H100; docs/performance.md,
// session 61).
// The segments S of its rows of k columns: 8 when k is whole 1024s, else 4 (ir/fp8.py:
// tile_segments); a tile is 64 / S rows.
__device__ __forceinline__ int tile_shift(int k) { return k % 1024 == 0 ? 3 : 2; }  // log2 S
__device__ __forceinline__ int tile_segments(int k) { return 1 << tile_shift(k); }
// The pieces of a tile task's rows, each with its own tiles and its own part of the input: one,
// or a MoE down task's slots' and the shared expert's (whose width tiling makes a slot's: a
// piece is MOE_SLOT_K columns); their sums add up (tile_pages).
__device__ __forceinline__ int tile_pieces(const int* t) {
#if MOE
  if (t[F_OPCODE] == OP_MOE_DOWN_ADD) return t[F_SLOTS] + (MOE_SHARED_K > 0);
#endif
  return 1;
}
__device__ __forceinline__ int tile_k(const int* t) {  // a piece's columns
#if MOE
  if (t[F_OPCODE] == OP_MOE_DOWN_ADD) return MOE_SLOT_K;
#endif
  return t[F_K];
}
// log2 of the columns C of a unit, 128 or 256 (ir/fp8.py: tile_unit_cols): F_ROW_BYTES = 64 C
// values + S C / 128 fp32 scales, 8192 + 4 S bytes or 16384 + 8 S.
__device__ __forceinline__ int unit_shift(const int* t) { return t[F_ROW_BYTES] > 64 * 256 ? 8 : 7; }
__device__ __forceinline__ int unit_cols(const int* t) { return 1 << unit_shift(t); }
// The units of one piece of a tile: a piece's k / S columns of a segment, C a unit.
__device__ __forceinline__ int tile_units(const int* t) {
  const int k = tile_k(t);
  return k >> tile_shift(k) >> unit_shift(t);
}
// A piece's units over all the task's tiles (a gate/up task's rows have a gate and an up tile),
// which stream one piece after another (copy_pieces). A task's rows are whole tiles of 64 / S.
__device__ __forceinline__ int piece_units(const int* t) {
  return ((t[F_ROW1] - t[F_ROW0]) >> (6 - tile_shift(tile_k(t)))) * row_halves(t) * tile_units(t);
}
#endif
// The first of n keys in context chunk c of `chunks` (an attention, DSA score or KV-loader task's
// chunk): n c / chunks, in 32 bits, where a 64-bit division was a call of ~100 instructions at
// the start of each such task.
static_assert(MAX_SEQ <= 0x7fffffff / 64, "n c fits 32 bits for up to 64 chunks");
__device__ __forceinline__ long long chunk_start(long long n, int c, int chunks) {
  return static_cast<int>(n) * c / chunks;
}
// The rows a matrix-vector task's weights stream as, F_ROW_BYTES each: its output rows, or an
// FP8 tile task's units, every piece's.
__device__ __forceinline__ int stream_rows(const int* t) {
#if FP8_MMA
  if (t[F_W_FORMAT] == WF_FP8_TILES) return tile_pieces(t) * piece_units(t);
#endif
  return t[F_ROW1] - t[F_ROW0];
}

// Spins until the counter reaches `target` (acquire). False when another SM failed, when the
// watchdog fires (recorded with the task and counter), or, given the loader's `quit` flag, when
// compute has ended the launch (a routed task's router may then never run). SYSTEM: an
// exchange counter, which other GPUs increment (acquire at system scope).
template <bool SYSTEM = false>
__device__ __forceinline__ bool acquire(const Params& p, int counter, unsigned target, int task, volatile int* quit) {
  bool ok = true;
  const unsigned long long start = now_ns();
  unsigned spins = 0;
#if TP > 1
  while ((SYSTEM ? ld_acquire_sys(&p.counters[counter]) : ld_acquire(&p.counters[counter])) < target) {
#else
  while (ld_acquire(&p.counters[counter]) < target) {
#endif
    if ((++spins & 1023) == 0) {
      if (quit && quit_seen(quit)) { ok = false; break; }
      if (*reinterpret_cast<volatile int*>(&p.status[ST_ERROR]) != ERR_NONE) { ok = false; break; }
      if (now_ns() - start > static_cast<unsigned long long>(p.watchdog_ns)) {
        if (atomicCAS(&p.status[ST_ERROR], ERR_NONE, ERR_WATCHDOG) == ERR_NONE) {
          p.status[ST_ERROR_SM] = blockIdx.x;
          p.status[ST_ERROR_TASK] = task;
          p.status[ST_ERROR_COUNTER] = counter;
        }
        ok = false;
        break;
      }
    }
  }
  return ok;
}
