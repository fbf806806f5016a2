// tilertc persistent decode kernel: the device library.
//
// One CTA per SM runs that SM's static instruction stream for every decode step. Warp 0 is the
// loader: one lane walks the stream ahead of compute and keeps a ring of shared-memory pages
// full of weights (bulk async copies completing on mbarriers), across op, layer and token
// boundaries. The other warps compute; before a task they acquire the counters of the ops it
// depends on, after it they release its own. The generated prelude defines the model's
// constants (HIDDEN, HEAD_DIM, ...) and the ring geometry before this file is included.
#include <cuda_bf16.h>
#include <stdint.h>
#include <type_traits>
#if WEIGHT_FP8
#include <cuda_fp8.h>
#endif
#ifndef FFN_SPLIT_K  // the prelude defines it (and FIXED_FRAC_BITS) in kernels with split-K FFNs
#define FFN_SPLIT_K 0
#endif
#ifndef FP8_MMA  // the prelude defines it in FP8 kernels compiled with --tune fp8_mma=1
#define FP8_MMA 0
#endif
#ifndef READY_DIGITS  // the prelude defines it where producers write FP8 tile inputs' digits
#define READY_DIGITS 0
#endif

namespace tilertc {

// ---- the task table (written by backends/cuda/encode.py; keep the two in step) -------------
enum Opcode : int {
  OP_EMBED = 0, OP_NORM_MATVEC = 1, OP_MATVEC_ADD = 2, OP_ATTENTION = 3, OP_ARGMAX = 4,
  OP_MOE_TOPK = 5, OP_MOE_GATE_UP = 6, OP_MOE_DOWN_ADD = 7, OP_HEAD_MATVEC = 8, OP_MLA_ATTENTION = 9,
  OP_DSA_SCORE = 10, OP_DSA_TOPK = 11, OP_FFN_SPLIT_K = 12
};
enum Epilogue : int { EPI_NONE = 0, EPI_SILU_MUL = 1, EPI_ARGMAX = 2 };
enum Field : int {
  F_OPCODE, F_EPILOGUE, F_ROW0, F_ROW1, F_K, F_IN, F_OUT, F_AUX, F_AUX2, F_W_LO, F_W_HI,
  F_ROW_BYTES, F_WAIT0, F_WAIT0_N, F_WAIT1, F_WAIT1_N, F_SIGNAL, F_KCACHE, F_VCACHE, F_EPS,
  F_SCALE, F_COUNT, F_CHUNK, F_ARRIVE, F_AUX3, F_W_FORMAT,
#if MOE  // a routed task's rows are F_SLOTS pieces, piece j from the expert in slot F_SLOT0 + j
  F_ROUTE,          // the router's counter, which the loader acquires before reading the ids
  F_IDS,            // act offset of the router's expert ids (int32)
  F_SLOT0, F_SLOTS,
  F_EXPERT_STRIDE,  // bytes / 16 between consecutive experts' packed weights of the op
#endif
#if MOE_SHARED_K  // a down task's rows end with the shared expert's down rows, which are static
  F_SHARED_IN,                // act offset of the shared expert's activations
  F_SHARED_LO, F_SHARED_HI,   // byte offset / 16 of the task's shared rows in the packed weights
#endif
#if MLA  // a head_matvec's rows come in heads of F_HEAD_ROWS, each reading its own F_K inputs
  F_IN_STRIDE,      // act floats between consecutive heads' inputs
  F_HEAD_ROWS,
  F_APPEND,         // 1: this task also normalizes, rotates and appends the step's latent cache row
#endif
#if MLA && WEIGHT_FP8
  F_SCALE_SHIFT,    // log2 of the 4-column groups per scale of its rows (q absorption's: fewer than a block's)
#endif
#if DSA  // a dsa_score task's key LayerNorm bias (its weight: F_AUX3)
  F_NORM_BIAS,
#endif
#if FFN_SPLIT_K  // a split-K FFN's output is a fixed-point sum (see the split-K FFN section)
  F_FIXED_IN,       // 1: F_IN (a norm_matvec's input) is a fixed-point buffer
  F_FIXED_RES,      // 1: F_AUX (a matvec_add's residual) is a fixed-point buffer
  F_FIXED_OUT,      // a matvec_add: act offset of the fixed-point start value it also writes; -1: none
#endif
#if READY_DIGITS  // passes/digits.py: an FP8 tile task's input made as digits by its producer
  F_DIGITS_IN,      // act offset of the digits this task reads in place of its input; -1: none
  F_DIGITS_OUT,     // act offset of the digits this task writes of its rows for their consumer; -1: none
  F_DIGITS_K,       // that consumer's input length
  F_DIGITS_GAMMA,   // that consumer's norm weight (act offset); -1: it does not normalize
#endif
#if TP > 1  // a task that exchanges with the other ranks (tensor parallelism, see exchange)
  F_XCHG,         // its exchange counter, -1: none
  F_XCHG_BUF,     // act offset of its receive buffer: one slot per rank
  F_XCHG_STRIDE,  // floats between consecutive ranks' slots
#endif
  TASK_FIELDS
};
enum WeightFormat : int { WF_BF16 = 0, WF_FP8 = 1, WF_FP8_TILES = 2 };  // F_W_FORMAT of a matrix-vector task
constexpr int LAG_SHIFT = 24;  // a wait's per-step count in the low bits, its step lag above

// ---- kernel parameters: 8-byte words, laid out by backends/cuda/runtime.py ---------------
struct Params {
  const int* tasks;            // [n_tasks][TASK_FIELDS]
  const int* stream_offsets;   // [num_ctas + 1] into stream_tasks
  const int* stream_tasks;     // task ids, per CTA in order
  const uint8_t* weights;      // packed weights
  float* act;                  // fp32 arena: activations, norm weights, RoPE table, scratch
  __nv_bfloat16* kv;           // bf16 KV-cache arena
  const __nv_bfloat16* embed;  // [VOCAB][HIDDEN] embedding table
  unsigned* counters;          // one per fused op, zeroed before launch
  int* tokens;                 // [n_steps] device copy of sampled tokens
  int* host_tokens;            // host-mapped ring [n_steps]
  int* host_count;             // host-mapped: tokens written so far
  int* host_stop;              // host-mapped: the host asks the kernel to stop
  int* status;                 // [STATUS_WORDS] error code, where, steps done
  long long first_token, start_pos, n_steps, eos_token, rope_offset, sampler_counter;
  long long watchdog_ns;
  unsigned long long* profile;  // null, or [profile_steps][n_tasks][3] globaltimer stamps
  long long profile_steps, n_tasks;
  const struct SampleArgs* sample;  // the sampling parameters (below)
#if TP > 1
  long long rank;                 // this GPU's rank among TP
  const struct PeerTable* peers;  // every rank's arenas (below)
#endif
};
#if TP > 1
// Tensor parallelism: where every rank's act arena and counters lie, as this GPU addresses them
// (peer pointers over NVLink; this rank's own at [rank]). In global memory, read where used.
struct PeerTable {
  float* act[TP];
  unsigned* counters[TP];
};
#endif
// In their own block, read where they are used: held in registers from the kernel's start like
// the other parameters, they (and what the compiler derives from them) would crowd the
// registers every task needs, and spill.
struct SampleArgs {
  double temperature, top_p;  // float32 values (the host rounds them); temperature 0: greedy
  long long top_k;            // 0: off
  unsigned long long seed;
};
enum Status : int {
  ST_ERROR, ST_ERROR_SM, ST_ERROR_TASK, ST_ERROR_COUNTER, ST_STOP, ST_STEPS, ST_NUCLEUS_CUT, STATUS_WORDS
};
enum ErrorCode : int { ERR_NONE = 0, ERR_WATCHDOG = 1, ERR_BAD_TOKEN = 2, ERR_CONTEXT = 3, ERR_RING = 4 };

// ---- PTX wrappers ---------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok) : "r"(smem_addr(bar)), "r"(parity) : "memory");
  return ok != 0;
}
// The ring's copies: weights and past keys / values, each read once a step and far more than
// L2 holds, so they are marked evict-first: they leave L2 before the activations, digits and
// counters that SMs hand each other (llama-3.1-8b FP8 on an H200: 1.6 % faster a token,
// docs/performance.md, session 27).
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "{\n .reg .b64 policy;\n createpolicy.fractional.L2::evict_first.b64 policy, 1.0;\n"
      " cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], "
      "policy;\n}\n" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
#if TP > 1  // the exchanges between GPUs synchronize at system scope
__device__ __forceinline__ unsigned ld_acquire_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_sys(unsigned* p, unsigned v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
#endif
__device__ __forceinline__ unsigned atom_add_acq_rel(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ void red_release(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
#if FFN_SPLIT_K
__device__ __forceinline__ void red_add_s64(long long* p, long long v) {  // two's complement: u64 add
  asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
#endif
#if FP8_MMA
// The tensor-core pieces of the FP8 tiles' path (see tile_pages); the host harness
// (tests/host_kernel.cpp) defines its own of these names. Operands are K-major core matrices
// (8 rows x 16 bytes, 128 B, unswizzled) in shared memory; a descriptor holds the address,
// `lbo` (bytes between the two 16-byte k halves of a k32 step) and `sbo` (bytes between groups
// of 8 rows), each over 16 (PTX ISA: matrix descriptor of wgmma).
__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((smem_addr(p) & 0x3ffff) >> 4) | static_cast<uint64_t>(lbo >> 4) << 16 |
         static_cast<uint64_t>(sbo >> 4) << 32;
}
// Named barrier 2 + k spans compute warpgroup k (barrier 1: compute_sync).
__device__ __forceinline__ void warpgroup_sync(int k) { asm volatile("bar.sync %0, 128;" ::"r"(2 + k) : "memory"); }
// D (+)= A B, A 64 x 32 e4m3, B 32 x N e4m3, D 64 x N f32 over the warpgroup: warp w's lane
// (g = lane / 4, q = lane % 4) holds d[4 i + 0, 1] = D[16 w + g][8 i + 2 q, + 1] and
// d[4 i + 2, 3] = D[16 w + g + 8][the same columns]. `accumulate` 0: D = A B.
template <int N> struct Wgmma;
template <> struct Wgmma<32> {
  static __device__ __forceinline__ void mma(float (&d)[16], uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15}, %16, %17, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
          "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(a), "l"(b), "r"(accumulate));
  }
};
template <> struct Wgmma<16> {
  static __device__ __forceinline__ void mma(float (&d)[8], uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(a), "l"(b), "r"(accumulate));
  }
};
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Orders this thread's shared-memory stores before the tensor cores' reads (the async proxy).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// prmt.b32: byte i of the result is byte s[4 i .. 4 i + 2] of b:a, or with s[4 i + 3] set that
// byte's sign bit in all 8 bits (which __byte_perm leaves out). The host harness has its own.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
  return d;
}
#endif
#if MLA
// MLA attention's score and value products (mla_chunk) on the tensor cores; the host harness
// (tests/host_kernel.cpp) defines its own of this name. D = A * B + D: A 16x16 bf16 (4 bf16x2
// registers, the lower k in the low half), B 16x8 bf16 (2), D 16x8 f32 (4), the PTX ISA's
// mma.m16n8k16 fragments (group g = lane / 4, q = lane % 4: a0 row g, k 2q, 2q+1; a1 row g+8;
// a2, a3 the same rows at k + 8; b0 column g, k 2q, 2q+1; b1 k + 8; d0, d1 row g, columns 2q,
// 2q+1; d2, d3 row g+8).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif
// 16 bytes from global memory (through L2, as __ldcg) to shared memory, asynchronously: the
// copies a thread has issued complete by its cp_async_wait_all.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
// Waits on a ring mbarrier with the same watchdog as counter waits: a protocol bug becomes an
// error (ERR_RING) instead of a hang. Returns false when the kernel is failing.
// The loader and the compute warps part at the end of a launch through two flag words: compute
// publishes how many pages it consumed, then the quit flag; the loader polls for it. Both are
// shared-memory atomics, ordered by a fence, because the loader cannot join a barrier while it
// may be blocked on a page that compute will never release.
__device__ __forceinline__ bool quit_seen(volatile int* quit) {
  return atomicAdd(const_cast<int*>(quit), 0) != 0;
}

__device__ bool ring_wait(const Params& p, uint64_t* bar, uint32_t parity, volatile int* quit) {
  unsigned spins = 0;
  unsigned long long start = 0;
  while (!mbar_try_wait(bar, parity)) {
    if (quit && quit_seen(quit)) return false;
    if ((++spins & 4095) == 0) {
      if (start == 0) start = now_ns();
      if (*reinterpret_cast<volatile int*>(&p.status[ST_ERROR]) != ERR_NONE) return false;
      if (now_ns() - start > static_cast<unsigned long long>(p.watchdog_ns)) {
        if (atomicCAS(&p.status[ST_ERROR], ERR_NONE, ERR_RING) == ERR_NONE) p.status[ST_ERROR_SM] = blockIdx.x;
        return false;
      }
    }
  }
  return true;
}

// An opaque copy of x: the compiler cannot hoist what is computed from it out of the loop it is
// in. The kernel is at its register limit inside attention; a value hoisted out of the step loop
// stays live through attention and spills.
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

// e^x as one MUFU.EX2 without __expf's fix-up for results under 2^-126 (flushed to 0 here: a
// softmax weight that small adds nothing); attention's inner loop takes two a lane and key round.
// The host harness (tests/host_kernel.cpp) defines its own.
__device__ __forceinline__ float exp_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.44269504088896341f));
  return y;
}

// Named barrier 1 spans the compute warps only, so the loader never takes part.
__device__ __forceinline__ void compute_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(COMPUTE_WARPS * 32) : "memory");
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// ---- shared memory ------------------------------------------------------------------------
struct Shared {
  uint8_t* ring;         // RING_PAGES x PAGE_BYTES weight pages
  float* vec;            // MAX_K fp32: the input vector of a task (attention: q/k/v heads)
  float* red;            // reduction scratch, MISC_FLOATS
  float* acc;            // ACC_FLOATS: a matrix-vector task's row sums
  uint64_t* full;        // RING_PAGES: page holds weights
  uint64_t* empty;       // RING_PAGES: the page's warp group is done with it
  volatile int* flags;   // FLAG_WORDS: [0] quit, [1] pages consumed; [2..4] broadcasts (see users); [5] sample mode
  int* task;             // [2][TASK_SLOT]: compute's task rows, this task's and the next's (run_compute)
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
// The segments S of its rows of k columns: 8 when k is whole 1024s, else 4 (ir/fp8.py:
// tile_segments); a tile is 64 / S rows.
__device__ __forceinline__ int tile_segments(int k) { return k % 1024 == 0 ? 8 : 4; }
// The pieces of a tile task's rows, each with its own tiles and its own part of the input: one,
// or a MoE down task's slots' and the shared expert's (whose width tiling makes a slot's: a
// piece is F_K / pieces columns); their sums add up (tile_pages).
__device__ __forceinline__ int tile_pieces(const int* t) {
#if MOE
  if (t[F_OPCODE] == OP_MOE_DOWN_ADD) return t[F_SLOTS] + (MOE_SHARED_K > 0);
#endif
  return 1;
}
__device__ __forceinline__ int tile_k(const int* t) { return t[F_K] / tile_pieces(t); }  // a piece's columns
// The columns C of a unit: F_ROW_BYTES = 64 C values + S C / 128 fp32 scales = C (2048 + S) / 32.
__device__ __forceinline__ int unit_cols(const int* t) { return 32 * t[F_ROW_BYTES] / (2048 + tile_segments(tile_k(t))); }
// The units of one piece of a tile: a piece's k / S columns of a segment, C a unit.
__device__ __forceinline__ int tile_units(const int* t) {
  const int k = tile_k(t);
  return k / tile_segments(k) / unit_cols(t);
}
// A piece's units over all the task's tiles (a gate/up task's rows have a gate and an up tile),
// which stream one piece after another (copy_pieces).
__device__ __forceinline__ int piece_units(const int* t) {
  return (t[F_ROW1] - t[F_ROW0]) / (64 / tile_segments(tile_k(t))) * row_halves(t) *
         tile_units(t);
}
#endif
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
  const long long n = pos + 1, chunks = t[F_COUNT], c = t[F_CHUNK];
  const long long k0 = n * c / chunks, k1 = n * (c + 1) / chunks;
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

// ---- compute: dependencies -----------------------------------------------------------------
// Thread 0 of compute acquires; the barrier then publishes what it saw to the other warps.
__device__ bool wait_counter(const Params& p, int counter, unsigned target, int task) {
  bool ok = true;
  if (threadIdx.x == 0) ok = acquire(p, counter, target, task, nullptr);
  return ok;
}

__device__ bool wait_deps(const Params& p, Shared& s, const int* t, long long step, int task) {
  bool ok = true;
  for (int w = 0; w < 2; ++w) {
    const int c = t[F_WAIT0 + 2 * w];
    if (c < 0) continue;
    const int n = t[F_WAIT0_N + 2 * w] & ((1 << LAG_SHIFT) - 1), lag = t[F_WAIT0_N + 2 * w] >> LAG_SHIFT;
    const long long want = static_cast<long long>(n) * (step + 1 - lag);
    if (want > 0) ok = wait_counter(p, c, static_cast<unsigned>(want), task) && ok;
  }
  if (threadIdx.x == 0) s.flags[2] = ok;
  compute_sync();
  return s.flags[2];
}

// The barrier orders every compute thread's writes before the signalling thread's release, and
// release is cumulative, so no separate fence is needed. The release still waits for those
// writes to reach L2 (a round trip); it is made by a thread of the second warp, so that the
// first warp's thread 0 starts acquiring the next task's counters meanwhile.
constexpr int SIGNAL_THREAD = COMPUTE_WARPS > 1 ? 32 : 0;
__device__ void signal_done(const Params& p, const int* t) {
  compute_sync();
  if (threadIdx.x == SIGNAL_THREAD) red_release(&p.counters[t[F_SIGNAL]], 1);
}

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

// Bits of the rows select_top tells apart among equal keys: the vocabulary's, and in a DSA kernel
// also the context's (the indexer's token ids); more bits than needed change no result.
#if DSA
constexpr int SELECT_ROW_BITS = SAMPLE_ROW_BITS > DSA_ROW_BITS ? SAMPLE_ROW_BITS : DSA_ROW_BITS;
#else
constexpr int SELECT_ROW_BITS = SAMPLE_ROW_BITS;
#endif

// The `want` largest of the block's (key, row) items: those with key > kth, and those with
// key == kth and row <= last (the lowest rows among equal keys). Found without sorting, by
// block-wide counts: kth bit by bit from the top (the largest x with at least `want` keys >= x),
// then, only if more keys equal kth than fit, `last` bit by bit over the row bits. ir/sampling.py:
// select_top is the same algorithm. `total`: the block's item count; count_ge(x): this thread's
// items with key >= x; count_tie(kth, x): its items with key == kth and row < x.
struct Cut {
  uint32_t kth;
  int last;
};
__device__ __forceinline__ bool taken(const Cut& c, uint32_t key, int row) {
  return key > c.kth || (key == c.kth && row <= c.last);
}
template <class CountGe, class CountTie>
__device__ Cut select_top(BlockCount& sum, int total, int want, CountGe count_ge, CountTie count_tie, int ct) {
  uint32_t kth = 0;
  int at = total;  // items with key >= kth
  for (int b = 31; b >= 0; --b) {
    const uint32_t probe = kth | (1u << b);
    const int n = sum(count_ge(probe), ct);
    if (n >= want) {
      kth = probe;
      at = n;
    }
  }
  if (at == want) return {kth, 0x7fffffff};
  const int need = want - (kth == 0xffffffffu ? 0 : sum(count_ge(kth + 1), ct));
  int last = 0;  // the largest row with fewer than `need` tied rows below it: the need-th row
  for (int b = SELECT_ROW_BITS - 1; b >= 0; --b) {
    const int probe = last | (1 << b);
    if (sum(count_tie(kth, probe), ct) < need) last = probe;
  }
  return {kth, last};
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
  auto count_ge = [&](uint32_t x) {
    int n = 0;
    for (int i = ct; i < rows; i += NT) n += order_key(lm_logit(s, i, rstd)) >= x;
    return n;
  };
  auto count_tie = [&](uint32_t kth, int x) {
    int n = 0;
    for (int i = ct; i < rows; i += NT) n += order_key(lm_logit(s, i, rstd)) == kth && row0 + i < x;
    return n;
  };
  const Cut cut = select_top(sum, rows, SAMPLE_SLOTS, count_ge, count_tie, ct);
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
  if (ct == 0) *fill = 0;  // the first block count's barrier orders this before its use
  uint32_t key[CANDIDATES_PER_THREAD];  // 0: no candidate
  int valid = 0;
#pragma unroll
  for (int j = 0; j < CANDIDATES_PER_THREAD; ++j) {
    key[j] = ct + j * NT < CANDIDATES ? order_key(__ldcg(logits + j * NT)) : 0u;
    valid += key[j] != 0;
  }
  BlockCount sum{reinterpret_cast<int*>(s.red + SR_COUNT), 0};
  auto count_ge = [&](uint32_t x) {
    int n = 0;
#pragma unroll
    for (int j = 0; j < CANDIDATES_PER_THREAD; ++j) n += key[j] >= x;
    return n;
  };
  auto count_tie = [&](uint32_t kth, int x) {
    int n = 0;
#pragma unroll
    for (int j = 0; j < CANDIDATES_PER_THREAD; ++j) n += key[j] == kth && __ldcg(rows + j * NT) < x;
    return n;
  };
  const int total = sum(valid, ct);
  const Cut cut = select_top(sum, total, SAMPLE_WANT, count_ge, count_tie, ct);
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

#if TP > 1
// ---- tensor parallelism: exchanges between ranks (passes/synchronization.py) --------------
// An exchanging task writes its part into its rank's slot of its receive buffer on every rank,
// then arrives on its exchange counter on every rank and waits until all TP have arrived on
// this rank's. Each writing thread fences at system scope before the barrier: its stores go
// over NVLink, and the arrival's release (by another thread) must not overtake them.
__device__ __forceinline__ void publish_partial(const Params& p, const int* t, int row, float y) {
  const long long at = t[F_XCHG_BUF] + p.rank * t[F_XCHG_STRIDE] + row;
#pragma unroll 1  // unrolled, it costs run_matvec the register that DeepSeek-V3.2's kernel lacks
  for (int r = 0; r < TP; ++r) __stcg(p.peers->act[r] + at, y);
}

__device__ void exchange_arrive(const Params& p, const int* t) {
  __threadfence_system();
  compute_sync();
  if (threadIdx.x == SIGNAL_THREAD) {
#pragma unroll
    for (int r = 0; r < TP; ++r) red_release_sys(p.peers->counters[r] + t[F_XCHG], 1);
  }
}
// Waits (with the watchdog) until every rank's copy of the task has arrived on this rank's
// exchange counter; false when the kernel is failing.
__device__ bool exchange_await(const Params& p, Shared& s, const int* t, long long step, int task) {
  bool ok = true;
  if (threadIdx.x == 0) ok = acquire<true>(p, t[F_XCHG], static_cast<unsigned>(TP * (step + 1)), task, nullptr);
  if (threadIdx.x == 0) s.flags[2] = ok;
  compute_sync();
  return s.flags[2];
}

// The all-reduce of an exchanging matrix-vector task (o_proj, the down projection): its rows'
// partial sums from every rank, added in rank order (the same sum on every rank), plus the
// residual, into its output rows.
__device__ void sum_ranks(const Params& p, const int* t, int ct) {
  const int row0 = t[F_ROW0], rows = t[F_ROW1] - row0, stride = t[F_XCHG_STRIDE];
  const float* slot = p.act + t[F_XCHG_BUF] + row0;
  for (int i = ct; i < rows; i += COMPUTE_WARPS * 32) {
    float y = __ldcg(slot + i);
#pragma unroll
    for (int r = 1; r < TP; ++r) y += __ldcg(slot + r * stride + i);
    __stcg(p.act + t[F_OUT] + row0 + i, y + __ldcg(p.act + t[F_AUX] + row0 + i));
  }
}
__device__ bool exchange_rows(const Params& p, Shared& s, const int* t, long long step, int task, int ct) {
  exchange_arrive(p, t);
  if (!exchange_await(p, s, t, step, task)) return false;
  sum_ranks(p, t, ct);
  return true;
}
#endif

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
  int row0, first, head_rows, k;  // k = 0: every row reads the one input
  __device__ __forceinline__ int operator()(int i) const { return k ? ((row0 + i) / head_rows - first) * k : 0; }
};
__device__ __forceinline__ HeadInputs head_inputs(const int* t) {
  if (t[F_OPCODE] != OP_HEAD_MATVEC) return {0, 0, 1, 0};
  return {t[F_ROW0], t[F_ROW0] / t[F_HEAD_ROWS], t[F_HEAD_ROWS], t[F_K]};
}
// MLA attention's result of a chunk of a head group (run_mla_attention): per head its MLA_RANK
// sums, its max and its sum.
constexpr int MLA_PART = MLA_HEADS * (MLA_RANK + 2);

// v expansion's input, heads h0..h1 of o_latent, merged from the attention's chunk results
// (F_COUNT chunks a head group, at F_AUX3; passes/fusion_mla.py says why here): chunk k's sums
// count exp(max_k - max) / den times, den the head's softmax sum; an empty chunk (max -inf) not
// at all. Every thread first asks for its share of the heads' chunk results as 16-byte copies
// into shared memory (cp.async: no registers held), a window of MLA_RANK + 4 floats a result,
// which starts 8 bytes early where a result does not start on 16 bytes (MLA_RANK + 2 floats
// apart, they alternate); while they are under way a warp per head weighs its chunks (a lane
// per chunk, its max and sum one load; factor and window offset after the heads' inputs in
// s.vec); then each thread adds up a dim of a head over the chunks from shared memory. So the
// merge waits for one round trip to L2 and the copies, not three round trips before the sums
// and one a chunk after (4.1 µs a DeepSeek-V3.2 task with loads into registers, whose first
// batch could not be issued before the weighing without spilling; docs/performance.md,
// sessions 36, 41 and 46). passes/tiling.py keeps a task within one head (two heads' results
// of GLM-5's 32 chunks would not fit) and passes/residency.py sizes s.vec for the windows. The
// task that holds a head's first row also leaves the head in o_latent (F_IN), the attention's
// output in the graph, which nothing downstream reads: what the tests and Engine's activations
// see.
constexpr int MERGE_WINDOW = MLA_RANK + 4;  // a chunk result's window, floats (residency.py: MERGE_WINDOW_PAD)
static_assert(MLA_RANK % 4 == 0, "chunk results start on 8 bytes: a 16-byte window is 8 early or not");
__device__ void stage_merged_heads(const Params& p, Shared& s, const int* t, int h0, int h1, int ct) {
  const int chunks = t[F_COUNT], n = h1 - h0, warp = ct >> 5, lane = ct & 31;
  float* factor = s.vec + n * MLA_RANK;  // [n][chunks]
  int* offset = reinterpret_cast<int*>(factor + n * chunks);  // [n][chunks]: the result's first float
  float* window = s.vec + (n * (MLA_RANK + 2 * chunks) + 3) / 4 * 4;  // [n][chunks][MERGE_WINDOW]
  const auto part = [&](int h, int k) {  // chunk k's result for head h
    return p.act + t[F_AUX3] + (static_cast<long long>(h / MLA_HEADS) * chunks + k) * MLA_PART +
           h % MLA_HEADS * (MLA_RANK + 2);
  };
  const auto early = [](const float* r) { return static_cast<int>(reinterpret_cast<uintptr_t>(r) >> 2 & 2); };
  constexpr int PIECES = MERGE_WINDOW / 4;
  for (int c = ct; c < n * chunks * PIECES; c += NT) {
    const int r = c / PIECES, piece = c % PIECES;
    const float* res = part(h0 + r / chunks, r % chunks);
    cp_async16(window + r * MERGE_WINDOW + 4 * piece, res - early(res) + 4 * piece);
  }
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
      offset[i * chunks + k] = (i * chunks + k) * MERGE_WINDOW + early(part(h0 + i, k));
      den += f * ms.y;
    }
    den = warp_sum(den);
    for (int k = lane; k < chunks; k += 32) factor[i * chunks + k] /= den;
  }
  cp_async_wait_all();
  compute_sync();  // every thread's copies and every head's factors
  for (int j = ct; j < n * MLA_RANK; j += NT) {
    const int i = j / MLA_RANK, d = j % MLA_RANK;
    float num = 0.f;
    for (int k = 0; k < chunks; ++k) num = fmaf(factor[i * chunks + k], window[offset[i * chunks + k] + d], num);
    s.vec[j] = num;
    if ((h0 + i) * t[F_HEAD_ROWS] >= t[F_ROW0]) __stcg(p.act + t[F_IN] + (h0 + i) * t[F_IN_STRIDE] + d, num);
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
  int slot_floats;       // a slot's activations
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
    return __ldcg(combine + 4 * i / slot_floats);
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
  in.slot_floats = down ? (t[F_K] - MOE_SHARED_K) / t[F_SLOTS] : 1;
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
  // down task, whose inputs carry their combine weights, is not normed: ss goes unused.)
  for (int i = ct; i < k4; i += COMPUTE_WARPS * 32) {
    float4 a = in.at(i);
    ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
    if (norm) {
      const float4 g = __ldcg(gamma + i);
      a.x *= g.x; a.y *= g.y; a.z *= g.z; a.w *= g.w;
    }
    v[i] = a;
  }
  end_staging(s, t, ss, ct);
}

#if FP8_MMA
// ---- FP8 tiles on the tensor cores (--tune fp8_mma=1) ----------------------------------------
// An FP8 tile task (WF_FP8_TILES; passes/tiling.py decides which, ir/fp8.py: pack_tiles packs
// them) multiplies its weights with wgmma, e4m3 in, f32 accumulation. Its rows of k columns are
// cut into S segments (tile_segments) and come in tiles of R = 64 / S rows of one matrix (a
// gate/up task: the rows' gate tile, then their up tile), so that a tile is A's 64 rows (m = R j
// + r: segment j of row r) over k / S columns. A tile streams as units of C columns of every
// segment (unit_cols), the values in core-matrix order, then the unit's S x C / 128 fp32 block
// scales (segment j's block b at j C / 128 + b: the tile's rows share one 128-row block). B is
// the input as TILE_DIGITS e4m3 digits per column (stage_digits), N = 4 S columns, so that
// D[m][4 j' + t] is row m's dot with digit t of segment j' of x; a row's sum takes its own
// segment's (j' = j).
constexpr int TILE_M = 64, TILE_DIGITS = 4;
static_assert(FP8_BLOCK_COLS == 128, "a scale block is 4 k32 steps");

// Digits of x (stage_digits): a 128-column block with max |x| < 2^E scales to the 16-bit fixed
// point M = rint(|x| 2^(16 - E)) (exact to 2^-17 of the block's largest |x|); digit t is nibble
// t of M, most significant first, with x's sign: an e4m3 byte whose value is n 2^-9 for nibble
// n, so that x = sum_t digit_t 2^(E + 5 - 4 t).
__device__ __forceinline__ int block_exponent(float amax) {  // the least E with amax < 2^E; a zero block: -100
  return max(((__float_as_int(amax) >> 23) & 0xff) - 126, -100);
}
// The scale 2^(16 - E) of a block's fixed point, and |x| at it: |x| up + 2^23 holds
// M = rint(|x| up) in its low 16 bits (0x4b00ffff: 2^23 + 0xffff, the largest M).
__device__ __forceinline__ float fixed_scale(int E) { return __int_as_float((127 + 16 - E) << 23); }
__device__ __forceinline__ uint32_t fixed_magnitude(float x, float up) {
  return min(__float_as_uint(fmaf(fabsf(x), up, 8388608.f)), 0x4b00ffffu);
}
// A block's factor: x = sum_t digit_t 2^(E + 5 - 4 t) (the fold's digit weights bring the t)
__device__ __forceinline__ float block_factor(int E) { return __int_as_float((127 + E + 5) << 23); }
// 4 columns x as 16-bit fixed-point magnitudes M, their nibbles a byte each (lo: nibbles 0
// and 2 of M0, then of M1 (M2, M3); hi: nibbles 1 and 3), and their signs (0xff or 0 a byte)
struct FixedColumns {
  uint32_t lo01, hi01, lo23, hi23, sign;
};
__device__ __forceinline__ FixedColumns fixed_columns(const float4& x, int E) {
  const float up = fixed_scale(E), v[4] = {x.x, x.y, x.z, x.w};
  uint32_t M[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) M[e] = fixed_magnitude(v[e], up);
  const uint32_t m01 = __byte_perm(M[0], M[1], 0x5410), m23 = __byte_perm(M[2], M[3], 0x5410);
  const uint32_t s01 = prmt(__float_as_uint(x.x), __float_as_uint(x.y), 0xfb);  // bytes 0, 1
  const uint32_t s23 = prmt(__float_as_uint(x.z), __float_as_uint(x.w), 0xfb);
  return {m01 & 0x0f0f0f0fu, (m01 >> 4) & 0x0f0f0f0fu, m23 & 0x0f0f0f0fu, (m23 >> 4) & 0x0f0f0f0fu,
          __byte_perm(s01, s23, 0x5410)};
}

// Stages an FP8 tile task's input as B, in place of stage_vector's fp32 copy (with the norm
// weight and 1/rms as there): per 16 columns of a segment (a chunk), 64 S bytes holding column
// n = 4 j + t (segment j's digit t) at 16 n, k in a row (K-major core matrices: a k32 step's B
// is 128 S bytes, its k halves 64 S bytes apart, groups of 8 columns 128 B apart); then each
// block's factor 2^(E + 5), times a MoE down piece's combine weight (k / 128 floats). A tile
// task's K (a piece's too) is a multiple of 512 (tiling.py: _fp8_tiles_fit): whole 4 blocks.
//
// Two passes, because a block's digits need its largest |x| first. The first copies x from L2
// (cp.async: every copy of the task in flight at once, no registers held), each chunk's 64
// bytes where that chunk's digits go (a chunk's digits take as many bytes as its fp32 values),
// and a normed task's norm weight past the factors (passes/residency.py leaves room). The
// second converts the chunks in place: a warp takes STAGE_BLOCKS blocks at a time (those of 4
// consecutive segments at one column offset), 8 lanes a block and a lane a chunk, times the
// norm weight, the block's largest |x| in 3 shuffles. (Loading, reducing and converting a round
// at a time waited for L2 once per round: 7.3 us at qwen3-32b's down, K = 25600, 4 rounds,
// against stage_vector's 2.4; tools/stream_probe.py, docs/performance.md.) A lane reads its
// chunk's 16-byte quarters in a rotated order, so that the 8 lanes of a quarter-warp read 8
// different bank groups (two segments of different parity x 4 quarters); its digit words go
// to the same 8 banks a store (4-way conflicts: rotating the digits too, which spreads them
// over 32, cost registers that made the DeepSeek-V3.2 kernels spill).
#if FFN_SPLIT_K  // its tasks read x as stored (unweighted); a fixed-point input needs converting
#error "split-K FFNs take bf16 weights (passes/fusion.py), never FP8 tiles"
#endif
constexpr int STAGE_BLOCKS = 4;
__device__ void stage_digits(const Params& p, Shared& s, const int* t, int ct) {
  const int k = t[F_K], kp = tile_k(t), S = tile_segments(kp), blocks = k / FP8_BLOCK_COLS;
  const int per_piece = kp / FP8_BLOCK_COLS, kseg = kp / S;
  const int chunks = kp / 16, sbits = S == 8 ? 3 : 2;  // chunk records of a piece; log2 S
  const bool norm = normed(t);
  const TaskInput in = task_input(p, t);
  const float4* __restrict__ gamma = reinterpret_cast<const float4*>(p.act + t[F_AUX]);
  uint8_t* __restrict__ b = reinterpret_cast<uint8_t*>(s.vec);
  float* __restrict__ factor = s.vec + k;
  float4* __restrict__ gamma_s = reinterpret_cast<float4*>(factor + blocks);
  // pass 1: thread ct copies B's 16-byte quarters ct, ct + NT, ... (quarter q of the chunk at
  // 64 (chunk S + j) of its piece: columns 16 chunk + 4 q of segment j), and the norm weight's;
  // from one quarter to the thread's next the chunk moves on by NT / 4 / S in the same segment
  // (a piece's chunks are whole 32s), or past the piece's end into the next piece's
  static_assert(COMPUTE_WARPS * 32 / 4 % 8 == 0, "a thread's quarters keep their segment");
  const int q = ct & 3, j = (ct >> 2) & (S - 1);
  int piece = 0, r = ct >> 2;  // the quarter's chunk record (chunk S + j) within its piece
  for (; r >= chunks; r -= chunks) ++piece;
  for (int f = ct; f < k / 4; f += COMPUTE_WARPS * 32) {
    const int col = piece * kp + j * kseg + (r >> sbits) * 16 + 4 * q;
    cp_async16(b + 16 * f, in.source(col / 4));
    if (norm) cp_async16(gamma_s + f, gamma + f);
    for (r += COMPUTE_WARPS * 32 / 4; r >= chunks; r -= chunks) ++piece;
  }
  // (a MoE down task's combine weight: the piece's factors carry it, one load a block, while
  // the copies are in flight)
  for (int blk = ct; blk < blocks; blk += COMPUTE_WARPS * 32)
    factor[blk] = in.pending_weight(blk * (FP8_BLOCK_COLS / 4));
  cp_async_wait_all();
  compute_sync();
  // pass 2: a piece's blocks taken in the order (column offset, segment), so that a warp's 4
  // blocks of a round lie in 4 consecutive segments; lane bs takes the round's block bs, c is
  // the lane's chunk of it, whose quarter (u + bs / 2 + 2 c) % 4 is the lane's u-th
  const int warp = ct >> 5, lane = ct & 31, bs = lane & 3, c = lane >> 2;
  const auto quarter = [&](int u) { return (u + (bs >> 1) + 2 * c) & 3; };
  float ss = 0.f;
  // the block's piece and place in that order (segment o % S, column offset o / S), moving on
  // as pass 1's chunk records do
  int bpiece = 0, o = STAGE_BLOCKS * warp + bs;
  for (; o >= per_piece; o -= per_piece) ++bpiece;
  for (int first = STAGE_BLOCKS * warp; first < blocks; first += STAGE_BLOCKS * COMPUTE_WARPS) {
    const int jb = o & (S - 1), chunk = (o >> sbits) * 8 + c, col = bpiece * kp + jb * kseg + chunk * 16;
    const struct {
      uint8_t* at;  // the chunk's fp32 values, then its digits
      int blk, i;   // its block; its first 4 columns' index
    } ch{b + bpiece * TILE_DIGITS * kp + (chunk * S + jb) * 16 * TILE_DIGITS, col / FP8_BLOCK_COLS, col / 4};
    for (o += STAGE_BLOCKS * COMPUTE_WARPS; o >= per_piece; o -= per_piece) ++bpiece;
    float4 a[4];
    float m = 0.f;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      a[u] = *reinterpret_cast<const float4*>(ch.at + 16 * quarter(u));
      if (norm) {  // (a task without a norm has no use for the sum of squares)
        ss += a[u].x * a[u].x + a[u].y * a[u].y + a[u].z * a[u].z + a[u].w * a[u].w;
        const float4 g = gamma_s[ch.i + quarter(u)];
        a[u].x *= g.x; a[u].y *= g.y; a[u].z *= g.z; a[u].w *= g.w;
      }
      m = fmaxf(m, fmaxf(fmaxf(fabsf(a[u].x), fabsf(a[u].y)), fmaxf(fabsf(a[u].z), fabsf(a[u].w))));
    }
#pragma unroll
    for (int x = 4; x < 32; x <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, x));
    const int E = block_exponent(m);
    // every read of the chunk came first: its digits overwrite it
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const FixedColumns f = fixed_columns(a[u], E);
#pragma unroll
      for (int n = 0; n < TILE_DIGITS; ++n) {  // digit n: nibble 3 - n, in hi (n even) or lo
        const uint32_t word = prmt(n % 2 ? f.lo01 : f.hi01, n % 2 ? f.lo23 : f.hi23, n & 2 ? 0x6420 : 0x7531);
        *reinterpret_cast<uint32_t*>(ch.at + 16 * n + 4 * quarter(u)) = word | (f.sign & 0x80808080u);
      }
    }
    if (c == 0) factor[ch.blk] *= block_factor(E);
  }
  fence_proxy_async_shared();
  end_staging(s, t, ss, ct);
}

#if READY_DIGITS
// ---- Ready digits (passes/digits.py) ---------------------------------------------------------
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
  const int S = tile_segments(k), kseg = k / S, j = c / kseg, o = c - j * kseg;
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
  const int k = t[F_K], groups = k / DIGIT_GROUP, digits16 = k / 4, S = tile_segments(k), kseg = k / S;
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
#endif

// The loop every row format shares: a segment's 4-column groups [2 begin, 2 end) of N rows of
// one format (a row, or an FP8 gate/up row's two halves), lane l taking groups l, l + 32, ...,
// so that a warp's loads are contiguous (for bf16: 256 B of weights and 512 B of x; a lane
// reading a whole 16-byte piece would read x at a 32-byte stride, twice the shared-memory
// wavefronts). Four groups at a time, loads first, into four independent sums per row, so that
// a page's time on the compute warps (part of its ring slot's time) is short. The N rows share
// each load of x (16 bytes of shared memory per 4 weights: for an FP8 row 4x its weight bytes,
// most of its shared-memory traffic). A row's sums are the ones N = 1 computes, from the same
// groups in the same order, so its result does not depend on N. `Row` says how a group's
// weights are loaded (`load`) and multiplied with 4 inputs (`dot`); y[n] is row n's warp sum.
template <class Row, int N>
__device__ __forceinline__ void dot_groups(const Row (&row)[N], const float* x, int begin, int end, int lane,
                                           float (&y)[N]) {
  static_assert(N == 1 || N == 2, "a row or a pair of rows");
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float acc[4 * N] = {};  // row n's four sums: acc[4 n], ..., acc[4 n + 3]
  int i = 2 * begin + lane;
  const int stop = 2 * end;
  for (; i + 96 < stop; i += 128) {
    typename Row::Group q[N][4];
    float4 a[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
#pragma unroll
      for (int n = 0; n < N; ++n) q[n][u] = row[n].load(i + 32 * u);
      a[u] = x4[i + 32 * u];
    }
#pragma unroll
    for (int j = 0; j < 4 * N; ++j) acc[j] = Row::dot(q[j / 4][j % 4], a[j % 4], acc[j]);
  }
  for (; i < stop; i += 32) {
#pragma unroll
    for (int n = 0; n < N; ++n) acc[4 * n] = Row::dot(row[n].load(i), x4[i], acc[4 * n]);
  }
  const auto sum = [&](int n) { return (acc[4 * n] + acc[4 * n + 1]) + (acc[4 * n + 2] + acc[4 * n + 3]); };
  // spelled out, not a loop over n: that loop around warp_sum's own changed the one-row
  // kernels' machine code elsewhere (nvcc 13 unrolls the kernel's other loops differently)
  y[0] = warp_sum(sum(0));
  if (N == 2) y[N - 1] = warp_sum(sum(N - 1));
}

// dot_groups of one row.
template <class Row>
__device__ __forceinline__ float dot_row(const Row& row, const float* x, int begin, int end, int lane) {
  const Row rows[1] = {row};
  float y[1];
  dot_groups(rows, x, begin, end, lane, y);
  return y[0];
}

// A bf16 row: a group is 4 weights, 8 bytes.
struct Bf16Row {
  using Group = uint2;
  const uint2* w;
  __device__ __forceinline__ Group load(int i) const { return w[i]; }
  __device__ __forceinline__ static float dot(const Group q, const float4 a, float acc) {
    const float2 w0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&q.x));
    const float2 w1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&q.y));
    acc = fmaf(w0.x, a.x, acc); acc = fmaf(w0.y, a.y, acc);
    acc = fmaf(w1.x, a.z, acc); acc = fmaf(w1.y, a.w, acc);
    return acc;
  }
};

// Partial dot product of 16-byte pieces [begin, end) of a bf16 row with the fp32 vector x.
__device__ __forceinline__ float dot_segment(const uint4* w, const float* x, int begin, int end, int lane) {
  return dot_row(Bf16Row{reinterpret_cast<const uint2*>(w)}, x, begin, end, lane);
}

#if MOE && TP > 1
// Expert parallelism: the slots of a routed task that hold an expert of this rank (they come
// first: route_local); a gate/up task's one slot, or a down task's every slot.
__device__ __forceinline__ int busy_slots(const Params& p, const int* t) {
  const int* ids = reinterpret_cast<const int*>(p.act + t[F_IDS]) + t[F_SLOT0];
  int n = 0;
  for (int j = 0; j < t[F_SLOTS]; ++j) n += __ldcg(ids + j) >= 0;
  return n;
}

// dot_segment over [begin, end) without the groups [skip0, skip1) (a down row's pieces that
// were not loaded).
__device__ __forceinline__ float dot_skipping(const uint4* w, const float* x, int begin, int end, int skip0,
                                              int skip1, int lane) {
  float y = 0.f;
  if (begin < min(end, skip0)) y += dot_segment(w, x, begin, min(end, skip0), lane);
  if (max(begin, skip1) < end) y += dot_segment(w, x, max(begin, skip1), end, lane);
  return y;
}
#endif

#if WEIGHT_FP8
// FP8 rows (ir/fp8.py: packed_row_bytes): k e4m3 bytes, then one fp32 scale per FP8_BLOCK_COLS
// columns (the row's block row of weight_scale_inv; a q absorption row's: per fewer columns),
// padded to 16 bytes.
static_assert(FP8_BLOCK_COLS % 4 == 0 && ((FP8_BLOCK_COLS / 4) & (FP8_BLOCK_COLS / 4 - 1)) == 0,
              "a lane's 4 columns must lie in one scale block, found by a shift");
constexpr int log2_exact(int n) { return n > 1 ? 1 + log2_exact(n / 2) : 0; }

// Two e4m3 values (the low byte first) as floats, through f16x2 in one instruction (exact: every
// e4m3 value is an f16 value).
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t pair) {
  return __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), __NV_E4M3)));
}

// An FP8 row of k columns: a group is 4 e4m3 weights (4 bytes) and the scale of their block.
// The pairs convert to f16x2 in one instruction, exactly (every e4m3 value is an f16 value); the
// block scale multiplies the 4-term sum, not each weight. A warp's lanes read at most two block scales.
struct Fp8Row {
  // log2 of the 4-column groups one scale covers: FP8_BLOCK_COLS / 4 (a power of two), or fewer
  // in a row derived from a checkpoint weight (scale_shift)
  static constexpr int BLOCK_SHIFT = log2_exact(FP8_BLOCK_COLS / 4);
  struct Group {
    uint32_t q;
    float scale;
  };
  const uint32_t* w;
  const float* scale;
  int scale_shift;
  // the packed row at `row`: k e4m3 values, then its scales
  __device__ __forceinline__ static Fp8Row at(const uint8_t* row, int k, int scale_shift) {
    return {reinterpret_cast<const uint32_t*>(row), reinterpret_cast<const float*>(row + k), scale_shift};
  }
  __device__ __forceinline__ Group load(int i) const { return {w[i], scale[i >> scale_shift]}; }
  __device__ __forceinline__ static float dot(const Group g, const float4 a, float acc) {
    const float2 w0 = e4m3x2_to_float2(g.q & 0xffffu), w1 = e4m3x2_to_float2(g.q >> 16);
    float d = w0.x * a.x;
    d = fmaf(w0.y, a.y, d);
    d = fmaf(w1.x, a.z, d);
    d = fmaf(w1.y, a.w, d);
    return fmaf(d, g.scale, acc);
  }
};

// dot_segment for an FP8 row of k columns: the same 8-column groups [begin, end). Its scales
// cover FP8_BLOCK_COLS columns each, or 4 << scale_shift (MLA's q absorption, whose rows run
// down kv_b's blocks: ir/mla.py: derived_scale_cols).
__device__ __forceinline__ float dot_segment_fp8(const uint8_t* row, int k, const float* x, int begin, int end,
                                                 int lane, int scale_shift = Fp8Row::BLOCK_SHIFT) {
  return dot_row(Fp8Row::at(row, k, scale_shift), x, begin, end, lane);
}

// dot_segment_fp8 of a gate/up row's two FP8 halves of k columns, the up half `half_bytes` after
// the gate half, in one pass over x: y = {gate, up}, each bit for bit its dot_segment_fp8.
__device__ __forceinline__ void dot_segment_fp8_pair(const uint8_t* row, int half_bytes, int k, const float* x,
                                                     int begin, int end, int lane, int scale_shift, float (&y)[2]) {
  const Fp8Row rows[2] = {Fp8Row::at(row, k, scale_shift), Fp8Row::at(row + half_bytes, k, scale_shift)};
  dot_groups(rows, x, begin, end, lane, y);
}

// An FP8 routed down row (MoE): one piece per slot (a row of that slot's expert: its values, then
// its own scales) of piece_bytes, then shared_k8 > 0: the shared expert's piece (its values and
// scales) with shared_k8 groups of 8 columns; [begin, end) counts groups over the row's k8.
__device__ float dot_segment_fp8_pieces(const uint8_t* row, int slots, int piece_bytes, int k8, int shared_k8,
                                        const float* x, int begin, int end, int lane, int busy = 0) {
  const int pk8 = (k8 - shared_k8) / slots;
  float y = 0.f;
  for (int j = 0; j <= slots; ++j) {  // piece `slots`: the shared expert's (empty without one)
#if TP > 1  // pieces [busy, slots): slots without an expert of this rank, not loaded (busy_slots)
    if (j >= busy && j < slots) continue;
#endif
    const int p0 = j * pk8, p1 = j < slots ? p0 + pk8 : k8;
    const int lo = max(begin, p0), hi = min(end, p1);
    if (lo < hi) y += dot_segment_fp8(row + j * piece_bytes, 8 * (p1 - p0), x + 8 * p0, lo - p0, hi - p0, lane);
  }
  return y;
}

// A whole FP8 row of at most SHORT_ROW_GROUPS 4-column groups (MLA's q absorption: k = 128 in
// DeepSeek-V3, 192 in GLM-5, where head_rows_mma measured slower; a small model's projection) is
// all latency in dot_groups: a group or two a lane, then a warp sum. A warp takes
// SHORT_ROWS_PER_WARP of them at once instead, SHORT_ROW_LANES lanes a row (lane l of the row:
// groups l, l + SHORT_ROW_LANES, ..., in two sums), and sums over its row's lanes only; every lane
// gets its row's sum. A round of 4 groups is loaded before any is multiplied: a guard around each
// group's loads and sum made each group's loads wait for the previous group's sum (a q absorption
// page of 462 rows: ~3.4 us).
constexpr int SHORT_ROW_LANES = 8, SHORT_ROWS_PER_WARP = 32 / SHORT_ROW_LANES;
constexpr int SHORT_ROW_GROUPS = 8 * SHORT_ROW_LANES;  // 8 groups a lane at most: k <= 256
constexpr int SHORT_ROUND = 4;  // groups a lane loads at once (8: spills at 96 registers)
__device__ __forceinline__ float dot_short_row(const Fp8Row& row, const float* x, int groups, int sl) {
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float acc[2] = {0.f, 0.f};
#pragma unroll 1  // unrolled, the rounds spilled registers
  for (int u = 0; u < SHORT_ROW_GROUPS / SHORT_ROW_LANES; u += SHORT_ROUND) {
    if (u * SHORT_ROW_LANES >= groups) break;  // warp-uniform
    Fp8Row::Group q[SHORT_ROUND] = {};  // a group past the row: 0 x 0, which leaves the sum as it is
    float4 a[SHORT_ROUND] = {};
#pragma unroll
    for (int j = 0; j < SHORT_ROUND; ++j) {
      const int g = sl + (u + j) * SHORT_ROW_LANES;
      if (g < groups) {
        q[j] = row.load(g);
        a[j] = x4[g];
      }
    }
#pragma unroll
    for (int j = 0; j < SHORT_ROUND; ++j) acc[j & 1] = Fp8Row::dot(q[j], a[j], acc[j & 1]);  // u is even: group u + j's sum
  }
  float y = acc[0] + acc[1];
#pragma unroll
  for (int o = SHORT_ROW_LANES / 2; o > 0; o >>= 1) y += __shfl_xor_sync(0xffffffffu, y, o);
  return y;
}
#endif


// Every lane of the page's warp group arrives on the slot's `empty` barrier once it has read the
// page, each for its own reads: compute-sanitizer's racecheck does not take a __syncwarp and
// one lane's arrival as ordering the other lanes' reads before the loader's next bulk copy
// into the slot (it reported hazards), and the 32 arrivals measured no slower (llama-3.2-1b).
__device__ __forceinline__ void release_page(Shared& s, int slot) { mbar_arrive(&s.empty[slot]); }

// Pages are dealt round-robin to PAGE_GROUPS groups of warps, so that the latency of one page
// (wait, loads, reductions, release) overlaps with the others' instead of adding up.
constexpr int GROUP_WARPS = COMPUTE_WARPS / PAGE_GROUPS;

__device__ __forceinline__ int warps_per_row(int rows_in_page) {
  int wpr = 1;
  while (wpr * 2 * rows_in_page <= GROUP_WARPS) wpr *= 2;
  return wpr;
}

// Reduces every compute thread's (value, row) pair to the CTA's best, in thread 0: over lanes,
// then over warps; ties go to the lower row.
__device__ void cta_best(Shared& s, float& best, int& best_row, int ct) {
  const int warp = ct >> 5, lane = ct & 31;
  warp_best(best, best_row);
  if (lane == 0) {  // after rstd was read: every thread read it before the loop above
    s.red[2 * COMPUTE_WARPS + 2 + 2 * warp] = best;
    s.red[2 * COMPUTE_WARPS + 3 + 2 * warp] = __int_as_float(best_row);
  }
  compute_sync();
  if (ct == 0) {
    for (int w = 1; w < COMPUTE_WARPS; ++w)
      keep_best(s.red[2 * COMPUTE_WARPS + 2 + 2 * w], __float_as_int(s.red[2 * COMPUTE_WARPS + 3 + 2 * w]), best,
                best_row);
  }
}

// The task's (max, row) pair for the sampler, written to argmax_partials.
__device__ void write_best(const Params& p, Shared& s, const int* t, float best, int best_row, int ct) {
  cta_best(s, best, best_row, ct);
  if (ct == 0) {
    __stcg(p.act + t[F_AUX2], best);
    __stcg(p.act + t[F_AUX2] + 1, __int_as_float(best_row));
  }
}

// A task's pages of `rows` rows (`per_page` a page) that are this page group's (the loader deals
// a task's pages to the groups in turn), each waited for, read by `body(page, r, n)` (its first
// row r of n) and released; `consumed` counts the task's pages, every group's. With
// BODY_RELEASES the body is `body(page, r, n, slot)` and releases the slot itself, each thread
// once, after its last read of the page, so that the loader refills it while the thread still
// works on what it read.
template <bool BODY_RELEASES = false, class Rows, class Body>
__device__ __forceinline__ void for_each_page(const Params& p, Shared& s, Rows rows, Rows per_page, int group,
                                              uint32_t& consumed, Body body) {
  uint32_t page_index = consumed;
  for (Rows r = 0; r < rows; r += per_page, ++page_index) {
    if (page_index % PAGE_GROUPS != static_cast<uint32_t>(group)) continue;
    const int slot = page_index % RING_PAGES;
    ring_wait(p, &s.full[slot], (page_index / RING_PAGES) & 1, nullptr);
    if constexpr (BODY_RELEASES) {
      body(s.ring + slot * PAGE_BYTES, r, min(per_page, rows - r), slot);
    } else {
      body(s.ring + slot * PAGE_BYTES, r, min(per_page, rows - r));
      release_page(s, slot);
    }
  }
  consumed = page_index;
}

#if FP8_MMA
// A tile task's row sums, warpgroup k's own (tile_pages): s.acc for the first, and for the
// others the end of the input vector's space, past the task's staged input (passes/residency.py
// sizes it so); `n`: the task's rows x halves. A warpgroup's stage: a flush's row sums of its 4
// warps, TILE_STAGE_ROWS each (a tile's rows of a warp: 8, or 16 for S = 4), two of them used in
// turn, at the end of s.red (no reduction in a tile task's page loop uses that part).
constexpr int TILE_WARPGROUPS = COMPUTE_WARPS / 4, TILE_STAGE_ROWS = 16;
static_assert(4 * COMPUTE_WARPS + 2 + TILE_WARPGROUPS * 2 * 4 * TILE_STAGE_ROWS <= MISC_FLOATS,
              "the warpgroups' stages overlap the matrix-vector reductions' slots in s.red");
__device__ __forceinline__ float* tile_sums(const Shared& s, int n, int k) {
  return k == 0 ? s.acc : s.vec + MAX_K - (TILE_WARPGROUPS - k) * n;
}
__device__ __forceinline__ float* tile_stage(const Shared& s, int wgi, int parity) {
  return s.red + MISC_FLOATS - (2 * wgi + parity + 1) * 4 * TILE_STAGE_ROWS;
}
// matvec_pages of an FP8 tile task of S segments (the input staged by stage_digits): a page
// holds whole units. The warpgroups of the page group take the page's units in turn, a unit's
// 128-column blocks (one or two) one after the other, each 4 wgmma k32 steps into D. Then a
// thread folds those of its D values that lie in its rows' own segment (S = 8: row g, segment
// 2 w + q / 2, its 2 values of digits 2 (q % 2) and + 1; S = 4: rows g and g + 8, segment w, 4
// values in lanes with q / 2 = w % 2, none in the others) times the block's weight scale and x's
// digit factors into its sums y of the tile. When its next unit is another tile's, and at the end
// of the page, the warpgroup flushes: the 4 lanes of a row add up theirs, each warp leaves its
// row sums in the warpgroup's stage (tile_stage), and after the warpgroup's barrier warp 0 adds
// the four in warp order to the warpgroup's own sums (tile_sums), which the task adds up in
// warpgroup order at its end. So every row's sum is added in one order, the same bits every run;
// float atomicAdd on shared memory (a compare-and-swap loop, 4 warps on the same rows) made no
// order and cost ~9 us a layer of qwen3-32b (docs/performance.md, session 28). Whole units
// rather than (unit, block) items in turn: a warp flushes half as often and walks half the
// items, and a page's compute fell from 2.2 to 1.5 us (H200, llama-3.1-8b gate/up pages of 4
// units, docs/performance.md), under the ~1.7 us its bytes take to arrive.
// A MoE down task's units come piece by piece (copy_pieces), each piece over its own digits;
// finding a unit's piece costs divisions, which only such a task pays (in every unit of every
// tile task they had made a page ~0.4 us longer).
static_assert(GROUP_WARPS % 4 == 0, "a page group is whole warpgroups");
// The sums of a thread's D values d[4 U] .. d[4 U + 3] that lie in its rows' own segment (see
// tile_pages), digit factors f0 (even v) and f1 (odd v) applied.
template <int S, int U, int ND, int ROWS>
__device__ __forceinline__ void fold_segment(const float (&d)[ND], float (&sum)[ROWS], int q, int w, float f0,
                                             float f1) {
  if constexpr (S == 8) {
    const float e0 = d[4 * U], e1 = d[4 * U + 1], e2 = d[4 * U + 2], e3 = d[4 * U + 3];
    sum[0] = (q & 2 ? e2 : e0) * f0 + (q & 2 ? e3 : e1) * f1;
  } else if constexpr (U < 2) {  // S = 4: U = w / 2
    if ((q >> 1) == (w & 1)) {
      sum[0] = d[4 * U] * f0 + d[4 * U + 1] * f1;
      sum[1] = d[4 * U + 2] * f0 + d[4 * U + 3] * f1;
    }
  }
}
template <int S>
__device__ void tile_pages(const Params& p, Shared& s, const int* t, int task_units, int rb, int rpp, int halves,
                           uint32_t& consumed, int lane, int group, int gw) {
  constexpr int N = TILE_DIGITS * S, R = TILE_M / S, ROWS = S == 8 ? 1 : 2, CHUNK = 16 * N;  // CHUNK: B's 16 columns
  const int kp = tile_k(t), pieces = tile_pieces(t), C = unit_cols(t), kseg = kp / S, per_tile = kseg / C;
  const int blocks = C / FP8_BLOCK_COLS, per_segment = kseg / FP8_BLOCK_COLS, per_piece = kp / FP8_BLOCK_COLS;
  const int units = pieces > 1 ? piece_units(t) : 0;  // a piece's units of the task
  const int wg = gw / 4, w = gw % 4, g = lane >> 2, q = lane & 3, j = S == 8 ? 2 * w + q / 2 : w;
  const float f0 = q & 1 ? 0x1p-8f : 1.f, f1 = f0 * 0x1p-4f;  // 2^(-4 t) of digits 2 (q % 2), + 1
  const uint8_t* xb = reinterpret_cast<const uint8_t*>(s.vec);
  const float* factor = s.vec + t[F_K];
  const int sums_n = (t[F_ROW1] - t[F_ROW0]) * halves, wgi = (group * GROUP_WARPS + gw) / 4;
  float* sums = tile_sums(s, sums_n, wgi);
  int parity = 0;
  const auto flush = [&](int tile, float (&y)[ROWS]) {  // warpgroup-uniform
    float* stage = tile_stage(s, wgi, parity);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      y[r] += __shfl_xor_sync(0xffffffffu, y[r], 1);
      y[r] += __shfl_xor_sync(0xffffffffu, y[r], 2);
      if (q == 0) stage[w * TILE_STAGE_ROWS + g + 8 * r] = y[r];
      y[r] = 0.f;
    }
    warpgroup_sync(wgi);
    // warp 0 reads this stage before it reaches the next flush's barrier, which every warp
    // passes before it writes this stage again (two flushes on)
    if (w == 0 && q == 0)
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const int at = g + 8 * r;
        sums[(tile / halves * R + at) * halves + tile % halves] +=
            ((stage[at] + stage[TILE_STAGE_ROWS + at]) + stage[2 * TILE_STAGE_ROWS + at]) + stage[3 * TILE_STAGE_ROWS + at];
      }
    parity ^= 1;
  };
  // The page is released once the warpgroup's last wgmma on it is done and its last scale read,
  // before that unit's fold and the flushes, which read only registers and s.vec: with 2 ring
  // pages, a page's slot is otherwise not refilled while it is computed.
  for_each_page<true>(p, s, task_units, rpp, group, consumed, [&](const uint8_t* page, int u0, int n, int slot) {
    float y[ROWS] = {};
    int tile = -1;
    // a warpgroup takes a run of the page's units, so that a tile's units (3 of 8 on a page of
    // K = 1536 tiles) mostly go to one warpgroup: fewer flushes, and fewer warpgroups adding
    // to the same rows at once
    constexpr int WG = GROUP_WARPS / 4;
    const int run = (n + WG - 1) / WG, last = min(n, (wg + 1) * run) - 1;  // the warpgroup's last unit
    if (last < wg * run) release_page(s, slot);  // no unit of the page
    for (int i = wg * run; i <= last; ++i) {
      int piece = 0, pu = u0 + i;  // pu: the unit's index among its piece's
      if (pieces > 1) {
        piece = pu / units;
        pu %= units;
      }
      const int unit_tile = pu / per_tile, part = pu % per_tile;
      if (unit_tile != tile) {
        if (tile >= 0) flush(tile, y);
        tile = unit_tile;
      }
      const uint8_t* xp = xb + piece * TILE_DIGITS * kp;  // the piece's digits (stage_digits)
      const uint8_t* unit = page + i * rb;  // columns [part C, part C + C) of every segment
      const float* scale = reinterpret_cast<const float*>(unit + TILE_M * C);
      for (int b = 0; b < blocks; ++b) {
        float d[N / 2];
        wgmma_fence();
#pragma unroll
        for (int k32 = 0; k32 < 4; ++k32) {
          const int step = 4 * b + k32;
          Wgmma<N>::mma(d, smem_desc(unit + step * 2048, 1024, 128),
                        smem_desc(xp + (part * C / 32 + step) * 2 * CHUNK, CHUNK, 128), k32);
        }
        wgmma_commit();
        wgmma_wait_all();
        const float f = scale[j * blocks + b] * factor[piece * per_piece + j * per_segment + part * blocks + b];
        if (i == last && b == blocks - 1) release_page(s, slot);
        // d[v]: row 16 w + g + 8 (v % 4 / 2), column 8 (v / 4) + 2 q + v % 2, in the row's own
        // segment where column / 4 = row / R: S = 8, v = 4 w + (q & 2) and the next; S = 4, v =
        // 4 (w / 2) .. + 3 where q / 2 = w % 2. A switch on the warp's part names them with
        // constant indices (one that varies, even by warp, would put d in local memory).
        float sum[ROWS] = {};
        switch (S == 8 ? w : w / 2) {
          case 0: fold_segment<S, 0, N / 2, ROWS>(d, sum, q, w, f0, f1); break;
          case 1: fold_segment<S, 1, N / 2, ROWS>(d, sum, q, w, f0, f1); break;
          case 2: fold_segment<S, 2, N / 2, ROWS>(d, sum, q, w, f0, f1); break;
          default: fold_segment<S, 3, N / 2, ROWS>(d, sum, q, w, f0, f1); break;
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) y[r] = fmaf(f, sum[r], y[r]);
      }
    }
    if (tile >= 0) flush(tile, y);
  });
}

// A tile task's input staged (ready digits copied in, or converted: stage_digits) and its pages
// run; then the warpgroups' sums added up in warpgroup order (tile_pages).
__device__ __forceinline__ void tile_task(const Params& p, Shared& s, const int* t, uint32_t& consumed, int ct) {
  const int units = stream_rows(t), rb = t[F_ROW_BYTES], rpp = rows_per_page(t), halves = row_halves(t);
  const int lane = ct & 31, warp = ct >> 5, group = warp / GROUP_WARPS, gw = warp % GROUP_WARPS;
#if READY_DIGITS
  if (t[F_DIGITS_IN] >= 0)
    stage_ready_digits(p, s, t, ct);
  else
#endif
    stage_digits(p, s, t, ct);
  if (tile_segments(tile_k(t)) == 8)
    tile_pages<8>(p, s, t, units, rb, rpp, halves, consumed, lane, group, gw);
  else
    tile_pages<4>(p, s, t, units, rb, rpp, halves, consumed, lane, group, gw);
  compute_sync();  // every warpgroup's sums are in
  const int sums_n = (t[F_ROW1] - t[F_ROW0]) * halves;
  for (int i = ct; i < sums_n; i += COMPUTE_WARPS * 32) {
    float v = s.acc[i];
    for (int k = 1; k < TILE_WARPGROUPS; ++k) v += tile_sums(s, sums_n, k)[i];
    s.acc[i] = v;
  }
}
#endif

#if MLA && WEIGHT_FP8
// A head_matvec's FP8 rows longer than short rows (MLA's v expansion: each head's rows read its own
// x) on the tensor cores, where its scales cover whole k-steps: on the CUDA cores a v expansion
// page (124 rows of k = 512) took 4.7 µs of latency-bound dot products and warp sums, here 3.7
// (H200, docs/performance.md, session 35). Short rows (the q absorption's, k = 128 or 192) stay
// with dot_short_row: a page of 462 took 3.4 µs here against 2.7. The task's heads' x are first
// split into three bf16 parts (hi, mid, lo: x's 24 significand bits, so that the products are
// fp32's as on the CUDA cores), kept after the inputs as [head][part][k] with a zero fourth part. A
// warp then takes an m-tile of 16 rows (with few m-tiles, half of its k-steps, the halves added in
// s.acc): A the rows' e4m3 values as bf16 (exact), B of 8 columns the tile's x parts, its first
// row's head in columns 0, 2, 4 and the head after it in 1, 3, 5 where the tile runs into it (a
// page spans at most two heads: its rows are fewer than a head's), zero in 6, 7; each row takes its
// own head's columns. A scale block's k-steps go into D, which is then scaled and added up per row.
__device__ __forceinline__ bool head_rows_on_mma(const int* t, int k8, int scale_shift) {
  return t[F_OPCODE] == OP_HEAD_MATVEC && 2 * k8 > SHORT_ROW_GROUPS && (4 << scale_shift) % 16 == 0 &&
         (8 * k8) % 16 == 0;
}
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint16_t v) {
  const float2 f = e4m3x2_to_float2(v);
  const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
  return *reinterpret_cast<const uint32_t*>(&b);
}
__device__ void head_rows_mma(const Params& p, Shared& s, const int* t, int rows, int rb, int rpp, int k8,
                              int scale_shift, uint32_t& consumed, int lane, int group, int gw) {
  const HeadInputs head_input = head_inputs(t);
  const int k = 8 * k8, block = 4 << scale_shift, g = lane >> 2, q = lane & 3;
  const int heads = (t[F_ROW1] - 1) / t[F_HEAD_ROWS] + 1 - t[F_ROW0] / t[F_HEAD_ROWS];
  __nv_bfloat16* parts = reinterpret_cast<__nv_bfloat16*>(s.vec + heads * k);  // [heads][4][k]
  for (int i = (group * GROUP_WARPS + gw) * 32 + lane; i < heads * k; i += NT) {
    __nv_bfloat16* out = parts + i / k * 4 * k + i % k;
    float v = s.vec[i];  // the heads' inputs lie k apart
    for (int part = 0; part < 3; ++part) {
      out[part * k] = __float2bfloat16(v);
      v -= __bfloat162float(out[part * k]);
    }
    out[3 * k] = __float2bfloat16(0.f);
  }
  compute_sync();
  for_each_page(p, s, rows, rpp, group, consumed, [&](const uint8_t* page, int r, int n) {
    const int tiles = (n + 15) / 16, split = 2 * tiles <= GROUP_WARPS && k % (2 * block) == 0 ? 2 : 1;
    for (int item = gw; item < tiles * split; item += GROUP_WARPS) {
      const int m0 = 16 * (item / split), kb0 = item % split * (k / split);
      const int i0 = min(m0 + g, n - 1), i1 = min(m0 + g + 8, n - 1);  // past the page: repeats, unstored
      const uint8_t* w0 = page + i0 * rb;
      const uint8_t* w1 = page + i1 * rb;
      const int first = head_input(r + m0), next = head_input(r + min(m0 + 15, n - 1));
      const __nv_bfloat16* x = parts + ((g & 1 ? next : first) / k * 4 + min(g >> 1, 3)) * k + 2 * q;
      float y[4] = {0.f, 0.f, 0.f, 0.f};
      for (int kb = kb0; kb < kb0 + k / split; kb += block) {
        float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
        for (int k0 = kb; k0 < min(kb + block, k); k0 += 16) {  // a block may be wider than the row
          const int c = k0 + 2 * q;
          const uint32_t a[4] = {e4m3x2_to_bf16x2(*reinterpret_cast<const uint16_t*>(w0 + c)),
                                 e4m3x2_to_bf16x2(*reinterpret_cast<const uint16_t*>(w1 + c)),
                                 e4m3x2_to_bf16x2(*reinterpret_cast<const uint16_t*>(w0 + c + 8)),
                                 e4m3x2_to_bf16x2(*reinterpret_cast<const uint16_t*>(w1 + c + 8))};
          mma_bf16_16816(d, a, *reinterpret_cast<const uint32_t*>(x + k0),
                         *reinterpret_cast<const uint32_t*>(x + k0 + 8));
        }
        const float s0 = reinterpret_cast<const float*>(w0 + k)[kb / block];
        const float s1 = reinterpret_cast<const float*>(w1 + k)[kb / block];
        y[0] = fmaf(d[0], s0, y[0]);
        y[1] = fmaf(d[1], s0, y[1]);
        y[2] = fmaf(d[2], s1, y[2]);
        y[3] = fmaf(d[3], s1, y[3]);
      }
      // lanes q = 0, 1, 2 hold columns 0, 1 (hi), 2, 3 (mid), 4, 5 (lo) of rows g and g + 8, q = 3
      // the zero columns 6, 7: (hi + mid) + lo in lane q = 0
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        y[j] += __shfl_xor_sync(0xffffffffu, y[j], 1);
        y[j] += __shfl_xor_sync(0xffffffffu, y[j], 2);
      }
      for (int h = 0; h < 2; ++h) {  // rows g and g + 8; two halves add up alike in either order
        const int i = m0 + g + 8 * h;
        const float v = head_input(r + i) == first ? y[2 * h] : y[2 * h + 1];
        if (q != 0 || i >= n) continue;
        if (split == 1) s.acc[r + i] = v;
        else atomicAdd(&s.acc[r + i], v);
      }
    }
  });
}
#endif

// The row sums of a matrix-vector task's `rows` rows (`halves` sums per row: gate/up pairs) from
// its weight pages, into s.acc; the input vector is staged. Consumes the task's pages. The
// caller derives the thread's lane, page group and warp in the group first thing in the task (in
// run_matvec that order gives the machine code it had before this loop was its own function).
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
    head_rows_mma(p, s, t, rows, rb, rpp, k8, scale_shift, consumed, lane, group, gw);
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
  // share; one at a time, a MLA q absorption row (k = 128) took ~0.4 µs of a warp's time.
#if MOE
  const bool whole_rows = fp8 && halves == 1 && !down;
#else
  const bool whole_rows = fp8 && halves == 1;
#endif
  const bool short_rows = whole_rows && wpr == 1 && 2 * k8 <= SHORT_ROW_GROUPS;
#endif
  for_each_page(p, s, rows, rpp, group, consumed, [&](const uint8_t* page, int r, int n) {
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

__device__ void run_matvec(const Params& p, Shared& s, const int* t, uint32_t& consumed, int ct) {
#if MOE && TP > 1  // a gate/up task whose slot holds no expert of this rank: no pages, no output
  if (t[F_OPCODE] == OP_MOE_GATE_UP && busy_slots(p, t) == 0) return;
#endif
  const int warp = ct >> 5, lane = ct & 31, group = warp / GROUP_WARPS, gw = warp % GROUP_WARPS;
  const int row0 = t[F_ROW0], rows = t[F_ROW1] - row0, rb = t[F_ROW_BYTES], rpp = rows_per_page(t);
  const int k8 = t[F_K] / 8, epi = t[F_EPILOGUE], halves = row_halves(t);
  for (int i = ct; i < rows * halves; i += COMPUTE_WARPS * 32) s.acc[i] = 0.f;
#if FP8_MMA  // and the other warpgroups' sums of a tile task (tile_pages)
  if (t[F_W_FORMAT] == WF_FP8_TILES)
    for (int i = ct; i < (TILE_WARPGROUPS - 1) * rows * halves; i += COMPUTE_WARPS * 32)
      tile_sums(s, rows * halves, 1)[i] = 0.f;
#endif
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
  // staging ends with a barrier, which also covers the zeroing above
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

// ---- compute: embedding and sampling -------------------------------------------------------
__device__ bool run_embed(const Params& p, const int* t, long long step, int ct) {
  const long long token = step == 0 ? p.first_token : __ldcg(p.tokens + step - 1);
  if (token < 0 || token >= VOCAB) {
    if (ct == 0) atomicCAS(&p.status[ST_ERROR], ERR_NONE, ERR_BAD_TOKEN);
    return false;
  }
  const __nv_bfloat16* row = p.embed + token * HIDDEN;
  for (int i = ct; i < HIDDEN; i += COMPUTE_WARPS * 32) __stcg(p.act + t[F_OUT] + i, __bfloat162float(row[i]));
  return true;
}

// Publish the step's token to the device and to the host-mapped ring, and decide whether the
// run goes on.
__device__ void publish_token(const Params& p, long long step, int tok) {
  p.tokens[step] = tok;
  volatile int* ring = p.host_tokens;
  ring[step] = tok;
  __threadfence_system();
  *reinterpret_cast<volatile int*>(p.host_count) = static_cast<int>(step + 1);
#if TP > 1  // the ranks' stop flags as the sampler's exchange agreed on them (run_argmax_ranks)
  const bool stop = tok == p.eos_token || p.act[TP_STOP_AT] != 0.f || step + 1 == p.n_steps;
#else
  const bool stop = tok == p.eos_token || *reinterpret_cast<volatile int*>(p.host_stop) != 0 ||
                    step + 1 == p.n_steps;
#endif
  if (stop) p.status[ST_STOP] = static_cast<int>(step + 1);
}

// The best of the lm_head tasks' (max, row) pairs (F_COUNT of them at F_IN), in thread 0: every
// thread loads pairs at once (one round trip to L2, not one per task), then the CTA reduces.
__device__ __forceinline__ void best_of_tasks(const Params& p, Shared& s, const int* t, int ct, float& best,
                                              int& tok) {
  const float* part = p.act + t[F_IN];
  best = -INFINITY;
  tok = 0x7fffffff;
  for (int i = ct; i < t[F_COUNT]; i += COMPUTE_WARPS * 32)
    keep_best(__ldcg(part + 2 * i), __float_as_int(__ldcg(part + 2 * i + 1)), best, tok);
  cta_best(s, best, tok, ct);
}

// The sampler: greedy and temperature-only reduce the lm_head tasks' (max, row) pairs (of
// logits or of Gumbel-max scores) in thread 0; top-k / top-p merge the tasks' candidates.
__device__ void run_argmax(const Params& p, Shared& s, const int* t, long long step, long long pos, int ct) {
  if (sample_mode(s) == SAMPLE_FILTERED) {
    const int tok = sample_filtered(p, sampling(p), s, t, pos, ct);
    if (ct == 0) publish_token(p, step, tok);
    return;
  }
  float best;
  int tok;
  best_of_tasks(p, s, t, ct, best, tok);
  if (ct == 0) publish_token(p, step, tok);
}

#if TP > 1
// The greedy sampler over ranks: this rank's best (logit, row) pair of its vocabulary rows (row
// made global) and its reading of the host's stop flag go to every rank; every rank then takes
// the best of the TP pairs in rank order (ties to the lower row, as over the whole vocabulary)
// and stops if any rank saw the flag, so all ranks emit the same token and stop together.
__device__ void argmax_publish(const Params& p, Shared& s, const int* t, int ct) {
  float best;
  int tok;
  best_of_tasks(p, s, t, ct, best, tok);
  if (ct == 0) {
    const int row = tok == 0x7fffffff ? tok : tok + static_cast<int>(p.rank) * TP_VOCAB_ROWS;
    const float stop = *reinterpret_cast<volatile int*>(p.host_stop) != 0;
    const long long at = t[F_XCHG_BUF] + p.rank * t[F_XCHG_STRIDE];
    for (int r = 0; r < TP; ++r) {
      __stcg(p.peers->act[r] + at, best);
      __stcg(p.peers->act[r] + at + 1, __int_as_float(row));
      __stcg(p.peers->act[r] + at + 2, stop);
    }
  }
}
__device__ void argmax_agree(const Params& p, const int* t, long long step, int ct) {
  if (ct == 0) {
    const float* slot = p.act + t[F_XCHG_BUF];
    float stop = 0.f, best = -INFINITY;
    int tok = 0x7fffffff;
    for (int r = 0; r < TP; ++r) {
      keep_best(__ldcg(slot + r * t[F_XCHG_STRIDE]), __float_as_int(__ldcg(slot + r * t[F_XCHG_STRIDE] + 1)), best, tok);
      stop = fmaxf(stop, __ldcg(slot + r * t[F_XCHG_STRIDE] + 2));
    }
    p.act[TP_STOP_AT] = stop;
    publish_token(p, step, tok);
  }
}
__device__ bool run_argmax_ranks(const Params& p, Shared& s, const int* t, long long step, int task, int ct) {
  argmax_publish(p, s, t, ct);
  exchange_arrive(p, t);
  if (!exchange_await(p, s, t, step, task)) return false;
  argmax_agree(p, t, step, ct);
  return true;
}
#endif

#if MOE
// ---- compute: the MoE router (ir/moe.py: route) ---------------------------------------------
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

#if MLA
// ---- compute: absorbed MLA attention (ir/mla.py) -------------------------------------------
// The latent cache holds one row per position, shared by every head: the normed latent
// (MLA_RANK) and the rotated key rope part (MLA_ROPE), bf16. A head's score against row j is
// q_latent[h] · latent[j] + q_pe[h] · k_pe[j], i.e. the dot product of the row with the head's
// query [q_latent | rotated q_pe]; its output is Σ_j p[h, j] latent[j] (the value up-projection
// is the head_matvec that follows).
constexpr int MLA_W = MLA_RANK + MLA_ROPE;                     // values of a cache row
constexpr int MLA_PIECES = MLA_W / 8;                          // its 16-byte pieces
// The tensor-core tiling of mla_chunk (passes/residency.py: mla_staged_floats sizes it alike):
constexpr int MLA_M = 16;                                      // heads of a task: the rows of an mma tile
constexpr int MLA_KSTEPS = (MLA_W + 15) / 16;                  // k-steps of a score, the last zero-padded
constexpr int MLA_ROW = (MLA_W + 63) / 64 * 64 + 8;            // bf16 a staged row (or query) takes
constexpr int MLA_PROW = MLA_KEYS + 8;                         // bf16 a head's probabilities take
constexpr int MLA_KSPLIT = 4;                                  // warps sharing a score tile's k-steps
constexpr int MLA_OT = (MLA_RANK / 8 + COMPUTE_WARPS - 1) / COMPUTE_WARPS;  // output tiles per warp
// MlaStage's parts, floats into s.vec
constexpr int MLA_ROWS_AT = MLA_M * MLA_ROW, MLA_PART_AT = MLA_ROWS_AT + MLA_KEYS * MLA_ROW / 2;
constexpr int MLA_PROB_AT = MLA_PART_AT + MLA_KSPLIT * MLA_M * MLA_KEYS, MLA_ST_AT = MLA_PROB_AT + MLA_M * MLA_PROW;
constexpr int MLA_CS_AT = MLA_ST_AT + 3 * MLA_HEADS, MLA_STAGED = MLA_CS_AT + MLA_ROPE;
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
  // [MLA_KEYS][MLA_ROW]: a block's cache rows, zero past its keys and MLA_W
  __device__ __forceinline__ __nv_bfloat16* rows() const { return reinterpret_cast<__nv_bfloat16*>(vec + MLA_ROWS_AT); }
  // [MLA_KSPLIT][MLA_M][MLA_KEYS]: the block's scores, summed over each split's k-steps
  __device__ __forceinline__ float* part() const { return vec + MLA_PART_AT; }
  // [2][MLA_M][MLA_PROW]: the block's probabilities, bf16 hi | lo
  __device__ __forceinline__ __nv_bfloat16* prob() const { return reinterpret_cast<__nv_bfloat16*>(vec + MLA_PROB_AT); }
  // [3][MLA_HEADS]: max | sum | rescale of the old sums, per head
  __device__ __forceinline__ float* st() const { return vec + MLA_ST_AT; }
  __device__ __forceinline__ float* cs() const { return vec + MLA_CS_AT; }         // [MLA_ROPE]: cos | sin at pos
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
// q's rope part (F_AUX) rotated at pos (cs), as bf16 hi | lo; heads past MLA_HEADS and dims past
// MLA_W (the last k-step's padding) are zero. A thread loads all of its share first (q_latent
// four dims a load), then converts and stores it: item by item, a DeepSeek-V3.2 task's staging
// took 2.50 us, now 2.32 (H200). Its time is not the loads' round trips: with the cos | sin
// loaded beside them too it took 3.4 (docs/performance.md, session 36).
constexpr int MLA_Q_LAT_ITEMS = (MLA_M * MLA_RANK / 4 + NT - 1) / NT;  // a thread's 4-dim pieces
constexpr int MLA_Q_TAIL = 16 * MLA_KSTEPS - MLA_RANK;                 // a staged query's dims past its latent
constexpr int MLA_Q_TAIL_ITEMS = (MLA_M * MLA_Q_TAIL + NT - 1) / NT;   // a thread's rope (or padding) dims
__device__ void mla_stage_queries(const Params& p, const int* t, const MlaStage& m, int g, int ct) {
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
      const float2 rot = rope_rotate(pe[j].x * scale, pe[j].y * scale, m.cs(), pair);
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
// mla_block_row is the cache row of a thread's key (-1 past k1); with DSA it is read from the
// indexer's list (F_AUX2), a round trip to L2 that the caller starts a block ahead.
static_assert(NT % MLA_KEYS == 0, "whole threads per staged row");
constexpr int MLA_ROW_THREADS = NT / MLA_KEYS;
__device__ __forceinline__ long long mla_block_row(const Params& p, const int* t, long long b0, long long k1, int ct) {
  const long long key = b0 + ct / MLA_ROW_THREADS;
  if (key >= k1) return -1;
#if DSA  // the chunk's rows are the cache rows of the tokens the indexer selected
  return __ldcg(reinterpret_cast<const int*>(p.act + t[F_AUX2]) + key);
#else
  return key;
#endif
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

// S = Q K^T of the staged block: a warp's item is an n-tile of 8 keys (B = the keys' rows, a key's
// consecutive dims being B's k) over one of MLA_KSPLIT ranges of the k-steps, Q hi and Q lo each
// an mma per k-step; the ranges' sums go to `part` (the softmax adds them in a fixed order).
__device__ __forceinline__ void mla_scores(const MlaStage& m, int warp, int lane) {
  for (int item = warp; item < MLA_KEYS / 8 * MLA_KSPLIT; item += COMPUTE_WARPS) {
    const int n0 = item % (MLA_KEYS / 8) * 8, split = item / (MLA_KEYS / 8);
    const __nv_bfloat16* key = m.rows() + (n0 + (lane >> 2)) * MLA_ROW + 2 * (lane & 3);
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

// O = O corr + P V of the staged block: warp w owns the 8-column output tiles w, w + COMPUTE_WARPS,
// ... of every head (o[i]: rows g and g + 8, columns 2q, 2q + 1 of its tile i); A = P hi, then P lo,
// over the block's two k-steps of 16 keys; B (k = key, n = latent dim) pairs the 16-bit values of
// two consecutive keys' rows in a column.
__device__ __forceinline__ void mla_values(const MlaStage& m, float (&o)[MLA_OT][4], int warp, int lane) {
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
  const uint16_t* v = reinterpret_cast<const uint16_t*>(m.rows()) + 2 * q * MLA_ROW + g;
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
// to shared memory (mla_load_block; the first block's copies issued by the caller, before it
// stages the queries, and each next block's row ids read while this one is computed); the warps
// score the block (mla_scores), a warp per head moves its online softmax (mla_softmax), and
// the warps add the probability-weighted rows to the heads' sums, which stay in registers
// (mla_values). The queries and probabilities are split into bf16 hi + lo, so scores and sums
// keep ~16 significand bits of the fp32 reference's 24; the rows are bf16 as cached. Each row
// is read from L2 once.
__device__ void mla_chunk(const Params& p, const int* t, const MlaStage& m, long long k0, long long k1,
                          float (&o)[MLA_OT][4], int ct) {
  const int warp = ct >> 5, lane = ct & 31;
  for (long long b0 = k0; b0 < k1; b0 += MLA_KEYS) {
    cp_async_wait_all();
    compute_sync();  // the block's rows (and, at the first, the queries)
    const long long next = mla_block_row(p, t, b0 + MLA_KEYS, k1, ct);
    mla_scores(m, warp, lane);
    compute_sync();
    mla_softmax(m, static_cast<int>(min(static_cast<long long>(MLA_KEYS), k1 - b0)), warp, lane);
    compute_sync();
    mla_values(m, o, warp, lane);
    compute_sync();  // before the next block's rows and probabilities replace these
    if (b0 + MLA_KEYS < k1) mla_load_block(p, t, m.rows(), next, ct);
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

// One context chunk (F_CHUNK of F_COUNT, cut as GQA attention cuts it; with DSA, a chunk of the
// indexer's selection, the first min(pos + 1, DSA_TOPK) entries of its list) of one group of MLA_HEADS
// heads (F_ROW0): stage the heads' queries (mla_stage_queries); run the chunk; leave (sums, max,
// sum) per head in mla_partials (F_AUX3), which v expansion merges (stage_merged_heads).
__device__ void run_mla_attention(const Params& p, Shared& s, const int* t, long long pos, int ct) {
  const int g = t[F_ROW0], chunks = t[F_COUNT], c = t[F_CHUNK];
#if DSA
  const long long n = min(pos + 1, static_cast<long long>(DSA_TOPK));
#else
  const long long n = pos + 1;
#endif
  const long long k0 = n * c / chunks, k1 = n * (c + 1) / chunks;
  const MlaStage stage{s.vec};
  for (int i = ct; i < MLA_ROPE; i += NT) stage.cs()[i] = __ldcg(p.act + p.rope_offset + pos * MLA_ROPE + i);
  for (int h = ct; h < MLA_HEADS; h += NT) {
    stage.st()[h] = -INFINITY;
    stage.st()[MLA_HEADS + h] = 0.f;
  }
  mla_load_block(p, t, stage.rows(), mla_block_row(p, t, k0, k1, ct), ct);  // in flight while queries stage
  compute_sync();
  mla_stage_queries(p, t, stage, g, ct);
  float acc[MLA_OT][4] = {};
  mla_chunk(p, t, stage, k0, k1, acc, ct);
  mla_write_part(p.act + t[F_AUX3] + (static_cast<long long>(g) * chunks + c) * MLA_PART, stage, acc, ct);
}
#endif  // MLA

#if DSA
// ---- compute: the DSA lightning indexer (ir/dsa.py) ----------------------------------------
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
  const long long n = pos + 1, k0 = n * c / chunks, k1 = n * (c + 1) / chunks;
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
// DSA_TOPK largest, equal scores going to the earlier token, found by select_top's counting over
// the scores' order keys; written to F_OUT (int32) in increasing token order: each thread takes a
// run of consecutive tokens, and a block-wide prefix of the chosen counts places its run. Up to
// DSA_TOPK tokens, every one is chosen; the list's unused entries are -1.
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
  BlockCount sum{reinterpret_cast<int*>(s.red + SR_COUNT), 0};
  auto count_ge = [&](uint32_t x) {
    int c = 0;
    for (int i = lo; i < hi; ++i) c += key(i) >= x;
    return c;
  };
  auto count_tie = [&](uint32_t kth, int x) {
    int c = 0;
    for (int i = lo; i < hi; ++i) c += key(i) == kth && i < x;
    return c;
  };
  const Cut cut = select_top(sum, n, DSA_TOPK, count_ge, count_tie, ct);
  int mine = 0;
  for (int i = lo; i < hi; ++i) mine += taken(cut, key(i), i);
  int at = sum.before(mine, ct);
  for (int i = lo; i < hi; ++i)
    if (taken(cut, key(i), i)) __stcg(ids + at++, i);
}
#endif  // DSA

#if FFN_SPLIT_K
// ---- compute: a dense MLP as one split-K op (passes/fusion.py: _fuse_split_k) ---------------
// Task [row0, row1) owns that slice of the intermediate dimension: it stages the RMS-normalized
// input as a norm_matvec does, streams its slice's gate/up pairs (matvec_pages), leaves
// h = silu(g) * u of the slice in shared memory, then streams W_down's columns of the slice as
// F_K rows of `width` values and adds each row's dot product with h into the output, a
// fixed-point sum whose start value the op before wrote (red.add of integers: the same bits in
// any order). A down row is whole 16-byte pieces (8 bf16); SPLIT_K_LANES lanes share a row, so a
// warp takes 32 / SPLIT_K_LANES rows at a time.
__device__ __forceinline__ int split_k_lanes(int pieces) {
  int lanes = 1;
  while (lanes < pieces && lanes < 32) lanes *= 2;
  return lanes;
}

__device__ void split_k_down(const Params& p, Shared& s, const int* t, uint32_t& consumed, int ct) {
  const int warp = ct >> 5, lane = ct & 31, group = warp / GROUP_WARPS, gw = warp % GROUP_WARPS;
  const int width = t[F_ROW1] - t[F_ROW0], rb = 2 * width, rpp = PAGE_BYTES / rb, rows = t[F_K];
  const int pieces = width / 8, lanes = split_k_lanes(pieces), sub = lane % lanes;
  const int per_warp = 32 / lanes, step_rows = GROUP_WARPS * per_warp;
  const float4* h = reinterpret_cast<const float4*>(s.vec);
  long long* out = reinterpret_cast<long long*>(p.act + t[F_OUT]);
  for_each_page(p, s, rows, rpp, group, consumed, [&](const uint8_t* page, int r, int n) {
    for (int base = gw * per_warp; base < n; base += step_rows) {  // warp-uniform: shuffles below
      const int rr = base + lane / lanes;
      float y = 0.f;
      if (rr < n)
        for (int q = sub; q < pieces; q += lanes) {
          const uint4 w = *reinterpret_cast<const uint4*>(page + rr * rb + q * 16);
          y = Bf16Row::dot(make_uint2(w.x, w.y), h[2 * q], y);
          y = Bf16Row::dot(make_uint2(w.z, w.w), h[2 * q + 1], y);
        }
      for (int o = lanes / 2; o > 0; o >>= 1) y += __shfl_xor_sync(0xffffffffu, y, o);
      if (sub == 0 && rr < n) red_add_s64(out + r + rr, to_fixed(y));
    }
  });
}

__device__ void run_split_k(const Params& p, Shared& s, const int* t, uint32_t& consumed, int ct) {
  const int warp = ct >> 5, lane = ct & 31, group = warp / GROUP_WARPS, gw = warp % GROUP_WARPS;
  const int width = t[F_ROW1] - t[F_ROW0];
  for (int i = ct; i < 2 * width; i += NT) s.acc[i] = 0.f;
  stage_vector(p, s, t, ct);  // normed: x * gamma staged, 1/rms in s.red; ends with a barrier
  matvec_pages(p, s, t, width, t[F_ROW_BYTES], rows_per_page(t), t[F_K] / 8, 2, consumed, lane, group, gw);
  compute_sync();  // every gate/up sum is in s.acc, and no warp reads the staged input any more
  const float rstd = s.red[COMPUTE_WARPS];
  for (int i = ct; i < width; i += NT) {  // as run_matvec's silu_mul epilogue
    const float g = s.acc[2 * i] * rstd;
    s.vec[i] = g / (1.f + __expf(-g)) * s.acc[2 * i + 1] * rstd;
  }
  compute_sync();
  split_k_down(p, s, t, consumed, ct);
}
#endif  // FFN_SPLIT_K

// ---- compute warps: the instruction stream, once per decode step ---------------------------
// A task's fields are read from its row in shared memory, which warp 0 copies in while the task
// before runs (cp.async, no registers held): read from the table in global memory (far larger
// than the L1 beside the shared memory), each of the row's cache lines cost a round trip to L2
// where a task first touched it, on every task's critical path (a v expansion task spent ~1.4 µs
// from its dependencies met to the start of its merge; docs/performance.md, session 41).
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void fetch_task_row(const Params& p, const Shared& s, int slot, int id, int ct) {
  for (int f = ct; f < TASK_FIELDS; f += 32) cp_async4(s.task + slot * TASK_SLOT + f, task_row(p, id) + f);
}

// Inlined into the kernel by force: past nvcc's inlining budget (full-size DeepSeek-V3.2 FP8
// with ready digits) it became a call whose ABI took a 344-byte stack frame.
__device__ __forceinline__ void run_compute(const Params& p, Shared& s) {
  const int ct = threadIdx.x;
  uint32_t consumed = 0;
  bool ok = true;
  // The stream's bounds and the sampler's counter are read per step, not held in registers
  // through every task, for the same reason.
  for (long long step = 0; step < p.n_steps && ok; ++step) {
    const long long pos = p.start_pos + step;
    if (step > 0) {  // every CTA learns from the previous token's sampler whether to go on
      ok = wait_counter(p, opaque(static_cast<int>(p.sampler_counter)), static_cast<unsigned>(step), -1);
      if (ct == 0) s.flags[3] = ok && *reinterpret_cast<volatile int*>(&p.status[ST_STOP]) == 0;
      compute_sync();
      ok = s.flags[3];
      if (!ok) break;
    }
    // the step's first task row (a task's row takes slot i % 2 of its stream index i: the step
    // before's last task may have had this slot, and every warp is past it at the barrier above)
    if (ct < 32 && p.stream_offsets[blockIdx.x] < p.stream_offsets[blockIdx.x + 1])
      fetch_task_row(p, s, p.stream_offsets[blockIdx.x] & 1, p.stream_tasks[p.stream_offsets[blockIdx.x]], ct);
    for (int i = p.stream_offsets[blockIdx.x], end = p.stream_offsets[blockIdx.x + 1]; i < end && ok; ++i) {
      const int id = p.stream_tasks[i];
      if (ct < 32) {  // this task's row is in (wait_deps' barrier shows it to the other warps)
        cp_async_wait_all();
        __syncwarp();
      }
      const int* t = s.task + (i & 1) * TASK_SLOT;
      unsigned long long* stamp =
          p.profile && step < p.profile_steps && ct == 0 ? p.profile + (step * p.n_tasks + id) * 3 : nullptr;
      if (stamp) stamp[0] = now_ns();
      ok = wait_deps(p, s, t, step, id);
      if (stamp) stamp[1] = now_ns();
      // past wait_deps' barrier no warp reads the task before's row: the next task's takes its slot
      if (ct < 32 && i + 1 < end) fetch_task_row(p, s, (i + 1) & 1, p.stream_tasks[i + 1], ct);
      if (!ok) break;
      bool signal = true;
      // The matrix-vector and sampling tasks get the thread index through opaque(): what they
      // derive from it (warp, lane, shared-memory offsets) is recomputed per task instead of
      // held in registers through every other task, where attention needs them all.
      switch (t[F_OPCODE]) {
        case OP_EMBED: ok = run_embed(p, t, step, ct); break;
#if MOE
        case OP_MOE_TOPK: run_moe_topk(p, s, t, opaque(ct)); break;
        case OP_MOE_GATE_UP:
        case OP_MOE_DOWN_ADD:
#endif
        case OP_NORM_MATVEC:
        case OP_MATVEC_ADD:
          run_matvec(p, s, t, consumed, opaque(ct));
          if (t[F_EPILOGUE] == EPI_ARGMAX) sample_lm_head(p, s, t, pos, opaque(ct));
#if TP > 1
          if (t[F_XCHG] >= 0) ok = exchange_rows(p, s, t, step, id, opaque(ct));
#endif
          break;
#if MLA
        case OP_HEAD_MATVEC:
          run_matvec(p, s, t, consumed, opaque(ct));
          if (t[F_APPEND]) mla_append_latent(p, s, t, pos, opaque(ct));
          break;
        case OP_MLA_ATTENTION: run_mla_attention(p, s, t, pos, opaque(ct)); break;
#endif
#if DSA
        case OP_DSA_SCORE: run_dsa_score(p, s, t, pos, opaque(ct)); break;
        case OP_DSA_TOPK: run_dsa_topk(p, s, t, pos, opaque(ct)); break;
#endif
#if !MLA
        case OP_ATTENTION: signal = run_attention(p, s, t, step, pos, consumed, ct); break;
#endif
#if TP > 1
        case OP_ARGMAX: ok = run_argmax_ranks(p, s, t, step, id, opaque(ct)); break;
#else
        case OP_ARGMAX: run_argmax(p, s, t, step, pos, opaque(ct)); break;
#endif
#if FFN_SPLIT_K
        case OP_FFN_SPLIT_K: run_split_k(p, s, t, consumed, opaque(ct)); break;
#endif
      }
      if (signal) signal_done(p, t);
      if (stamp) stamp[2] = now_ns();
    }
  }
  cp_async_wait_all();  // a row fetched for a task that a failing launch did not run
  compute_sync();
  if (ct == 0) {
    atomicExch(const_cast<int*>(&s.flags[1]), static_cast<int>(consumed));
    __threadfence_block();
    atomicExch(const_cast<int*>(&s.flags[0]), 1);  // quit: the loader drains and leaves
  }
}

}  // namespace tilertc

extern "C" __global__ void __launch_bounds__((COMPUTE_WARPS + 1) * 32, 1)
    tilertc_decode(const tilertc::Params* __restrict__ params) {
  using namespace tilertc;
  extern __shared__ __align__(128) uint8_t smem[];
  const Params p = *params;
  Shared s = carve(smem);
  if (threadIdx.x == 0) {
    for (int i = 0; i < RING_PAGES; ++i) {
      mbar_init(&s.full[i], 1);
      mbar_init(&s.empty[i], GROUP_WARPS * 32);
    }
    s.flags[0] = 0;
    s.flags[1] = 0;
    s.flags[FLAG_SAMPLE_MODE] = sampling(p).mode();
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  // The loader is the last warp, so that the compute warps are whole warpgroups (wgmma).
  if (threadIdx.x >= COMPUTE_WARPS * 32)
    run_loader(p, s);
  else
    run_compute(p, s);
}
