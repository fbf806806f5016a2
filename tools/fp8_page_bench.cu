// What one 64 KB page of FP8 weights costs the 16 compute warps of one SM, with the page already
// in shared memory (no HBM): the question is whether compute keeps up with the SM's share of HBM
// (~32 KB/us on an H200), and which way of multiplying makes it.
//
//   V0   today's CUDA-core path (a copy of decode/dot.cuh's dot_groups of Fp8Row, so that this file
//        builds alone; warps per row as matvec_pages)
//   V1   V0 with the e4m3 -> f16x2 conversion done by integer bit operations (value x 2^-8)
//   V4   V0 with each e4m3 byte moved into fp32 bits by integer operations (value x 2^-120)
//   V2   mma.sync m16n8k32 e4m3 (weights as B, x as A): on sm_90a ptxas lowers it to e4m3 -> f16
//        conversions and HMMA.16816, so it pays the same conversions as V0
//   V3   wgmma m64n8k32 e4m3 (QGMMA: the weights are never converted): A = 64 weight rows x 1024
//        columns in the page, K-major core matrices without swizzle; B = x as T = 4 e4m3 "digit"
//        planes: per 128-column block with max|x| < 2^E, M = rint(|x| 2^(16 - E)) and digit t
//        is nibble t of M with x's sign, a byte whose e4m3 value is n 2^-9 (0..15 are exact), so
//        x = sum_t value_t 2^(E + 5 - 4t); D's columns are the terms
//   V3n  the same page with m64n16k32 and m64n32k32 (timing only: room for k segments as columns)
//   V5   the tile the kernel would run: 8 weight rows x 8 k segments as the 64 M-rows, D's 32
//        columns (segment, term); units of C columns of every segment with the tile's block
//        scales; x staged from global memory into the digits' core matrices; the row sums of a
//        whole tile (every unit) against float64. The kernel has run this since session 17
//        (decode/tile_digits.cuh: stage_digits, tile_pages, `--tune fp8_mma=1`), with units of
//        at most 256 columns and a 16-row x 4-segment shape as well; V5 stays as it was measured.
//
// Each variant checks its row sums against float64 on the host. Build and run (on an H200):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o fp8_page_bench tools/fp8_page_bench.cu
//   ./fp8_page_bench
// Results: docs/performance.md, "FP8 pages on the tensor cores".
#include <cuda_fp8.h>
#include <cuda_fp16.h>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cmath>
#include <vector>
#include <algorithm>
#include <random>

constexpr int PAGE = 65536, WARPS = 16, NT = WARPS * 32, REPS = 64;

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---- V0: today's path -------------------------------------------------------------------
template <int CONV>
struct Fp8RowT {
  struct Group { uint32_t q; float scale; };
  const uint32_t* w; const float* scale;
  __device__ Group load(int i) const { return {w[i], scale[i >> 5]}; }
  __device__ static float dot(const Group g, const float4 a, float acc) {
    if (CONV == 0) {
      const float2 w0 = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>(g.q & 0xffffu), __NV_E4M3)));
      const float2 w1 = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>(g.q >> 16), __NV_E4M3)));
      float d = w0.x * a.x; d = fmaf(w0.y, a.y, d); d = fmaf(w1.x, a.z, d); d = fmaf(w1.y, a.w, d);
      return fmaf(d, g.scale, acc);
    } else if (CONV == 1) {  // bytes 0, 2 and 1, 3 as f16x2 of value e4m3 * 2^-8
      const uint32_t w = g.q, v = w << 8;
      const uint32_t h02 = (v & 0x80008000u) | ((v >> 1) & 0x3f803f80u);
      const uint32_t h13 = (w & 0x80008000u) | ((w >> 1) & 0x3f803f80u);
      const float2 w02 = __half22float2(*reinterpret_cast<const __half2*>(&h02));
      const float2 w13 = __half22float2(*reinterpret_cast<const __half2*>(&h13));
      float d = w02.x * a.x; d = fmaf(w13.x, a.y, d); d = fmaf(w02.y, a.z, d); d = fmaf(w13.y, a.w, d);
      return fmaf(d, g.scale * 256.f, acc);
    } else {  // each byte as f32 bits of value e4m3 * 2^-120 (subnormals as fp32 denormals)
      const uint32_t w = g.q;
      const float f0 = __uint_as_float(((w << 24) & 0x80000000u) | ((w << 20) & 0x07f00000u));
      const float f1 = __uint_as_float(((w << 16) & 0x80000000u) | ((w << 12) & 0x07f00000u));
      const float f2 = __uint_as_float(((w << 8) & 0x80000000u) | ((w << 4) & 0x07f00000u));
      const float f3 = __uint_as_float((w & 0x80000000u) | ((w >> 4) & 0x07f00000u));
      float d = f0 * a.x; d = fmaf(f1, a.y, d); d = fmaf(f2, a.z, d); d = fmaf(f3, a.w, d);
      return fmaf(d, g.scale * 1.329227995784916e36f, acc);  // 2^120
    }
  }
};
template <class Fp8Row, int N>
__device__ __forceinline__ void dot_groups(const Fp8Row (&row)[N], const float* x, int begin, int end, int lane, float (&y)[N]) {
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float acc[4 * N] = {};
  int i = 2 * begin + lane;
  const int stop = 2 * end;
  for (; i + 96 < stop; i += 128) {
    typename Fp8Row::Group q[N][4]; float4 a[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
#pragma unroll
      for (int n = 0; n < N; ++n) q[n][u] = row[n].load(i + 32 * u);
      a[u] = x4[i + 32 * u];
    }
#pragma unroll
    for (int j = 0; j < 4 * N; ++j) acc[j] = Fp8Row::dot(q[j / 4][j % 4], a[j % 4], acc[j]);
  }
  for (; i < stop; i += 32) {
#pragma unroll
    for (int n = 0; n < N; ++n) acc[4 * n] = Fp8Row::dot(row[n].load(i), x4[i], acc[4 * n]);
  }
  y[0] = warp_sum((acc[0] + acc[1]) + (acc[2] + acc[3]));
  if (N == 2) y[N - 1] = warp_sum((acc[4 * N - 4] + acc[4 * N - 3]) + (acc[4 * N - 2] + acc[4 * N - 1]));
}

__device__ int warps_per_row(int n) { int w = 1; while (w * 2 * n <= WARPS) w *= 2; return w; }

template <int CONV>
__device__ void page_v0(const uint8_t* page, int n, int rb, int k, int halves, const float* x, float* acc) {
  const int ct = threadIdx.x, lane = ct & 31, gw = ct >> 5, k8 = k / 8;
  const int wpr = warps_per_row(n), seg = (k8 + wpr - 1) / wpr;
  const int begin = (gw % wpr) * seg, end = min(k8, begin + seg);
  using Fp8Row = Fp8RowT<CONV>;
  const int hb = rb / halves;
  for (int rr = gw / wpr; rr < n; rr += WARPS / wpr) {
    if (halves == 2) {
      const Fp8Row rows[2] = {{(const uint32_t*)(page + rr * rb), (const float*)(page + rr * rb + k)},
                              {(const uint32_t*)(page + rr * rb + hb), (const float*)(page + rr * rb + hb + k)}};
      float y[2];
      dot_groups(rows, x, begin, end, lane, y);
      if (lane == 0) { atomicAdd(acc + 2 * rr, y[0]); atomicAdd(acc + 2 * rr + 1, y[1]); }
    } else {
      const Fp8Row rows[1] = {{(const uint32_t*)(page + rr * rb), (const float*)(page + rr * rb + k)}};
      float y[1];
      dot_groups(rows, x, begin, end, lane, y);
      if (lane == 0) atomicAdd(acc + rr, y[0]);
    }
  }
}

// ---- V2: native e4m3 mma ---------------------------------------------------------------
__device__ __forceinline__ void mma_e4m3(float (&d)[4], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}

// planes: T planes of `pstride` bytes; xs[blk * 8 + t]: the term's factor in block blk.
template <int T>
__device__ void page_v2(const uint8_t* page, int n, int rb, int k, int halves, const uint8_t* planes, int pstride,
                        const float* xs, float* acc) {
  const int ct = threadIdx.x, lane = ct & 31, gw = ct >> 5, g = lane >> 2, q = lane & 3;
  const int nw = n * halves, hb = rb / halves, spans = k / 64;
  const int s0 = gw * spans / WARPS, s1 = (gw + 1) * spans / WARPS;
  // this lane's weight row (B column g) and its scales; the rows of D columns 2q, 2q+1
  const uint8_t* brow = page + (g / halves) * rb + (g % halves) * hb;
  const bool has_b = g < nw;
  const int r0 = 2 * q, r1 = 2 * q + 1;
  const float* sc0 = reinterpret_cast<const float*>(page + (r0 / halves) * rb + (r0 % halves) * hb + k);
  const float* sc1 = reinterpret_cast<const float*>(page + (r1 / halves) * rb + (r1 % halves) * hb + k);
  const uint8_t* arow = planes + g * pstride;
  const bool has_a = g < T;
  float y0 = 0.f, y1 = 0.f;
  float da[4] = {}, db[4] = {};
  for (int s = s0; s < s1; ++s) {
    const int col = s * 64 + 16 * q;
    const uint4 b = has_b ? *reinterpret_cast<const uint4*>(brow + col) : make_uint4(0, 0, 0, 0);
    const uint4 a = has_a ? *reinterpret_cast<const uint4*>(arow + col) : make_uint4(0, 0, 0, 0);
    mma_e4m3(da, a.x, a.y, b.x, b.y);
    mma_e4m3(db, a.z, a.w, b.z, b.w);
    if ((s & 1) || s == s1 - 1) {  // end of a 128-column block in this segment
      const int blk = s >> 1;
      const float f = has_a ? xs[blk * 8 + g] : 0.f;
      const float w0 = r0 < nw ? sc0[blk] : 0.f, w1 = r1 < nw ? sc1[blk] : 0.f;
      y0 = fmaf(da[0] + db[0], w0 * f, y0);
      y1 = fmaf(da[1] + db[1], w1 * f, y1);
#pragma unroll
      for (int j = 0; j < 4; ++j) da[j] = db[j] = 0.f;
    }
  }
  for (int o = 4; o < 32; o <<= 1) {
    y0 += __shfl_xor_sync(0xffffffffu, y0, o);
    y1 += __shfl_xor_sync(0xffffffffu, y1, o);
  }
  if (g == 0) {
    if (r0 < nw) atomicAdd(acc + r0, y0);
    if (r1 < nw) atomicAdd(acc + r1, y1);
  }
}

// x as e4m3 digits (V2, V3, V5): a block with max|x| < 2^E scales to M = rint(|x| 2^(16 - E))
// < 2^16; digit t is nibble t of M (most significant first) with x's sign, a byte whose e4m3 value
// is n 2^-9, so that x = sum_t value_t digit_factor(E, t).
__device__ __forceinline__ int block_exponent(float amax) {  // max < 2^E; zero block: any E
  return max(((__float_as_int(amax) >> 23) & 0xff) - 126, -100);
}
__device__ __forceinline__ float digit_factor(int E, int t) { return __int_as_float((127 + E + 5 - 4 * t) << 23); }
// the 4 digit words (digit t of 4 consecutive columns, one byte each) of columns x[0..3]
__device__ __forceinline__ void digit_words(const float* x, int E, uint32_t (&words)[4]) {
  const float up = __int_as_float((127 + 16 - E) << 23);
  uint32_t M[4], sgn = 0;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    M[e] = min(__float_as_uint(fabsf(x[e]) * up + 8388608.f) & 0x7fffffu, 0xffffu);
    sgn |= (__float_as_uint(x[e]) >> 31) << (8 * e + 7);
  }
  const uint32_t p01 = M[0] | (M[1] << 16), p23 = M[2] | (M[3] << 16);
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const int sh = 12 - 4 * t;
    words[t] = __byte_perm((p01 >> sh) & 0x000f000fu, (p23 >> sh) & 0x000f000fu, 0x6420) | sgn;
  }
}

// x (global fp32) -> T digit planes + per-block factors, a warp per 128-column block.
__device__ void stage_digits(const float* xg, int k, uint8_t* planes, int pstride, float* xs) {
  const int ct = threadIdx.x, lane = ct & 31, warp = ct >> 5;
  for (int blk = warp; blk < k / 128; blk += WARPS) {
    const float4 v = __ldcg(reinterpret_cast<const float4*>(xg) + blk * 32 + lane);
    float m = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const int E = block_exponent(m);
    uint32_t words[4];
    digit_words(reinterpret_cast<const float*>(&v), E, words);
#pragma unroll
    for (int t = 0; t < 4; ++t) *reinterpret_cast<uint32_t*>(planes + t * pstride + blk * 128 + 4 * lane) = words[t];
    if (lane < 4) xs[blk * 8 + lane] = digit_factor(E, lane);
  }
}

__device__ void stage_fp32(const float* xg, int k, float* x) {
  for (int i = threadIdx.x; i < k / 4; i += NT)
    reinterpret_cast<float4*>(x)[i] = __ldcg(reinterpret_cast<const float4*>(xg) + i);
}

struct Result { long long cycles; long long ns; };
// The SM's clock and the global timer at one point; a timed span is the difference of two.
__device__ __forceinline__ Result stamp() {
  Result r{clock64(), 0};
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(r.ns));
  return r;
}
__device__ __forceinline__ Result span(const Result& a, const Result& b) { return {b.cycles - a.cycles, b.ns - a.ns}; }

template <int V>
__global__ void __launch_bounds__(NT, 1) bench(const uint8_t* gpage, const float* gx, int n, int rb, int k, int halves,
                                               float* out, Result* res, int pstride) {
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* page = smem;
  float* acc = reinterpret_cast<float*>(smem + PAGE);            // 16 floats
  float* xs = acc + 16;                                           // k/128 * 8 floats
  uint8_t* xbuf = reinterpret_cast<uint8_t*>(xs + k / 128 * 8);  // fp32 x (V0) or planes (V2)
  for (int i = threadIdx.x; i < PAGE / 16; i += NT) reinterpret_cast<uint4*>(page)[i] = reinterpret_cast<const uint4*>(gpage)[i];
  __syncthreads();
  // staging timed (once per task)
  const Result s0 = stamp();
  if (V != 2) stage_fp32(gx, k, reinterpret_cast<float*>(xbuf));
  else stage_digits(gx, k, xbuf, pstride, xs);
  __syncthreads();
  const Result s1 = stamp();
  for (int r = 0; r < REPS; ++r) {
    if (threadIdx.x < 16) acc[threadIdx.x] = 0.f;
    __syncthreads();
    if (V == 0) page_v0<0>(page, n, rb, k, halves, reinterpret_cast<float*>(xbuf), acc);
    else if (V == 1) page_v0<1>(page, n, rb, k, halves, reinterpret_cast<float*>(xbuf), acc);
    else if (V == 4) page_v0<2>(page, n, rb, k, halves, reinterpret_cast<float*>(xbuf), acc);
    else page_v2<4>(page, n, rb, k, halves, xbuf, pstride, xs, acc);
    __syncthreads();
  }
  const Result s2 = stamp();
  if (threadIdx.x == 0) {
    res[blockIdx.x * 2] = span(s0, s1);
    res[blockIdx.x * 2 + 1] = span(s1, s2);
    if (blockIdx.x == 0) for (int i = 0; i < 16; ++i) out[i] = acc[i];
  }
}

// A random e4m3 byte (never NaN: 0x7f / 0xff).
static uint8_t random_e4m3(std::mt19937& rng) {
  uint8_t b;
  do b = rng() & 0xff; while ((b & 0x7f) == 0x7f);
  return b;
}
// A random block scale: 2^-6 .. 2^-11.
static float random_scale(std::mt19937& rng) { return ldexpf(1.f, -(int)(rng() % 6) - 6); }
// x: normal, one column in 64 thirty times larger (activation outliers).
static std::vector<float> random_x(std::mt19937& rng, int k) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(k);
  for (float& v : x) v = nd(rng) * ((rng() % 64) == 0 ? 30.f : 1.f);
  return x;
}
// Byte offset of (M-row m, column c) in a wgmma A operand of 64 rows: K-major core matrices
// without swizzle, k32 step c / 32 at 2048, its 16-byte chunks 1024 apart, 8-row groups 128.
static int core_offset(int m, int c) { return (c / 32) * 2048 + ((c % 32) / 16) * 1024 + (m / 8) * 128 + (m % 8) * 16 + c % 16; }

static float e4m3_value(uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  const float v = e == 0 ? ldexpf(m / 8.f, -6) : ldexpf(1.f + m / 8.f, e - 7);
  return s ? -v : v;
}

#define CK(x) do { cudaError_t err = (x); if (err != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(err), __LINE__); exit(1);} } while (0)

// The median over the CTAs of each of a run's `per_cta` timed spans (stage, then pages).
struct Medians { long long cycles[2], ns[2]; };
static Medians medians(const std::vector<Result>& res, int sms, int per_cta) {
  Medians m{};
  for (int i = 0; i < per_cta; ++i) {
    std::vector<long long> c, n;
    for (int b = 0; b < sms; ++b) { c.push_back(res[per_cta * b + i].cycles); n.push_back(res[per_cta * b + i].ns); }
    std::sort(c.begin(), c.end()); std::sort(n.begin(), n.end());
    m.cycles[i] = c[sms / 2]; m.ns[i] = n[sms / 2];
  }
  return m;
}


// ---- V3: wgmma m64n8k32 e4m3 (QGMMA), A = 64 weight rows x 1024 k in the page (no swizzle,
// K-major core matrices: k32 step s at s*2048, its two 16-byte k chunks 1024 apart (LBO), 8-row
// groups 128 apart (SBO)); B = x digits, core matrices of 8 terms x 16 k bytes, 128 B each.
__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return static_cast<uint64_t>((a & 0x3ffff) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32);
}
__device__ __forceinline__ void wgmma_e4m3(float (&d)[4], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0,%1,%2,%3}, %4, %5, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(da), "l"(db), "r"(accumulate));
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

// one page (64 rows x 1024 k) of a task whose x chunk starts at xb (core layout); scales ws[8]
__device__ __forceinline__ void page_v3(const uint8_t* page, const uint8_t* xb, const float* ws, const float* xs,
                                        float (&y)[2]) {
  const int ct = threadIdx.x, wg = ct >> 7, lane = ct & 31, q = lane & 3;
  float da[4], db[4];
  wg_fence();
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int s = 8 * wg + j;
    wgmma_e4m3(da, smem_desc(page + s * 2048, 1024, 128), smem_desc(xb + s * 256, 128, 256), j);
  }
  wg_commit();
#pragma unroll
  for (int j = 4; j < 8; ++j) {
    const int s = 8 * wg + j;
    wgmma_e4m3(db, smem_desc(page + s * 2048, 1024, 128), smem_desc(xb + s * 256, 128, 256), j - 4);
  }
  wg_commit();
  wg_wait<1>();
  {
    const int blk = 2 * wg;
    const float f0 = ws[blk] * xs[blk * 8 + 2 * q], f1 = ws[blk] * xs[blk * 8 + 2 * q + 1];
    y[0] = fmaf(da[0], f0, fmaf(da[1], f1, y[0]));
    y[1] = fmaf(da[2], f0, fmaf(da[3], f1, y[1]));
  }
  wg_wait<0>();
  {
    const int blk = 2 * wg + 1;
    const float f0 = ws[blk] * xs[blk * 8 + 2 * q], f1 = ws[blk] * xs[blk * 8 + 2 * q + 1];
    y[0] = fmaf(db[0], f0, fmaf(db[1], f1, y[0]));
    y[1] = fmaf(db[2], f0, fmaf(db[3], f1, y[1]));
  }
}

// x (global fp32, k) -> digit core matrices: a lane takes 16 consecutive columns (one chunk),
// 8 lanes a 128-column block; terms 4..7 are zero; stores rotate the term by lane so that a
// phase's 8 lanes hit 8 distinct 16-byte bank groups.
__device__ void stage_core(const float* xg, int k, uint8_t* xb, float* xs) {
  const int ct = threadIdx.x, lane = ct & 31;
  for (int c = ct; c < k / 16; c += NT) {
    float v[16];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const float4 a = __ldcg(reinterpret_cast<const float4*>(xg) + 4 * c + u);
      v[4 * u] = a.x; v[4 * u + 1] = a.y; v[4 * u + 2] = a.z; v[4 * u + 3] = a.w;
    }
    float m = 0.f;
#pragma unroll
    for (int e = 0; e < 16; ++e) m = fmaxf(m, fabsf(v[e]));
    for (int o = 1; o < 8; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const int E = block_exponent(m);
    uint32_t wd[4][4];  // wd[w][t]: digit t of columns 4w..4w+3
#pragma unroll
    for (int w = 0; w < 4; ++w) digit_words(v + 4 * w, E, wd[w]);
    uint4 words[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) words[t] = t < 4 ? make_uint4(wd[0][t], wd[1][t], wd[2][t], wd[3][t]) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const int tt = (t + lane) & 7;
      uint4 w = words[0];
#pragma unroll
      for (int j = 1; j < 8; ++j) if (tt == j) w = words[j];
      *reinterpret_cast<uint4*>(xb + c * 128 + tt * 16) = w;
    }
    if ((lane & 7) == 0)
      for (int t = 0; t < 4; ++t) xs[(c >> 3) * 8 + t] = digit_factor(E, t);
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__global__ void __launch_bounds__(NT, 1) bench3(const uint8_t* gpage, const float* gws, const float* gx, int k,
                                                float* out, Result* res) {
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* page = smem;
  float* acc = reinterpret_cast<float*>(smem + PAGE);  // 64 rows x 4 warpgroups
  float* ws = acc + 256;                                 // 8
  float* xs = ws + 8;                                    // k/128 * 8
  uint8_t* xb = reinterpret_cast<uint8_t*>(xs + k / 128 * 8);  // 8 k bytes, 128-aligned below
  xb = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(xb) + 127) & ~uintptr_t(127));
  for (int i = threadIdx.x; i < PAGE / 16; i += NT) reinterpret_cast<uint4*>(page)[i] = reinterpret_cast<const uint4*>(gpage)[i];
  if (threadIdx.x < 8) ws[threadIdx.x] = gws[threadIdx.x];
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const Result s0 = stamp();
  stage_core(gx, k, xb, xs);
  __syncthreads();
  const Result s1 = stamp();
  float y[2] = {0.f, 0.f};
  for (int r = 0; r < REPS; ++r) {
    page_v3(page, xb, ws, xs, y);
    __syncthreads();
  }
  const Result s2 = stamp();
  // rows 16 w + g and + 8 of this warpgroup's k half: sum over the quad's terms, then warpgroups
  const int ct = threadIdx.x, wg = ct >> 7, w = (ct >> 5) & 3, lane = ct & 31, g = lane >> 2;
  for (int o = 1; o < 4; o <<= 1) { y[0] += __shfl_xor_sync(0xffffffffu, y[0], o); y[1] += __shfl_xor_sync(0xffffffffu, y[1], o); }
  if ((lane & 3) == 0) { acc[wg * 64 + 16 * w + g] = y[0]; acc[wg * 64 + 16 * w + g + 8] = y[1]; }
  __syncthreads();
  if (ct < 64) out[blockIdx.x == 0 ? ct : 64] = acc[ct] + acc[64 + ct] + acc[128 + ct] + acc[192 + ct];
  if (ct == 0) { res[blockIdx.x * 2] = span(s0, s1); res[blockIdx.x * 2 + 1] = span(s1, s2); }
}

static void run_v3(int sms, std::mt19937& rng, int kx) {
  // one page: 64 rows x 1024 columns; x of kx columns staged (timing of staging), the page uses its first 1024
  std::vector<uint8_t> w(64 * 1024), page(PAGE);
  for (auto& b : w) b = random_e4m3(rng);
  for (int r = 0; r < 64; ++r)
    for (int c = 0; c < 1024; ++c) page[core_offset(r, c)] = w[r * 1024 + c];
  float ws[8];
  for (float& s : ws) s = random_scale(rng);
  const std::vector<float> x = random_x(rng, kx);
  std::vector<double> ref(64);
  double mag = 0;
  for (int r = 0; r < 64; ++r) {
    double s = 0;
    for (int c = 0; c < 1024; ++c) s += (double)e4m3_value(w[r * 1024 + c]) * ws[c / 128] * x[c];
    ref[r] = s; mag = std::max(mag, fabs(s));
  }
  uint8_t* dpage; float *dws, *dx, *dout; Result* dres;
  CK(cudaMalloc(&dpage, PAGE)); CK(cudaMalloc(&dws, 32)); CK(cudaMalloc(&dx, kx * 4)); CK(cudaMalloc(&dout, 65 * 4));
  CK(cudaMalloc(&dres, sms * 2 * sizeof(Result)));
  CK(cudaMemcpy(dpage, page.data(), PAGE, cudaMemcpyHostToDevice)); CK(cudaMemcpy(dws, ws, 32, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dx, x.data(), kx * 4, cudaMemcpyHostToDevice));
  const size_t sm = PAGE + 256 * 4 + 32 + (kx / 128) * 32 + 8 * kx + 256;
  CK(cudaFuncSetAttribute(bench3, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm));
  for (int i = 0; i < 2; ++i) bench3<<<sms, NT, sm>>>(dpage, dws, dx, kx, dout, dres);
  CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
  std::vector<Result> res(sms * 2); float out[64];
  CK(cudaMemcpy(res.data(), dres, res.size() * sizeof(Result), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(out, dout, 256, cudaMemcpyDeviceToHost));
  const Medians md = medians(res, sms, 2);
  double err = 0; for (int i = 0; i < 64; ++i) { out[i] /= REPS; err = std::max(err, fabs(out[i] - ref[i])); }
  const double page_ns = (double)md.ns[1] / REPS;
  printf("wgmma 64x1024 (x staged: k %5d)  V3 | stage %6lld cyc %6.0f ns | page %6lld cyc %6.0f ns (%.1f KB/us at 1 SM) | max err %.2e of max|y| %.2e (y0 %.4f ref %.4f)\n",
         kx, md.cycles[0], (double)md.ns[0], md.cycles[1] / REPS, page_ns, 65536.0 / page_ns * 1000 / 1024, err / mag, mag, out[0], ref[0]);
  cudaFree(dpage); cudaFree(dws); cudaFree(dx); cudaFree(dout); cudaFree(dres);
}


// ---- V3n: the same page with m64nNk32 (N = 16, 32: k segments of fewer rows), timing only ----
template <int N> struct Wg;
template <> struct Wg<16> {
  static __device__ __forceinline__ void mma(float (&d)[8], uint64_t da, uint64_t db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "l"(da), "l"(db), "r"(acc));
  }
};
template <> struct Wg<32> {
  static __device__ __forceinline__ void mma(float (&d)[16], uint64_t da, uint64_t db, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "l"(da), "l"(db), "r"(acc));
  }
};
template <int N>
__global__ void __launch_bounds__(NT, 1) bench3n(const uint8_t* gpage, float* out, Result* res) {
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* page = smem;
  uint8_t* xb = smem + PAGE;  // N x 1024 digits: chunk kc at kc * N * 16
  for (int i = threadIdx.x; i < PAGE / 16; i += NT) reinterpret_cast<uint4*>(page)[i] = reinterpret_cast<const uint4*>(gpage)[i];
  for (int i = threadIdx.x; i < N * 1024 / 16; i += NT) reinterpret_cast<uint4*>(xb)[i] = reinterpret_cast<const uint4*>(gpage)[i];
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const int wg = threadIdx.x >> 7;
  float y = 0.f;
  const Result s1 = stamp();
  for (int r = 0; r < REPS; ++r) {
    float da[N / 2], db[N / 2];
    wg_fence();
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int s = 8 * wg + j;
      Wg<N>::mma(da, smem_desc(page + s * 2048, 1024, 128), smem_desc(xb + s * 2 * N * 16, N * 16, 128), j);
    }
    wg_commit();
#pragma unroll
    for (int j = 4; j < 8; ++j) {
      const int s = 8 * wg + j;
      Wg<N>::mma(db, smem_desc(page + s * 2048, 1024, 128), smem_desc(xb + s * 2 * N * 16, N * 16, 128), j - 4);
    }
    wg_commit();
    wg_wait<1>();
#pragma unroll
    for (int i = 0; i < N / 2; ++i) y = fmaf(da[i], 0.5f, y);
    wg_wait<0>();
#pragma unroll
    for (int i = 0; i < N / 2; ++i) y = fmaf(db[i], 0.25f, y);
    __syncthreads();
  }
  const Result s2 = stamp();
  out[blockIdx.x * NT + threadIdx.x] = y;
  if (threadIdx.x == 0) res[blockIdx.x] = span(s1, s2);
}

template <int N>
static void run_v3n(int sms) {
  std::vector<uint8_t> page(PAGE);
  for (size_t i = 0; i < page.size(); ++i) page[i] = (i * 7 + 3) & 0x77;
  uint8_t* dpage; float* dout; Result* dres;
  CK(cudaMalloc(&dpage, PAGE)); CK(cudaMalloc(&dout, sms * NT * 4)); CK(cudaMalloc(&dres, sms * sizeof(Result)));
  CK(cudaMemcpy(dpage, page.data(), PAGE, cudaMemcpyHostToDevice));
  const size_t sm = PAGE + N * 1024;
  CK(cudaFuncSetAttribute(bench3n<N>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm));
  for (int i = 0; i < 2; ++i) bench3n<N><<<sms, NT, sm>>>(dpage, dout, dres);
  CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
  std::vector<Result> res(sms);
  CK(cudaMemcpy(res.data(), dres, res.size() * sizeof(Result), cudaMemcpyDeviceToHost));
  const Medians md = medians(res, sms, 1);
  printf("wgmma m64n%dk32 64x1024 page: %6lld cyc %6.0f ns\n", N, md.cycles[0] / REPS, (double)md.ns[0] / REPS);
  cudaFree(dpage); cudaFree(dout); cudaFree(dres);
}

// ---- V5: a whole tile as the kernel would run it: 8 rows x S = 8 k segments as the 64 M-rows,
// D's 32 columns = (segment j, term t) at n = 4 j + t (m64n32k32); units of C columns of every
// segment (values, then the 8 x C/128 block scales of the tile's rows); x staged straight from
// global memory into the digits' core matrices (512 B per 16 columns of a segment: column n at
// n * 16), loads first. Checks the 8 row sums against float64.
constexpr int S8 = 8, MAXC = 3;  // segments; chunks of 16 columns a thread stages at most
__device__ __forceinline__ void stage_tile_digits(const float* xg, int k, uint8_t* xb, float* xs) {
  const int ct = threadIdx.x, lane = ct & 31, kseg = k / S8, cps = kseg / 16;  // chunks per segment
  float4 v[MAXC][4];
#pragma unroll
  for (int i = 0; i < MAXC; ++i) {
    const int c = ct + i * NT;
#pragma unroll
    for (int u = 0; u < 4; ++u)
      v[i][u] = c < k / 16 ? __ldcg(reinterpret_cast<const float4*>(xg) + 4 * c + u) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
#pragma unroll
  for (int i = 0; i < MAXC; ++i) {
    const int c = ct + i * NT;
    if (i * NT >= k / 16) break;  // uniform: whole warps stage or not (k / 16 is a multiple of 32)
    const float* e = reinterpret_cast<const float*>(v[i]);
    float m = 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j) m = fmaxf(m, fabsf(e[j]));
    for (int o = 1; o < 8; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (c >= k / 16) continue;
    const int E = block_exponent(m);
    uint32_t wd[4][4];  // wd[w][t]: digit t of columns 4w..4w+3
#pragma unroll
    for (int w = 0; w < 4; ++w) digit_words(e + 4 * w, E, wd[w]);
    const int j = c / cps, kc = c % cps;
#pragma unroll
    for (int t0 = 0; t0 < 4; ++t0) {
      const int t = (t0 + lane) & 3;
      uint4 wv = make_uint4(wd[0][0], wd[1][0], wd[2][0], wd[3][0]);
#pragma unroll
      for (int q = 1; q < 4; ++q) if (t == q) wv = make_uint4(wd[0][q], wd[1][q], wd[2][q], wd[3][q]);
      *reinterpret_cast<uint4*>(xb + kc * 512 + (4 * j + t) * 16) = wv;
    }
    if ((lane & 7) < 4) xs[(c >> 3) * 4 + (lane & 7)] = digit_factor(E, lane & 7);
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// one unit (64 M-rows x C columns at local column p*C of every segment): warpgroup wg takes
// blocks wg, wg + 4, ...; y: this thread's (row g, segment 2w + q/2, terms 2(q&1), +1) sum
__device__ __forceinline__ void unit_v5(const uint8_t* unit, int C, int p, int kseg, const uint8_t* xb, const float* xs,
                                        float& y) {
  const int ct = threadIdx.x, wg = ct >> 7, w = (ct >> 5) & 3, lane = ct & 31, q = lane & 3;
  const float* ws = reinterpret_cast<const float*>(unit + 64 * C);
  const int j = 2 * w + (q >> 1), t0 = 2 * (q & 1), bpu = C / 128, bps = kseg / 128;
  for (int b = wg; b < bpu; b += 4) {
    float d[16];
    wg_fence();
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int s = 4 * b + u, sg = p * (C / 32) + s;  // unit-local and segment-local k32 step
      Wg<32>::mma(d, smem_desc(unit + s * 2048, 1024, 128), smem_desc(xb + sg * 1024, 512, 128), u);
    }
    wg_commit();
    wg_wait<0>();
    float d0, d1;  // D[row g (+8)][4j + t0], [4j + t0 + 1]: registers 4w (+2), 4w + 1 (+2)
    switch (w) {
      case 0: d0 = q < 2 ? d[0] : d[2]; d1 = q < 2 ? d[1] : d[3]; break;
      case 1: d0 = q < 2 ? d[4] : d[6]; d1 = q < 2 ? d[5] : d[7]; break;
      case 2: d0 = q < 2 ? d[8] : d[10]; d1 = q < 2 ? d[9] : d[11]; break;
      default: d0 = q < 2 ? d[12] : d[14]; d1 = q < 2 ? d[13] : d[15]; break;
    }
    const int blk = j * bps + p * bpu + b;  // the digit factors' block
    y = fmaf(ws[j * bpu + b], fmaf(d0, xs[blk * 4 + t0], d1 * xs[blk * 4 + t0 + 1]), y);
  }
}

__global__ void __launch_bounds__(NT, 1) bench5(const uint8_t* gunit, int C, const float* gx, int k, float* out,
                                                Result* res) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int U = 64 * C + 4 * S8 * (C / 128), kseg = k / S8, P = kseg / C;
  uint8_t* unit = smem;
  float* acc = reinterpret_cast<float*>(smem + (U + 15) / 16 * 16);  // 8
  float* xs = acc + 8;                                               // k / 128 * 4
  uint8_t* xb = reinterpret_cast<uint8_t*>(xs + k / 128 * 4);        // 4 k bytes
  for (int i = threadIdx.x; i < U / 16; i += NT) reinterpret_cast<uint4*>(unit)[i] = reinterpret_cast<const uint4*>(gunit)[i];
  if (threadIdx.x < 8) acc[threadIdx.x] = 0.f;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const Result s0 = stamp();
  stage_tile_digits(gx, k, xb, xs);
  __syncthreads();
  const Result s1 = stamp();
  float y = 0.f;
  for (int r = 0; r < REPS; ++r) {
    for (int p = 0; p < P; ++p) {  // the tile's units (the same bytes each: the reference repeats them)
      unit_v5(unit, C, p, kseg, xb, xs, y);
      __syncthreads();
    }
  }
  const Result s2 = stamp();
  y += __shfl_xor_sync(0xffffffffu, y, 1);
  if ((threadIdx.x & 1) == 0) atomicAdd(acc + ((threadIdx.x & 31) >> 2), y);
  __syncthreads();
  if (threadIdx.x < 8 && blockIdx.x == 0) out[threadIdx.x] = acc[threadIdx.x] / REPS;
  if (threadIdx.x == 0) { res[blockIdx.x * 2] = span(s0, s1); res[blockIdx.x * 2 + 1] = {s2.cycles - s1.cycles, (s2.ns - s1.ns) / P}; }
}

static void run_v5(int sms, std::mt19937& rng, int k, int C) {
  const int kseg = k / S8, P = kseg / C, U = 64 * C + 4 * S8 * (C / 128);
  std::vector<uint8_t> w(64 * C), unit(U);  // w[(j * 8 + r) * C + c]
  for (auto& b : w) b = random_e4m3(rng);
  for (int m = 0; m < 64; ++m)
    for (int c = 0; c < C; ++c) unit[core_offset(m, c)] = w[m * C + c];
  std::vector<float> ws(S8 * (C / 128));
  for (float& v : ws) v = random_scale(rng);
  memcpy(unit.data() + 64 * C, ws.data(), ws.size() * 4);
  const std::vector<float> x = random_x(rng, k);
  double ref[8], mag = 0;
  for (int r = 0; r < 8; ++r) {
    double s = 0;
    for (int j = 0; j < S8; ++j)
      for (int p = 0; p < P; ++p)
        for (int c = 0; c < C; ++c)
          s += (double)e4m3_value(w[(j * 8 + r) * C + c]) * ws[j * (C / 128) + c / 128] * x[j * kseg + p * C + c];
    ref[r] = s; mag = std::max(mag, fabs(s));
  }
  uint8_t* du; float *dx, *dout; Result* dres;
  CK(cudaMalloc(&du, U)); CK(cudaMalloc(&dx, k * 4)); CK(cudaMalloc(&dout, 64)); CK(cudaMalloc(&dres, sms * 2 * sizeof(Result)));
  CK(cudaMemcpy(du, unit.data(), U, cudaMemcpyHostToDevice)); CK(cudaMemcpy(dx, x.data(), k * 4, cudaMemcpyHostToDevice));
  const size_t sm = (U + 15) / 16 * 16 + 32 + (k / 128) * 16 + 4 * k;
  CK(cudaFuncSetAttribute(bench5, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm));
  for (int i = 0; i < 2; ++i) bench5<<<sms, NT, sm>>>(du, C, dx, k, dout, dres);
  CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
  std::vector<Result> res(sms * 2); float out[8];
  CK(cudaMemcpy(res.data(), dres, res.size() * sizeof(Result), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(out, dout, 32, cudaMemcpyDeviceToHost));
  const Medians md = medians(res, sms, 2);
  double err = 0; for (int i = 0; i < 8; ++i) err = std::max(err, fabs(out[i] - ref[i]));
  const double unit_ns = (double)md.ns[1] / REPS;
  printf("tile 8 rows x 8 segments, k %5d, units of C %4d (%5d B) x %d | stage %6.0f ns | unit %5.0f ns (%.1f KB/us) | max err %.2e of max|y| %.2e\n",
         k, C, U, P, (double)md.ns[0], unit_ns, U / unit_ns * 1000 / 1024, err / mag, mag);
  cudaFree(du); cudaFree(dx); cudaFree(dout); cudaFree(dres);
}

int main() {
  struct Shape { const char* name; int k, halves; };
  const Shape shapes[] = {{"ds-down k18432", 18432, 1}, {"ds-oproj k16384", 16384, 1}, {"ds-gateup k7168 pair", 7168, 2},
                          {"l8-down k14336", 14336, 1}, {"l8-gateup k4096 pair", 4096, 2}, {"ds-qb k1536", 1536, 1}};
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::mt19937 rng(1234);
  for (int kx : {1024, 7168, 18432}) run_v3(sms, rng, kx);
  run_v3n<16>(sms);
  run_v3n<32>(sms);
  run_v5(sms, rng, 7168, 896);
  run_v5(sms, rng, 18432, 768);
  run_v5(sms, rng, 16384, 1024);
  run_v5(sms, rng, 4096, 512);
  for (const Shape& sh : shapes) {
    const int k = sh.k, half = (k + 4 * (k / 128) + 15) / 16 * 16, rb = half * sh.halves;
    int n = PAGE / rb;
    if (n * sh.halves > 8) n = 8 / sh.halves;  // V2 takes at most 8 weight rows a page here
    std::vector<uint8_t> page(PAGE, 0);
    for (int r = 0; r < n; ++r)
      for (int h = 0; h < sh.halves; ++h) {
        uint8_t* row = page.data() + r * rb + h * half;
        for (int c = 0; c < k; ++c) row[c] = random_e4m3(rng);
        for (int b = 0; b < k / 128; ++b) { const float s = random_scale(rng); memcpy(row + k + 4 * b, &s, 4); }
      }
    const std::vector<float> x = random_x(rng, k);
    std::vector<double> ref(16, 0.0);
    for (int r = 0; r < n; ++r)
      for (int h = 0; h < sh.halves; ++h) {
        const uint8_t* row = page.data() + r * rb + h * half;
        double s = 0;
        for (int c = 0; c < k; ++c) { float sc; memcpy(&sc, row + k + 4 * (c / 128), 4); s += (double)e4m3_value(row[c]) * sc * x[c]; }
        ref[r * sh.halves + h] = s;
      }
    double mag = 0; for (int i = 0; i < n * sh.halves; ++i) mag = std::max(mag, fabs(ref[i]));
    uint8_t* dpage; float *dx, *dout; Result* dres;
    CK(cudaMalloc(&dpage, PAGE)); CK(cudaMalloc(&dx, k * 4)); CK(cudaMalloc(&dout, 64)); CK(cudaMalloc(&dres, sms * 2 * sizeof(Result)));
    CK(cudaMemcpy(dpage, page.data(), PAGE, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dx, x.data(), k * 4, cudaMemcpyHostToDevice));
    const int pstride = (k + 127) / 128 * 128 + 64;
    const size_t smem0 = PAGE + 64 + (k / 128) * 32 + k * 4, smem2 = PAGE + 64 + (k / 128) * 32 + 4 * pstride;
    for (int v : {0, 1, 4, 2}) {
      auto kern = v == 0 ? bench<0> : v == 1 ? bench<1> : v == 4 ? bench<4> : bench<2>;
      const size_t sm = v != 2 ? smem0 : smem2;
      CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm));
      for (int w = 0; w < 2; ++w) kern<<<sms, NT, sm>>>(dpage, dx, n, rb, k, sh.halves, dout, dres, pstride);
      CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
      std::vector<Result> res(sms * 2); float out[16];
      CK(cudaMemcpy(res.data(), dres, res.size() * sizeof(Result), cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(out, dout, 64, cudaMemcpyDeviceToHost));
      const Medians md = medians(res, sms, 2);
      double err = 0; for (int i = 0; i < n * sh.halves; ++i) err = std::max(err, fabs(out[i] - ref[i]));
      const double page_ns = (double)md.ns[1] / REPS, bytes = (double)n * rb;
      printf("%-22s V%d rows %d rb %6d | stage %6lld cyc %6.0f ns | page %6lld cyc %6.0f ns (%.1f KB/us at 1 SM; ceiling ~32) | max err %.2e of max|y| %.2e\n",
             sh.name, v, n, rb, md.cycles[0], (double)md.ns[0], md.cycles[1] / REPS, page_ns, bytes / page_ns * 1000 / 1024,
             err / mag, mag);
    }
    cudaFree(dpage); cudaFree(dx); cudaFree(dout); cudaFree(dres);
  }
  return 0;
}
