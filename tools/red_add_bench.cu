// What it costs 128 or 132 CTAs to add 7168 partial sums each into one 7168-vector: the output
// of an o_proj split over heads (a task per head, v_expand fused in front, each adding its 128
// columns' partial sums of DeepSeek-V3.2's 7168 rows), which session 40 weighed before building
// it. Each variant is a whole launch, timed by CUDA events over 200 launches (best of 5); every
// CTA ends with a fence and an atomic, as a task ends with its release:
//
//   empty     no sums: the launch and the fence
//   u64 red   red.global.add.u64 of each value as 64-bit fixed point (the split-K FFN's sums)
//   f32 red   red.global.add.f32, a value at a time
//   v4.f32    red.global.add.v4.f32, four values at a time (sm_90)
//   stores    each CTA writes its partials to its own row of a buffer (no reduction)
//
// Timing only: the sums are not checked. Results: docs/performance.md, session 40. Build and run
// (on an H200):
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o red_add_bench tools/red_add_bench.cu
//   ./red_add_bench
#include <cuda_runtime.h>
#include <cstdio>

constexpr int N = 7168;
enum Mode { EMPTY, RED_U64, RED_F32, RED_V4_F32, STORES };

template <Mode MODE>
__global__ void add_partials(long long* fixed, float* sum, float* partials, unsigned* done) {
  const float base = blockIdx.x * 0.001f;
  for (int i = threadIdx.x * 4; MODE != EMPTY && i < N; i += blockDim.x * 4) {
    const float v[4] = {base + i, base + i + 1, base + i + 2, base + i + 3};
    if constexpr (MODE == RED_U64) {
      for (int j = 0; j < 4; ++j)
        asm volatile("red.global.add.u64 [%0], %1;" ::"l"(fixed + i + j), "l"(__float2ll_rn(v[j] * 0x1p32f))
                     : "memory");
    } else if constexpr (MODE == RED_F32) {
      for (int j = 0; j < 4; ++j) atomicAdd(sum + i + j, v[j]);
    } else if constexpr (MODE == RED_V4_F32) {
      asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(sum + i), "f"(v[0]), "f"(v[1]), "f"(v[2]),
                   "f"(v[3])
                   : "memory");
    } else {
      *reinterpret_cast<float4*>(partials + blockIdx.x * N + i) = make_float4(v[0], v[1], v[2], v[3]);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(done, 1u);
  }
}

template <Mode MODE>
float launch_us(int ctas, int threads, long long* fixed, float* sum, float* partials, unsigned* done) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  float best = 1e30f;
  for (int rep = 0; rep < 5; ++rep) {
    cudaEventRecord(a);
    for (int it = 0; it < 200; ++it) add_partials<MODE><<<ctas, threads>>>(fixed, sum, partials, done);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    best = ms < best ? ms : best;
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return best * 1000.f / 200;
}

int main() {
  long long* fixed;
  float *sum, *partials;
  unsigned* done;
  cudaMalloc(&fixed, N * sizeof(long long));
  cudaMalloc(&sum, N * sizeof(float));
  cudaMalloc(&partials, 132 * N * sizeof(float));
  cudaMalloc(&done, sizeof(unsigned));
  for (int ctas : {128, 132})
    for (int threads : {256, 512}) {
      printf("%d CTAs x %d threads, us a launch:", ctas, threads);
      printf("  empty %.2f", launch_us<EMPTY>(ctas, threads, fixed, sum, partials, done));
      printf("  u64 red %.2f", launch_us<RED_U64>(ctas, threads, fixed, sum, partials, done));
      printf("  f32 red %.2f", launch_us<RED_F32>(ctas, threads, fixed, sum, partials, done));
      printf("  v4.f32 red %.2f", launch_us<RED_V4_F32>(ctas, threads, fixed, sum, partials, done));
      printf("  stores %.2f\n", launch_us<STORES>(ctas, threads, fixed, sum, partials, done));
    }
  const cudaError_t err = cudaGetLastError();
  printf("%s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
