// The sampling code of the device library (backends/cuda/decode/), run on the host
// (tests/test_sampling.py).
//
// The test extracts the kernel's own definitions (task table, parameters, shared-memory
// struct, the sampling section, write_best, sample_lm_head, publish_token, run_argmax) into
// kernel_extract.inc and compiles this file with the model constants as -D flags. A CTA's
// compute threads are fibers: compute_sync is a barrier over all of them, a warp's shuffles and
// reductions go through a per-warp buffer between two barriers, shared memory is host memory.
// Commands on stdin, one per line:
//   mix X                            -> mix64(X)
//   score SEED POS TEMP_BITS LOGIT_BITS ROW -> bits of gumbel_score
//   key BITS                         -> order_key, and key_float of it (bits)
//   select WANT N (KEY ROW)*N        -> select_top over N items spread over the compute threads
//   sample V TASKS TEMP_BITS TOP_K TOP_P_BITS SEED POS (LOGIT_BITS)*V
//                                    -> the token and the nucleus-cut count of one step's lm_head
//                                       tasks and sampler
//   route (LOGIT_BITS)*MOE_EXPERTS [(BIAS_BITS)*MOE_EXPERTS]
//                                    -> (built with MOE=1) the MoE router's MOE_TOP_K expert ids,
//                                       then the bits of their combine weights; the correction
//                                       bias follows the logits when built with MOE_BIAS=1
//   dsa_topk N (SCORE_BITS)*N        -> (built with DSA=1) the DSA indexer's selection of the
//                                       DSA_TOPK best of N scores (run_dsa_topk at position
//                                       N - 1): DSA_TOPK token ids, -1 where unused
//   step DIR TOKEN POS ROPE          -> (built with HOST_STEP=1 and every kernel constant as -D, from
//                                       tests/test_mla_kernel.py) one decode step: the tasks of
//                                       DIR/tasks.bin in order, each as the compute warps run it,
//                                       on the arenas DIR/act.bin, DIR/kv.bin (written back in
//                                       place), the packed weights DIR/weights.bin and the
//                                       embedding table DIR/embed.bin, the RoPE table at act
//                                       offset ROPE; prints the token and the error code. The
//                                       loader's part is a copy of each task's pages into the
//                                       ring before the task (a routed task's through the
//                                       loader's own route_pieces and copy_pieces, in MoE
//                                       models; a GQA attention task's keys and values through
//                                       the loader's own load_kv_chunk, a split-K FFN task's
//                                       rows through its own load_split_k); counters are a host
//                                       array. Built with TP > 1: every rank's step, rank r's
//                                       arenas and weights in DIR/rank{r}/, each rank's peer
//                                       pointers at the other ranks' host arenas; an exchanging
//                                       task runs on every rank up to its arrival, then on
//                                       every rank from its wait on (which checks that all TP
//                                       arrived), as the ranks' GPUs would.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <ucontext.h>
#include <vector>

#define __device__
#define __forceinline__ inline
using std::max;
using std::min;
typedef uint16_t __nv_bfloat16;
struct float2 {
  float x, y;
};
static inline float2 make_float2(float x, float y) { return {x, y}; }
// The vector types and bf16 conversions the matrix-vector and MLA code uses (bf16 as its bits,
// converted as the GPU does: round to nearest even).
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) uint2 {
  uint32_t x, y;
};
struct alignas(16) uint4 {
  uint32_t x, y, z, w;
};
struct int2 {
  int x, y;
};
struct alignas(16) longlong2 {
  long long x, y;
};
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
static inline uint2 make_uint2(uint32_t x, uint32_t y) { return {x, y}; }
static inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }
static inline int2 make_int2(int x, int y) { return {x, y}; }
static inline float __bfloat162float(__nv_bfloat16 b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline float2 __bfloat1622float2(__nv_bfloat162 b) { return {__bfloat162float(b.x), __bfloat162float(b.y)}; }
static inline __nv_bfloat16 __float2bfloat16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<__nv_bfloat16>((u >> 16) | 0x40);  // NaN stays NaN
  return static_cast<__nv_bfloat16>((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}
static inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__float2bfloat16(a), __float2bfloat16(b)}; }
static inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
static inline long long __float2ll_rn(float x) { return std::llrint(x); }  // round to nearest even
static inline float __ll2float_rn(long long v) { return static_cast<float>(v); }
#define __expf expf  // glibc declares __expf; the GPU intrinsic is a faster expf
static inline float exp_ftz(float x) { return expf(x); }  // decode/ptx.cuh: one MUFU.EX2 on the GPU
static inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline int opaque(int x) { return x; }  // on the GPU: a value the compiler may not hoist
template <class T> static inline T __ldcg(const T* p) { return *p; }
template <class T> static inline void __stcg(T* p, T v) { *p = v; }
static inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline float atomicAdd(float* p, float v) {  // fibers never run at once: no race
  const float old = *p;
  *p = old + v;
  return old;
}
static inline int atomicExch(int* p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
static inline int atomicCAS(int* p, int cmp, int v) {
  const int old = *p;
  if (old == cmp) *p = v;
  return old;
}
static inline unsigned atom_add_acq_rel(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline void __threadfence_system() {}
#if WEIGHT_FP8
// The FP8 dot product's conversion (decode/dot.cuh: Fp8Row): a pair of e4m3 values to a pair of
// f16 and on to float2. Every e4m3 value is exactly a float (and an f16), so the pair is
// decoded straight to floats; tests/test_fp8_kernel.py runs the same dot product with
// cuda_fp8.h's own conversion.
typedef uint16_t __nv_fp8x2_storage_t;
enum __nv_fp8_interpretation_t { __NV_E4M3 };
struct __half2 {
  float2 v;
};
static inline float e4m3_value(uint32_t b) {  // sign, 4 exponent bits (bias 7), 3 mantissa bits
  const int e = (b >> 3) & 15, m = b & 7;
  const float v = e == 15 && m == 7 ? NAN : e == 0 ? std::ldexp(m / 8.f, -6) : std::ldexp(1.f + m / 8.f, e - 7);
  return b & 0x80 ? -v : v;
}
static inline __half2 __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t x, __nv_fp8_interpretation_t) {
  return {{e4m3_value(x & 0xffu), e4m3_value(x >> 8)}};
}
static inline float2 __half22float2(__half2 h) { return h.v; }
#endif

// ---- the CTA: compute threads as fibers on one host thread ---------------------------------
// Each compute thread is a ucontext fiber; a barrier wait yields to the next fiber until every
// participant has arrived. One host thread runs them all, so memory is trivially coherent and
// the runs are deterministic.
constexpr int THREADS = COMPUTE_WARPS * 32;
struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  bool done;
};
static std::vector<Fiber> fibers(THREADS);
static ucontext_t scheduler;
static int tl_ct;  // the running fiber's compute index
static const std::function<void(int)>* body;

static void yield() { swapcontext(&fibers[tl_ct].ctx, &scheduler); }
struct Barrier {
  int expected, arrived;
  unsigned phase;
  void arrive_and_wait() {
    const unsigned mine = phase;
    if (++arrived == expected) {
      arrived = 0;
      ++phase;
      return;
    }
    while (phase == mine) yield();
  }
};
static Barrier block_bar;
struct Warp {
  Barrier bar;
  unsigned char buf[32][8];
};
static Warp warps[COMPUTE_WARPS];

static Barrier warpgroup_bars[COMPUTE_WARPS / 4];

static inline void compute_sync() { block_bar.arrive_and_wait(); }
static inline void warpgroup_sync(int k) { warpgroup_bars[k].arrive_and_wait(); }
static inline void __syncwarp() { warps[tl_ct >> 5].bar.arrive_and_wait(); }
template <class T> static T lane_value(T v, int src) {  // every lane of the warp calls this
  Warp& w = warps[tl_ct >> 5];
  std::memcpy(w.buf[tl_ct & 31], &v, sizeof(T));
  w.bar.arrive_and_wait();
  T out;
  std::memcpy(&out, w.buf[src & 31], sizeof(T));
  w.bar.arrive_and_wait();
  return out;
}
template <class T> static T __shfl_xor_sync(unsigned, T v, int o) { return lane_value(v, (tl_ct & 31) ^ o); }
template <class T> static T __shfl_sync(unsigned, T v, int src) { return lane_value(v, src); }
template <class T> static T __shfl_up_sync(unsigned, T v, int o) {
  const int lane = tl_ct & 31;
  return lane_value(v, lane >= o ? lane - o : lane);
}
// Every lane's v, as each lane of the warp sees them (every lane of the warp calls this).
template <class T> static std::array<T, 32> warp_values(T v) {
  Warp& w = warps[tl_ct >> 5];
  std::memcpy(w.buf[tl_ct & 31], &v, sizeof v);
  w.bar.arrive_and_wait();
  std::array<T, 32> all;
  for (int l = 0; l < 32; ++l) std::memcpy(&all[l], w.buf[l], sizeof v);
  w.bar.arrive_and_wait();
  return all;
}
static unsigned __reduce_add_sync(unsigned, unsigned v) {
  unsigned total = 0;
  for (unsigned u : warp_values(v)) total += u;
  return total;
}
// The lanes of the warp whose v equals this lane's, as a mask (the radix selection's histogram).
static unsigned __match_any_sync(unsigned, int v) {
  const std::array<int, 32> all = warp_values(v);
  unsigned peers = 0;
  for (int l = 0; l < 32; ++l) peers |= static_cast<unsigned>(all[l] == v) << l;
  return peers;
}
static inline int __popc(unsigned v) { return __builtin_popcount(v); }
static inline int __ffs(int v) { return __builtin_ffs(v); }
static inline unsigned __umulhi(unsigned a, unsigned b) { return static_cast<unsigned>((1ull * a * b) >> 32); }

static void fiber_main() {
  (*body)(tl_ct);
  fibers[tl_ct].done = true;
}
// Runs f(ct) on every compute thread until all have returned.
static void run_block(const std::function<void(int)>& f) {
  body = &f;
  block_bar = {THREADS, 0, 0};
  for (auto& w : warps) w.bar = {32, 0, 0};
  for (auto& b : warpgroup_bars) b = {128, 0, 0};
  for (int ct = 0; ct < THREADS; ++ct) {
    Fiber& fb = fibers[ct];
    fb.stack.resize(1 << 16);
    fb.done = false;
    getcontext(&fb.ctx);
    fb.ctx.uc_stack.ss_sp = fb.stack.data();
    fb.ctx.uc_stack.ss_size = fb.stack.size();
    fb.ctx.uc_link = &scheduler;
    makecontext(&fb.ctx, fiber_main, 0);
  }
  for (bool running = true; running;) {
    running = false;
    for (int ct = 0; ct < THREADS; ++ct) {
      if (fibers[ct].done) continue;
      running = true;
      tl_ct = ct;
      swapcontext(&scheduler, &fibers[ct].ctx);
    }
  }
}

// The ring, as compute sees it in the `step` command: the harness has copied the task's pages in
// before the task runs, so a page is always full and releasing it does nothing.
struct Params;
static inline bool ring_wait(const Params&, uint64_t*, uint32_t, volatile int*) { return true; }
static inline void mbar_arrive(uint64_t*) {}
// The loader's side, as the `step` command runs it: tasks run in table order, so a routed task's
// router has run (acquire has nothing to wait for), and a bulk copy is a copy. An exchange's
// wait (SYSTEM) is checked instead: every rank must have arrived by then.
template <bool SYSTEM = false, class P>
static inline bool acquire(const P& p, int counter, unsigned target, int, volatile int*) {
  return !SYSTEM || p.counters[counter] >= target;
}
static inline void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t*) { std::memcpy(dst, src, bytes); }
static inline void bulk_copy_shared_data(void* dst, const void* src, uint32_t bytes, uint64_t*) {
  std::memcpy(dst, src, bytes);
}
static inline void mbar_expect_tx(uint64_t*, uint32_t) {}
static inline void fence_proxy_async_shared() {}
#if HOST_STEP  // the ring is always free: the `step` command runs one task at a time
template <class P, class S>
static inline uint8_t* claim_page(const P&, S& s, uint32_t issued) { return s.ring + issued % RING_PAGES * PAGE_BYTES; }
#endif
static inline void red_release_sys(unsigned* p, unsigned v) { *p += v; }
static inline void red_add_s64(long long* p, long long v) { *p += v; }  // fibers never run at once
#if MLA
// The tensor cores' mma.m16n8kK with f32 accumulation (decode/ptx.cuh: mma_bf16_16816 for MLA
// attention, K = 16; inline PTX there). The mma gathers the warp's 32 lanes' fragments through a
// per-warp buffer between two barriers and computes each lane's D = A * B + D, the products
// summed in double, reading A and B back out of the fragments as the PTX ISA lays out m16n8k16
// .bf16 and m16n8k32 8-bit operands: a register holds V = K / 8 consecutive k, the lower k in the
// lower bits (group g = lane / 4, q = lane % 4: A's a0 row g, k V q .. V q + V - 1; a1 row g+8;
// a2, a3 the same rows at k + K / 2; B's b0 those k of column g, b1 k + K / 2; D's d0, d1 row g,
// columns 2q, 2q+1, d2, d3 row g+8); `value(reg, v)` is value v of a register, converted exactly.
struct MmaFragments {
  uint32_t a[32][4], b[32][2];
};
static MmaFragments mma_buf[COMPUTE_WARPS];
// Where A's (row, k) / B's (k, column n) lie in a warp's fragments: value v of register reg.
struct FragmentValue {
  uint32_t reg;
  int v;
};
template <int K> static FragmentValue fragment_a(const MmaFragments& f, int row, int k) {
  constexpr int V = K / 8;
  return {f.a[(row % 8) * 4 + (k % (K / 2)) / V][(row >= 8) + 2 * (k >= K / 2)], k % V};
}
template <int K> static FragmentValue fragment_b(const MmaFragments& f, int k, int n) {
  constexpr int V = K / 8;
  return {f.b[n * 4 + (k % (K / 2)) / V][k >= K / 2], k % V};
}
static void gather_fragments(const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const int warp = tl_ct >> 5, lane = tl_ct & 31;
  std::memcpy(mma_buf[warp].a[lane], a, sizeof mma_buf[warp].a[lane]);
  mma_buf[warp].b[lane][0] = b0;
  mma_buf[warp].b[lane][1] = b1;
  warps[warp].bar.arrive_and_wait();
}
static void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const auto value = [](FragmentValue at) {
    return static_cast<double>(__bfloat162float(static_cast<__nv_bfloat16>(at.reg >> (16 * at.v))));
  };
  const int warp = tl_ct >> 5, g = (tl_ct & 31) / 4, q = tl_ct & 3;
  gather_fragments(a, b0, b1);
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), n = 2 * q + i % 2;
    double sum = d[i];
    for (int k = 0; k < 16; ++k) sum += value(fragment_a<16>(mma_buf[warp], row, k)) * value(fragment_b<16>(mma_buf[warp], k, n));
    d[i] = static_cast<float>(sum);
  }
  warps[warp].bar.arrive_and_wait();  // nobody overwrites the fragments before every lane has read them
}
#endif
#if FP8_MMA || (MLA && WEIGHT_FP8)
// The tensor cores' wgmma (decode/ptx.cuh: smem_desc, Wgmma<N>::mma, wgmma_m64n8k32_rs and the
// fences, inline PTX there). A descriptor here is the operand's host address with lbo / 16 and
// sbo / 16 above it (user-space addresses fit in 48 bits). Each thread computes its own D
// elements at the call, as the PTX ISA lays out the operands (in shared memory K-major core
// matrices: element (row, k) at (k / 16) lbo + (row / 8) sbo + (row % 8) 16 + k % 16; A from
// registers as mma.m16n8k32's fragment, warp w's rows 16 w ..) and D (warp w of the warpgroup,
// g = lane / 4, q = lane % 4: d[4 i + h] is row 16 w + g + 8 (h / 2), column 8 i + 2 q + h % 2);
// the products are summed in double and rounded once.
static inline uint64_t smem_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  return reinterpret_cast<uint64_t>(p) | static_cast<uint64_t>(lbo >> 4) << 48 | static_cast<uint64_t>(sbo >> 4) << 56;
}
static inline float operand_e4m3(uint64_t desc, int row, int k) {
  const uint8_t* base = reinterpret_cast<const uint8_t*>(desc & ((1ull << 48) - 1));
  const int lbo = static_cast<int>((desc >> 48) & 0xff) << 4, sbo = static_cast<int>(desc >> 56) << 4;
  return e4m3_value(base[k / 16 * lbo + row / 8 * sbo + row % 8 * 16 + k % 16]);
}
template <int N> struct Wgmma {  // m64nNk32, e4m3 in, f32 out
  static void mma(float (&d)[N / 2], uint64_t a, uint64_t b, int accumulate) {
    const int w = (tl_ct >> 5) & 3, g = (tl_ct & 31) / 4, q = tl_ct & 3;
    for (int i = 0; i < N / 2; ++i) {
      const int row = 16 * w + g + 8 * (i % 4 / 2), col = 8 * (i / 4) + 2 * q + i % 2;
      double sum = accumulate ? d[i] : 0.0;
      for (int k = 0; k < 32; ++k) sum += static_cast<double>(operand_e4m3(a, row, k)) * operand_e4m3(b, col, k);
      d[i] = static_cast<float>(sum);
    }
  }
};
#if MLA && WEIGHT_FP8
static void wgmma_m64n8k32_rs(float (&d)[4], const uint32_t (&a)[4], uint64_t b, int accumulate) {
  const int warp = tl_ct >> 5, g = (tl_ct & 31) / 4, q = tl_ct & 3;
  gather_fragments(a, 0, 0);  // a warp's D rows are its own A rows
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), n = 2 * q + i % 2;
    double sum = accumulate ? d[i] : 0.0;
    for (int k = 0; k < 32; ++k) {
      const FragmentValue at = fragment_a<32>(mma_buf[warp], row, k);
      sum += static_cast<double>(e4m3_value((at.reg >> (8 * at.v)) & 0xffu)) * operand_e4m3(b, n, k);
    }
    d[i] = static_cast<float>(sum);
  }
  warps[warp].bar.arrive_and_wait();
}
#endif
static inline void wgmma_fence() {}
static inline void wgmma_commit() {}
static inline void wgmma_wait_all() {}
#endif
#if FP8_MMA || (MLA && WEIGHT_FP8)  // the digits' helpers (decode/tile_digits.cuh)
static inline uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {  // byte i: byte s[4i..4i+2] of b:a, s[4i+3]: its sign
  const uint64_t v = static_cast<uint64_t>(b) << 32 | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t sel = (s >> (4 * i)) & 0xf, byte = static_cast<uint32_t>(v >> (8 * (sel & 7))) & 0xff;
    r |= (sel & 8 ? (byte & 0x80 ? 0xffu : 0u) : byte) << (8 * i);
  }
  return r;
}
static inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {  // byte i: byte s[4i..] of y:x
  const uint64_t v = static_cast<uint64_t>(y) << 32 | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<uint32_t>(v >> (8 * ((s >> (4 * i)) & 7)) & 0xff) << (8 * i);
  return r;
}
#endif
// done at once; both addresses 16-byte aligned, or the GPU's copy faults
static inline void cp_async16(void* dst, const void* src) {
  if ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) {
    std::fprintf(stderr, "cp_async16: %p <- %p is not 16-byte aligned\n", dst, src);
    std::abort();
  }
  std::memcpy(dst, src, 16);
}
static inline void cp_async_wait_all() {}
struct ThreadIdx {
  int x;
};
#define threadIdx (ThreadIdx{tl_ct})  // compute thread ct is the CTA's thread ct

#include "kernel_extract.inc"

// ---- commands -----------------------------------------------------------------------------
static void select_command() {
  int want, n;
  std::scanf("%d %d", &want, &n);
  std::vector<uint32_t> key(n);
  std::vector<int> row(n);
  for (int i = 0; i < n; ++i) std::scanf("%u %d", &key[i], &row[i]);
  std::vector<float> red(MISC_FLOATS, NAN);
  Shared s{};
  s.red = red.data();
  std::vector<char> out(n);
  run_block([&](int ct) {  // item i belongs to thread i % THREADS
    BlockCount sum{reinterpret_cast<int*>(s.red + SR_COUNT), 0};
    auto each = [&](auto f) {  // every lane as often
      for (int i = ct; i < (n + THREADS - 1) / THREADS * THREADS; i += THREADS) f(i < n ? key[i] : 0u, i < n);
    };
    auto count_tie = [&](uint32_t kth, int x) {
      int c = 0;
      for (int i = ct; i < n; i += THREADS) c += key[i] == kth && row[i] < x;
      return c;
    };
    const Cut cut = select_top(s, sum, want, each, count_tie, ct);
    for (int i = ct; i < n; i += THREADS) out[i] = taken(cut, key[i], row[i]) ? '1' : '0';
  });
  std::printf("%s\n", std::string(out.begin(), out.end()).c_str());
}

// `n` floats from stdin, each given as its bit pattern (exact, unlike a decimal print).
static void read_float_bits(float* dst, int n) {
  for (int i = 0; i < n; ++i) {
    unsigned b;
    std::scanf("%u", &b);
    dst[i] = __uint_as_float(b);
  }
}

static void sample_command() {
  int vocab, tasks;
  unsigned temp_bits, top_p_bits;
  long long top_k, pos;
  unsigned long long seed;
  std::scanf("%d %d %u %lld %u %llu %lld", &vocab, &tasks, &temp_bits, &top_k, &top_p_bits, &seed, &pos);
  std::vector<float> logits(vocab);
  read_float_bits(logits.data(), vocab);
  SampleArgs args{__uint_as_float(temp_bits), __uint_as_float(top_p_bits), top_k, seed};
  std::vector<float> act(2 * tasks + tasks * (2 + 2 * SAMPLE_SLOTS), NAN);  // argmax_partials | sample_partials
  int status[8] = {}, tokens[1] = {}, host_tokens[1] = {}, host_count = 0, host_stop = 0;
  Params p{};
  p.act = act.data();
  p.sample = &args;
  p.status = status;
  p.tokens = tokens;
  p.host_tokens = host_tokens;
  p.host_count = &host_count;
  p.host_stop = &host_stop;
  p.n_steps = 1;
  p.eos_token = -1;
  std::vector<float> red(MISC_FLOATS, NAN), acc(vocab / tasks + 1, NAN);
  int flags[8] = {};
  Shared s{};
  s.red = red.data();
  s.acc = acc.data();
  s.flags = flags;
  flags[FLAG_SAMPLE_MODE] = sampling(p).mode();  // as thread 0 does when the kernel starts
  for (int task = 0; task < tasks; ++task) {  // each lm_head task's epilogue, in turn
    const int row0 = static_cast<int>(1LL * vocab * task / tasks);
    const int row1 = static_cast<int>(1LL * vocab * (task + 1) / tasks);
    int t[TASK_FIELDS] = {};
    t[F_OPCODE] = OP_NORM_MATVEC;
    t[F_EPILOGUE] = EPI_ARGMAX;
    t[F_ROW0] = row0;
    t[F_ROW1] = row1;
    t[F_AUX2] = 2 * task;
    t[F_AUX3] = 2 * tasks;
    t[F_CHUNK] = task;
    for (int i = 0; i < row1 - row0; ++i) acc[i] = logits[row0 + i];
    red[COMPUTE_WARPS] = 1.f;  // 1 / rms: the logits are the row sums
    run_block([&](int ct) {
      float best = -INFINITY;  // run_matvec's epilogue: the first largest of this thread's rows
      int best_row = 0x7fffffff;
      for (int i = ct; i < row1 - row0; i += THREADS)
        if (acc[i] > best) {
          best = acc[i];
          best_row = row0 + i;
        }
      write_best(p, s, t, best, best_row, ct);
      sample_lm_head(p, s, t, pos, ct);
    });
  }
  int t[TASK_FIELDS] = {};
  t[F_OPCODE] = OP_ARGMAX;
  t[F_IN] = 0;
  t[F_COUNT] = tasks;
  t[F_AUX] = 2 * tasks;
  run_block([&](int ct) { run_argmax(p, s, t, 0, pos, ct); });
  std::printf("%d %d %d\n", tokens[0], host_tokens[0] == tokens[0] && host_count == 1, status[ST_NUCLEUS_CUT]);
}

#if MOE
static void route_command() {
  const int inputs = MOE_EXPERTS * (1 + MOE_BIAS);
  std::vector<float> act(inputs + 2 * MOE_TOP_K, NAN);  // logits | bias | ids | weights
  read_float_bits(act.data(), inputs);
  Params p{};
  p.act = act.data();
  int t[TASK_FIELDS] = {};
  t[F_OPCODE] = OP_MOE_TOPK;
  t[F_IN] = 0;
  t[F_AUX2] = MOE_EXPERTS;
  t[F_OUT] = inputs;
  t[F_AUX] = inputs + MOE_TOP_K;
  std::vector<float> vec(MAX_K, NAN);
  Shared s{};
  s.vec = vec.data();
  run_block([&](int ct) { run_moe_topk(p, s, t, ct); });
  for (int k = 0; k < MOE_TOP_K; ++k) std::printf("%d ", __float_as_int(act[inputs + k]));
  for (int k = 0; k < MOE_TOP_K; ++k) std::printf("%u ", __float_as_uint(act[inputs + MOE_TOP_K + k]));
  std::printf("\n");
}
#endif

#if DSA
static void dsa_topk_command() {
  int n;
  std::scanf("%d", &n);
  std::vector<float> act(n + DSA_TOPK, NAN);  // scores | ids
  read_float_bits(act.data(), n);
  Params p{};
  p.act = act.data();
  std::vector<float> red(MISC_FLOATS, NAN), vec(MAX_K, NAN);
  Shared s{};
  s.red = red.data();
  s.vec = vec.data();  // the keys it keeps
  int t[TASK_FIELDS] = {};
  t[F_OPCODE] = OP_DSA_TOPK;
  t[F_IN] = 0;
  t[F_OUT] = n;
  run_block([&](int ct) { run_dsa_topk(p, s, t, n - 1, ct); });
  for (int k = 0; k < DSA_TOPK; ++k) std::printf("%d ", __float_as_int(act[n + k]));
  std::printf("\n");
}
#endif

#if HOST_STEP  // built by tests/test_mla_kernel.py: build_step_harness
static std::vector<char> read_file(const std::string& path) {
  std::vector<char> out;
  if (FILE* f = std::fopen(path.c_str(), "rb")) {
    char buf[1 << 16];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) out.insert(out.end(), buf, buf + n);
    std::fclose(f);
  }
  return out;
}
static void write_file(const std::string& path, const void* data, size_t bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  std::fwrite(data, 1, bytes, f);
  std::fclose(f);
}
template <class T> static std::vector<T> read_as(const std::string& path) {
  const std::vector<char> raw = read_file(path);
  std::vector<T> out(raw.size() / sizeof(T));
  std::memcpy(out.data(), raw.data(), raw.size());
  return out;
}

// One rank's GPU: its arenas, weights, counters and parameters.
struct Rank {
  std::string dir;
  std::vector<float> act;
  std::vector<__nv_bfloat16> kv;
  std::vector<char> weights;
  std::vector<unsigned> counters = std::vector<unsigned>(1 << 16, 0);
  int status[8] = {}, tokens[1] = {}, host_tokens[1] = {}, host_count = 0, host_stop = 0;
  uint32_t consumed = 0;
  long long issued = -1;  // a split-K task's: the pages its loader issued, which compute must consume
  Params p{};
};

// The loader's pages of task t of rank k, into the ring slots compute will read (false: more
// pages than the ring).
static bool load_pages(Rank& k, Shared& s, const int* t, int id, long long pos) {
  Params& p = k.p;
#if MLA  // the loader's own page of an attention task (load_mla_page, without its waits)
  if (t[F_OPCODE] == OP_MLA_ATTENTION) {
    const bool early = mla_first_block_early(pos, mla_keys(t, pos));
    uint8_t* page = s.ring + k.consumed % RING_PAGES * PAGE_BYTES;
    if (early) zero_mla_padding(page);
    fill_mla_page(p, t, pos, page, nullptr, early);
    return true;
  }
#endif
#if !MLA
  if (t[F_OPCODE] == OP_ATTENTION) {
    uint32_t issued = k.consumed;
    return load_kv_chunk(p, s, t, 0, id, issued) && issued - k.consumed <= RING_PAGES;
  }
#endif
  k.issued = -1;
#if FFN_SPLIT_K
  if (t[F_OPCODE] == OP_FFN_SPLIT_K) {  // the loader's own code, into the slots compute reads
    const int width = t[F_ROW1] - t[F_ROW0];
    const int pages = (width + rows_per_page(t) - 1) / rows_per_page(t) +
                      (t[F_K] + PAGE_BYTES / (2 * width) - 1) / (PAGE_BYTES / (2 * width));
    if (pages > RING_PAGES) return false;
    uint32_t issued = k.consumed;
    load_split_k(p, s, t, issued);
    k.issued = issued;
    return true;
  }
#endif
  if (!has_weights(t)) return true;
  const int rows = stream_rows(t), rb = t[F_ROW_BYTES], rpp = rows_per_page(t);
  const uint8_t* src = task_weights(p, t);
  if ((rows + rpp - 1) / rpp > RING_PAGES) return false;
#if MOE  // as run_loader: the slots' experts, the pieces of a down task's rows gathered
  const uint8_t* piece[MOE_PIECES];
  const bool routed = t[F_OPCODE] == OP_MOE_GATE_UP || t[F_OPCODE] == OP_MOE_DOWN_ADD;
  if (routed) {
    route_pieces(p, s, t, 0, id, src, piece);
    src = piece[0];
  }
#if TP > 1  // a gate/up task whose slot holds no expert of this rank loads nothing (run_loader)
  if (routed && t[F_OPCODE] == OP_MOE_GATE_UP && !piece[0]) return true;
#endif
#endif
  for (int r = 0, i = 0; r < rows; r += rpp, ++i) {
    uint8_t* page = s.ring + (k.consumed + i) % RING_PAGES * PAGE_BYTES;
#if MOE
    if (routed && GATHERS_PIECES(t)) {
      copy_pieces(page, piece, t, r, min(rpp, rows - r), nullptr);
      continue;
    }
#endif
    std::memcpy(page, src + static_cast<long long>(r) * rb, static_cast<size_t>(min(rpp, rows - r)) * rb);
  }
  return true;
}

// A task as run_compute's switch runs it, up to an exchange's arrival.
static void run_task(Rank& k, Shared& s, const int* t, long long pos) {
  const Params& p = k.p;
  const uint32_t before = k.consumed;
  uint32_t after = before;
  run_block([&](int ct) {
    uint32_t mine = before;  // each compute thread's own count of consumed pages
    zero_row_sums(s, ct);  // as run_compute does before the task's dependency wait, whose
    compute_sync();        // barrier orders it before the task
    switch (t[F_OPCODE]) {
      case OP_EMBED: run_embed(p, t, 0, ct); break;
#if MOE
      case OP_MOE_TOPK: run_moe_topk(p, s, t, ct); break;
      case OP_MOE_GATE_UP:
      case OP_MOE_DOWN_ADD:
#endif
      case OP_NORM_MATVEC:
      case OP_MATVEC_ADD:
#if MLA
      case OP_HEAD_MATVEC:
#endif
        run_matvec(p, s, t, mine, ct);
        if (t[F_EPILOGUE] == EPI_ARGMAX) sample_lm_head(p, s, t, pos, ct);
#if MLA
        if (t[F_OPCODE] == OP_HEAD_MATVEC && t[F_APPEND]) mla_append_latent(p, s, t, pos, ct);
#endif
        break;
#if MLA
      case OP_MLA_ATTENTION:
        run_mla_attention(p, s, t, pos, mine, ct);
        mla_release_page(s, mine, ct);
        break;
#else
      case OP_ATTENTION: run_attention(p, s, t, 0, pos, mine, ct); break;
#endif
#if FFN_SPLIT_K
      case OP_FFN_SPLIT_K: run_split_k(p, s, t, mine, ct); break;
#endif
#if DSA
      case OP_DSA_SCORE: run_dsa_score(p, s, t, pos, ct); break;
      case OP_DSA_TOPK: run_dsa_topk(p, s, t, pos, ct); break;
#endif
#if TP > 1
      case OP_ARGMAX: argmax_publish(p, s, t, ct); break;
#else
      case OP_ARGMAX: run_argmax(p, s, t, 0, pos, ct); break;
#endif
    }
#if TP > 1
    if (t[F_XCHG] >= 0) exchange_arrive(p, t);
#endif
    if (ct == 0) after = mine;
  });
  k.consumed = after;
}

#if TP > 1
// An exchanging task from its wait on; false when not every rank had arrived.
static bool finish_exchange(Rank& k, Shared& s, const int* t, int id) {
  const Params& p = k.p;
  bool ok = true;
  run_block([&](int ct) {
    const bool mine = exchange_await(p, s, t, 0, id);
    if (ct == 0) ok = mine;
    if (!mine) return;
    if (t[F_OPCODE] == OP_ARGMAX) argmax_agree(p, t, 0, ct);
    else sum_ranks(p, t, ct);
  });
  return ok;
}
#endif

static void load_rank(Rank& k, const std::string& dir, const std::vector<char>& embed, long long token, long long pos,
                      long long rope, SampleArgs* args) {
  k.dir = dir;
  k.act = read_as<float>(dir + "/act.bin");
  k.kv = read_as<__nv_bfloat16>(dir + "/kv.bin");
  k.weights = read_file(dir + "/weights.bin");
  Params& p = k.p;
  p.weights = reinterpret_cast<const uint8_t*>(k.weights.data());
  p.act = k.act.data();
  p.kv = k.kv.data();
  p.embed = reinterpret_cast<const __nv_bfloat16*>(embed.data());
  p.counters = k.counters.data();
  p.tokens = k.tokens;
  p.host_tokens = k.host_tokens;
  p.host_count = &k.host_count;
  p.host_stop = &k.host_stop;
  p.status = k.status;
  p.first_token = token;
  p.start_pos = pos;
  p.rope_offset = rope;
  p.n_steps = 1;
  p.eos_token = -1;
  p.sample = args;
}

// One decode step of every task in table order (an order the counters allow: ops in program
// order, a chunked op's merge by its last task), on every rank, as run_compute's switch runs
// them. Prints each rank's token and error code (-1: an exchange found a rank missing).
static void step_command() {
  char dir[4096];
  long long token, pos, rope;
  std::scanf("%4095s %lld %lld %lld", dir, &token, &pos, &rope);
  const std::string d(dir);
  const std::vector<char> embed = read_file(d + "/embed.bin");
  const std::vector<int> tasks = read_as<int>(d + "/tasks.bin");
  SampleArgs args{0.0, 1.0, 0, 0};  // greedy
  std::vector<Rank> ranks(TP);
  for (int r = 0; r < TP; ++r)
    load_rank(ranks[r], TP > 1 ? d + "/rank" + std::to_string(r) : d, embed, token, pos, rope, &args);
#if TP > 1
  PeerTable peers;
  for (int r = 0; r < TP; ++r) {
    peers.act[r] = ranks[r].act.data();
    peers.counters[r] = ranks[r].counters.data();
  }
  for (int r = 0; r < TP; ++r) {
    ranks[r].p.rank = r;
    ranks[r].p.peers = &peers;
  }
#endif
  std::vector<float4> vec(MAX_K / 4 + 1), acc(ACC_FLOATS / 4 + 1);
  std::vector<float> red(MISC_FLOATS, NAN);
  std::vector<uint4> ring(RING_PAGES * PAGE_BYTES / 16);
  int flags[8] = {};
  Shared s{};
  s.ring = reinterpret_cast<uint8_t*>(ring.data());
  s.vec = reinterpret_cast<float*>(vec.data());
  s.red = red.data();
  s.acc = reinterpret_cast<float*>(acc.data());
  s.flags = flags;
  flags[FLAG_SAMPLE_MODE] = SAMPLE_GREEDY;
  bool exchanged = true;
  for (size_t id = 0; id < tasks.size() / TASK_FIELDS && exchanged; ++id) {
    const int* t = &tasks[id * TASK_FIELDS];
    for (Rank& k : ranks) {
      if (!load_pages(k, s, t, static_cast<int>(id), pos)) {
        std::printf("task %zu has more pages than the ring\n", id);
        return;
      }
      run_task(k, s, t, pos);
      if (k.issued >= 0 && k.issued != k.consumed) {
        std::printf("task %zu: the loader issued pages up to %lld, compute consumed up to %u\n", id, k.issued,
                    k.consumed);
        return;
      }
    }
#if TP > 1
    if (t[F_XCHG] >= 0)
      for (Rank& k : ranks) exchanged = finish_exchange(k, s, t, static_cast<int>(id)) && exchanged;
#endif
  }
  for (Rank& k : ranks) {
    write_file(k.dir + "/act.bin", k.act.data(), k.act.size() * 4);
    write_file(k.dir + "/kv.bin", k.kv.data(), k.kv.size() * 2);
    std::printf("%d %d\n", k.tokens[0], exchanged ? k.status[ST_ERROR] : -1);
  }
}
#endif  // HOST_STEP

int main() {
  char op[16];
  while (std::scanf("%15s", op) == 1) {
    if (!std::strcmp(op, "mix")) {
      unsigned long long x;
      std::scanf("%llu", &x);
      std::printf("%llu\n", static_cast<unsigned long long>(mix64(x)));
    } else if (!std::strcmp(op, "score")) {
      unsigned long long seed;
      long long pos;
      uint32_t temp_bits, logit_bits;
      int row;
      std::scanf("%llu %lld %u %u %d", &seed, &pos, &temp_bits, &logit_bits, &row);
      Sampling sp{};
      sp.seed = seed;
      const float v = gumbel_score(__uint_as_float(logit_bits), __uint_as_float(temp_bits), stream_key(sp, pos), row);
      std::printf("%u\n", __float_as_uint(v));
    } else if (!std::strcmp(op, "key")) {
      uint32_t b;
      std::scanf("%u", &b);
      const uint32_t k = order_key(__uint_as_float(b));
      std::printf("%u %u\n", k, __float_as_uint(key_float(k)));
    } else if (!std::strcmp(op, "select")) {
      select_command();
    } else if (!std::strcmp(op, "sample")) {
      sample_command();
#if MOE
    } else if (!std::strcmp(op, "route")) {
      route_command();
#endif
#if DSA
    } else if (!std::strcmp(op, "dsa_topk")) {
      dsa_topk_command();
#endif
#if HOST_STEP
    } else if (!std::strcmp(op, "step")) {
      step_command();
#endif
    }
    std::fflush(stdout);
  }
}
