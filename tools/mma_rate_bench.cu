// What one mma.sync costs a warp on this GPU, by operand type: MLA's FP8 head rows once ran
// mma.sync.m16n8k32 with e4m3 operands (decode/matvec.cuh: head_rows_fp8, before session 59).
// Here one CTA's warps each run 1024 rounds of one mma (a dependent chain: its latency) or of
// four on independent accumulators (its issue rate), for e4m3 m16n8k32 and for f16 / bf16
// m16n8k16 (half the k of a step), with 1 and 16 warps. A register of A changes every mma: with
// loop-invariant operands ptxas hoisted the e4m3 products out of the loop, and the first version
// of this bench (session 58) timed only the additions into D.
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -o mma_rate_bench tools/mma_rate_bench.cu
//   ./mma_rate_bench   # on the GPU
//
// On sm_90a mma.sync with e4m3 operands is no tensor-core instruction: ptxas makes each one 12
// F2FP.F16.E4M3 conversions, two HMMA.16816.F32 (f16) and four FADD into D (its SASS, e.g.
// `cuobjdump -sass`, from the nvidia-cuda-cuobjdump wheel). docs/performance.md has the times.
#include <cstdio>
#include <cstdint>
__device__ __forceinline__ void e4m3(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <int KIND, int CHAINS>
__global__ void bench(unsigned long long* out, float* sink, uint32_t seed) {
  uint32_t a[4] = {seed + threadIdx.x, seed * 3u + threadIdx.x, seed * 5u, seed * 7u};  // per lane, as loads
  const uint32_t b0 = seed * 11u, b1 = seed * 13u;
  float d[CHAINS][4] = {};
  __syncthreads();
  const unsigned long long t0 = clock64();
  for (int i = 0; i < 1024; ++i) {
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) {
      a[0] += 0x01010101u;  // not loop-invariant (see above)
      if (KIND == 0) e4m3(d[c], a, b0, b1);
      else if (KIND == 1) f16(d[c], a, b0, b1);
      else bf16(d[c], a, b0, b1);
    }
  }
  __syncthreads();
  const unsigned long long t1 = clock64();
  float s = 0.f;
  for (int c = 0; c < CHAINS; ++c) s += d[c][0] + d[c][1] + d[c][2] + d[c][3];
  sink[threadIdx.x] = s;
  if (threadIdx.x == 0) out[0] = t1 - t0;
}
template <int KIND, int CHAINS>
void run(const char* name, int warps) {
  unsigned long long* out; float* sink;
  cudaMalloc(&out, 8); cudaMalloc(&sink, 4 * 1024);
  bench<KIND, CHAINS><<<1, 32 * warps>>>(out, sink, 0x3c3c3c3cu);
  bench<KIND, CHAINS><<<1, 32 * warps>>>(out, sink, 0x3c3c3c3cu);
  unsigned long long c; cudaMemcpy(&c, out, 8, cudaMemcpyDeviceToHost);
  printf("%-6s chains %d warps %2d: %.1f cycles per mma per warp (%llu cycles)\n", name, CHAINS, warps, double(c) / (1024.0 * CHAINS), c);
  cudaFree(out); cudaFree(sink);
}
int main() {
  for (int w : {1, 16}) {
    run<0, 1>("e4m3", w); run<1, 1>("f16", w); run<2, 1>("bf16", w);
    run<0, 4>("e4m3", w); run<1, 4>("f16", w); run<2, 4>("bf16", w);
  }
  cudaError_t e = cudaDeviceSynchronize();
  printf("%s\n", cudaGetErrorString(e));
}
