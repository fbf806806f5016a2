// An FP8 gate/up row pair's dot products (backends/cuda/decode/dot.cuh: dot_segment_fp8_pair,
// dot_groups of N = 2 rows sharing each load of the input) against each row's own
// (dot_segment_fp8, N = 1) (tests/test_row_pair_dot.py). nvcc builds it as a cubin with the
// kernel `row_pair_dot` (one warp per case, on a GPU); g++ as a host program (the 32 lanes of a
// warp are threads, warp_sum meets them at a barrier) that reads DIR/cases.bin, DIR/rows.bin and
// DIR/x.bin and writes DIR/out.bin. The test extracts the device library's row loop and FP8 rows
// into pair_extract.inc (with warp_sum for the GPU) and defines FP8_BLOCK_COLS.
//
// A case is 7 int32 (struct Case): its two packed rows (ir/fp8.py: packed_row_bytes) lie at
// rows + offset and rows + offset + stride (bytes, as a gate/up row's halves), the input at
// x + x_offset (floats). Out: 4 floats per case: the pair's two sums, then each row's sum alone.
#include <cuda_fp8.h>
#include <stdint.h>

struct Case {
  int k, begin, end, stride, offset, x_offset, scale_shift;
};

#ifdef __CUDACC__
#include "pair_extract.inc"
#else
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "host_warp_threads.h"
#include "pair_extract.inc"
#endif

// One case on one lane: the pair's sums, then each row's alone.
__device__ void pair_case(const Case& c, const uint8_t* rows, const float* xs, int lane, float* out) {
  const uint8_t* row = rows + c.offset;
  const float* x = xs + c.x_offset;
  float y[2];
  dot_segment_fp8_pair(row, c.stride, c.k, x, c.begin, c.end, lane, c.scale_shift, y);
  out[0] = y[0];
  out[1] = y[1];
  out[2] = dot_segment_fp8(row, c.k, x, c.begin, c.end, lane, c.scale_shift);
  out[3] = dot_segment_fp8(row + c.stride, c.k, x, c.begin, c.end, lane, c.scale_shift);
}

#ifdef __CUDACC__
extern "C" __global__ void row_pair_dot(const Case* cases, const uint8_t* rows, const float* xs, float* out) {
  float got[4];
  pair_case(cases[blockIdx.x], rows, xs, threadIdx.x, got);
  if (threadIdx.x == 0)
    for (int j = 0; j < 4; ++j) out[4 * blockIdx.x + j] = got[j];
}
#else
template <class T>
static std::vector<T> read_file(const std::string& path) {
  std::vector<T> v;
  if (FILE* f = std::fopen(path.c_str(), "rb")) {
    std::fseek(f, 0, SEEK_END);
    v.resize(std::ftell(f) / sizeof(T));
    std::fseek(f, 0, SEEK_SET);
    if (std::fread(v.data(), sizeof(T), v.size(), f) != v.size()) v.clear();
    std::fclose(f);
  }
  return v;
}

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string dir = argv[1];
  const std::vector<Case> cases = read_file<Case>(dir + "/cases.bin");
  // 16-byte aligned, as ring pages and the staged vector are
  const std::vector<float4> rows = read_file<float4>(dir + "/rows.bin"), xs = read_file<float4>(dir + "/x.bin");
  if (cases.empty() || rows.empty() || xs.empty()) return 1;
  std::vector<float> out(4 * cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    std::vector<std::thread> lanes;
    for (int lane = 0; lane < 32; ++lane)
      lanes.emplace_back([&, lane] {
        this_lane = lane;
        float got[4];
        pair_case(cases[i], reinterpret_cast<const uint8_t*>(rows.data()), reinterpret_cast<const float*>(xs.data()),
                  lane, got);
        if (lane == 0) std::copy(got, got + 4, &out[4 * i]);
      });
    for (auto& t : lanes) t.join();
  }
  FILE* f = std::fopen((dir + "/out.bin").c_str(), "wb");
  if (!f || std::fwrite(out.data(), sizeof(float), out.size(), f) != out.size()) return 1;
  std::fclose(f);
  return 0;
}
#endif
