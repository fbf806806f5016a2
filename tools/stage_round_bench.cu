// What one round of decode/tile_digits.cuh's stage_digits cost, and which part of it: staging an
// FP8 tile task's input as digits took ~0.75 us per round of 16 warps in the kernel (DeepSeek-V3.2
// o_proj: 8 rounds, ~6.4 us) whether or not it loaded its input (session 21, docs/performance.md),
// far more than its instructions and shared-memory wavefronts suggest. Every SM stages an input of
// K columns REPS times, one CTA of 16 warps (and, with SPIN, a 17th warp polling an mbarrier
// that never completes, as the kernel's loader does while the ring is full), each variant
// leaving out one part of the round:
//
//   base       the round as the device library had it until session 22: a warp a block, a lane 4
//              columns; x from global memory (L2), the block's largest |x| by 5 shuffles, the
//              block's piece / segment / 16-column chunk by run-time divisions, the four digit
//              words, 4 stores of 4 bytes (8-way bank conflicts) and the block's factor
//   noload     x made from the lane and round instead of loaded
//   nodiv      piece / segment / chunk advanced without dividing (branch divfree-staging)
//   noshfl     each lane's own largest |x| instead of the block's (wrong digits: timing only)
//   nostore    the words XORed into a register written once at the end (timing only)
//   spin       base with the polling warp
//   chunks     decode/tile_digits.cuh's stage_digits of sessions 22-24: 4 blocks a warp, 8 lanes
//              a block, a lane 16 columns (3 shuffles a block, one 16-byte store a digit, the stores'
//              digits rotated by lane against bank conflicts). Since session 25 the kernel
//              copies x in first (cp.async) and converts it in place with cheaper digit words
//              (docs/performance.md, session 25); this benchmark keeps the earlier rounds.
//
// base, nodiv and chunks must give the same digits (checked: a checksum of the staged bytes).
// Results: docs/performance.md, session 22. Build and run (on an H200):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o stage_round_bench tools/stage_round_bench.cu
//   ./stage_round_bench
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

constexpr int WARPS = 16, BLOCK = 128, DIGITS = 4, REPS = 16;
enum Variant { BASE = 0, NOLOAD = 1, NODIV = 2, NOSHFL = 3, NOSTORE = 4, SPIN = 5, CHUNKS = 6 };
const char* const NAMES[] = {"base", "noload", "nodiv", "noshfl", "nostore", "spin", "chunks"};

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at line %d\n", cudaGetErrorString(e_), __LINE__); exit(1); } } while (0)

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ int block_exponent(float amax) { return max(((__float_as_int(amax) >> 23) & 0xff) - 126, -100); }
// decode/tile_digits.cuh: fixed_columns and digit_word (4 columns as 16-bit fixed point with a
// block's exponent E; their digit t, a byte a column); digit_words: the four, as the base's round
// made them
struct FixedColumns {
  uint32_t m01, m23, sign;
};
__device__ __forceinline__ FixedColumns fixed_columns(const float4& x, int E) {
  const float up = __int_as_float((127 + 16 - E) << 23), v[4] = {x.x, x.y, x.z, x.w};
  uint32_t M[4], sign = 0;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    M[e] = min(__float_as_uint(fabsf(v[e]) * up + 8388608.f) & 0x7fffffu, 0xffffu);
    sign |= (__float_as_uint(v[e]) >> 31) << (8 * e + 7);
  }
  return {M[0] | M[1] << 16, M[2] | M[3] << 16, sign};
}
__device__ __forceinline__ uint32_t digit_word(const FixedColumns& f, int t) {
  const int shift = 12 - 4 * t;
  return __byte_perm((f.m01 >> shift) & 0x000f000fu, (f.m23 >> shift) & 0x000f000fu, 0x6420) | f.sign;
}
__device__ __forceinline__ void digit_words(const float4& x, int E, uint32_t (&words)[DIGITS]) {
  const FixedColumns f = fixed_columns(x, E);
#pragma unroll
  for (int t = 0; t < DIGITS; ++t) words[t] = digit_word(f, t);
}

struct Timing { long long cycles, ns; };
__device__ __forceinline__ Timing now() {
  Timing r{clock64(), 0};
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(r.ns));
  return r;
}

// One staging of k columns in pieces of kp (kp = k: one piece), S segments a piece.
template <int V>
__device__ void stage(const float4* x, int k, int kp, int S, uint8_t* b, float* factor, int rep, uint32_t& sink) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, blocks = k / BLOCK;
  const int per_piece = kp / BLOCK, per_segment = per_piece / S;
  int piece = warp / per_piece, j = warp % per_piece / per_segment, sb = warp % per_piece % per_segment;
  for (int blk = warp; blk < blocks; blk += WARPS) {
    const int i = blk * (BLOCK / 4) + lane;
    const float4 a = V == NOLOAD ? make_float4(lane + rep, 1.f - lane, 0.5f * blk, -2.f) : __ldcg(x + i);
    const float m = fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(a.z), fabsf(a.w)));
    const int E = block_exponent(V == NOSHFL ? m : warp_max(m));
    uint32_t words[DIGITS];
    digit_words(a, E, words);
    int at_piece = piece, at_j = j, at_sb = sb;
    if (V != NODIV) {
      const int pb = blk % per_piece;
      at_piece = blk / per_piece, at_j = pb / per_segment, at_sb = pb % per_segment;
    }
    const int chunk = at_sb * (BLOCK / 16) + lane / 4;
    uint8_t* at = b + at_piece * DIGITS * kp + chunk * 16 * DIGITS * S + 16 * DIGITS * at_j + 4 * (lane & 3);
    if (V == NOSTORE) {
#pragma unroll
      for (int n = 0; n < DIGITS; ++n) sink ^= words[n] + static_cast<uint32_t>(at - b);
    } else {
#pragma unroll
      for (int n = 0; n < DIGITS; ++n) *reinterpret_cast<uint32_t*>(at + 16 * n) = words[n];
      if (lane == 0) factor[blk] = __int_as_float((127 + E + 5) << 23);
    }
    if (V == NODIV)
      for (sb += WARPS; sb >= per_segment; sb -= per_segment)
        if (++j == S) {
          j = 0;
          ++piece;
        }
  }
}

// CHUNKS: decode/tile_digits.cuh's stage_digits (without the norm and the MoE combine)
__device__ void stage_chunks(const float4* x, int k, int kp, int S, uint8_t* b, float* factor) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, c = lane % 8, blocks = k / BLOCK;
  const int per_piece = kp / BLOCK, per_segment = per_piece / S;
  for (int first = 4 * warp; first < blocks; first += 4 * WARPS) {
    const int blk = first + lane / 8, i = blk * (BLOCK / 4) + 4 * c;
    float4 a[4];
    float m = 0.f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      a[q] = __ldcg(x + i + q);
      m = fmaxf(m, fmaxf(fmaxf(fabsf(a[q].x), fabsf(a[q].y)), fmaxf(fabsf(a[q].z), fabsf(a[q].w))));
    }
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const int E = block_exponent(m);
    FixedColumns f[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) f[q] = fixed_columns(a[q], E);
    const int pb = blk % per_piece, j = pb / per_segment, chunk = pb % per_segment * (BLOCK / 16) + c;
    uint8_t* at = b + blk / per_piece * DIGITS * kp + chunk * 16 * DIGITS * S + 16 * DIGITS * j;
#pragma unroll
    for (int r = 0; r < DIGITS; ++r) {
      const int n = (c + r) % DIGITS;
      *reinterpret_cast<uint4*>(at + 16 * n) =
          make_uint4(digit_word(f[0], n), digit_word(f[1], n), digit_word(f[2], n), digit_word(f[3], n));
    }
    if (c == 0) factor[blk] = __int_as_float((127 + E + 5) << 23);
  }
}

template <int V>
__global__ void __launch_bounds__((WARPS + 1) * 32, 1) bench(const float4* x, int k, int kp, int S, Timing* out,
                                                                unsigned long long* sums) {
  extern __shared__ __align__(16) uint8_t smem[];
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem);
  volatile int* done = reinterpret_cast<volatile int*>(smem + 8);
  uint8_t* b = smem + 16;
  float* factor = reinterpret_cast<float*>(b + DIGITS * k);
  const uint32_t bar_addr = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(bar_addr));
    *done = 0;
  }
  __syncthreads();
  if (threadIdx.x >= WARPS * 32) {  // the loader's place: polls a phase that never completes
    if (V == SPIN && threadIdx.x == WARPS * 32) {
      uint32_t ok = 0;
      while (!*done) {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                     : "=r"(ok) : "r"(bar_addr) : "memory");
      }
    }
    return;
  }
  uint32_t sink = 0;
  asm volatile("bar.sync 1, %0;" ::"n"(WARPS * 32));
  const Timing t0 = now();
  for (int r = 0; r < REPS; ++r) {
    if (V == CHUNKS)
      stage_chunks(x, k, kp, S, b, factor);
    else
      stage<V>(x, k, kp, S, b, factor, r, sink);
    asm volatile("bar.sync 1, %0;" ::"n"(WARPS * 32) : "memory");
  }
  const Timing t1 = now();
  if (threadIdx.x == 0) {
    *done = 1;
    out[blockIdx.x] = {t1.cycles - t0.cycles, t1.ns - t0.ns};
  }
  unsigned long long sum = sink;  // the staged bytes' checksum (the last rep's), per thread
  for (int i = threadIdx.x; i < DIGITS * k / 4; i += WARPS * 32) sum += reinterpret_cast<const uint32_t*>(b)[i] * (i + 1ull);
  atomicAdd(sums + blockIdx.x, sum);
}

template <int V>
static void run(const float4* dx, int k, int kp, int S, int sms) {
  Timing* dout;
  unsigned long long* dsum;
  CK(cudaMalloc(&dout, sms * sizeof(Timing)));
  CK(cudaMalloc(&dsum, sms * sizeof(unsigned long long)));
  const size_t smem = 16 + DIGITS * k + 4 * (k / BLOCK);
  CK(cudaFuncSetAttribute(bench<V>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  for (int warm = 0; warm < 2; ++warm) {
    CK(cudaMemset(dsum, 0, sms * sizeof(unsigned long long)));
    bench<V><<<sms, (WARPS + 1) * 32, smem>>>(dx, k, kp, S, dout, dsum);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
  }
  std::vector<Timing> t(sms);
  std::vector<unsigned long long> sums(sms);
  CK(cudaMemcpy(t.data(), dout, sms * sizeof(Timing), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(sums.data(), dsum, sms * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  std::vector<long long> c, n;
  for (const Timing& x : t) { c.push_back(x.cycles); n.push_back(x.ns); }
  std::sort(c.begin(), c.end());
  std::sort(n.begin(), n.end());
  const int rounds = (k / BLOCK + WARPS - 1) / WARPS;  // (of the base: cycles per 16 blocks)
  printf("k %5d pieces %d  %-8s  staging %7.2f us  round %6.0f cycles  (median of %d SMs)  checksum %016llx\n", k,
         k / kp, NAMES[V], n[sms / 2] / 1e3 / REPS, static_cast<double>(c[sms / 2]) / REPS / rounds, sms, sums[0]);
  cudaFree(dout);
  cudaFree(dsum);
}

int main() {
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::mt19937 rng(21);
  std::normal_distribution<float> normal(0.f, 1.f);
  // (k, piece): DeepSeek-V3.2's o_proj (16384), its dense down (18432), a MoE down of 9 pieces
  // of 2048 (18432), the MoE gate/up (7168)
  const int shapes[][2] = {{16384, 16384}, {18432, 18432}, {18432, 2048}, {7168, 7168}};
  for (const auto& sh : shapes) {
    const int k = sh[0], kp = sh[1], S = kp % 1024 == 0 ? 8 : 4;
    std::vector<float> x(k);
    for (float& v : x) v = normal(rng) * std::exp2(static_cast<float>(static_cast<int>(rng() % 8)) - 4.f);
    float4* dx;
    CK(cudaMalloc(&dx, k * 4));
    CK(cudaMemcpy(dx, x.data(), k * 4, cudaMemcpyHostToDevice));
    run<BASE>(dx, k, kp, S, sms);
    run<NOLOAD>(dx, k, kp, S, sms);
    run<NODIV>(dx, k, kp, S, sms);
    run<NOSHFL>(dx, k, kp, S, sms);
    run<NOSTORE>(dx, k, kp, S, sms);
    run<SPIN>(dx, k, kp, S, sms);
    run<CHUNKS>(dx, k, kp, S, sms);
    cudaFree(dx);
  }
  return 0;
}
