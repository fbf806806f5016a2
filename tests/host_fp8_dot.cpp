// The FP8 dot product of the device library (decode/dot.cuh: dot_groups, Fp8Row, dot_segment_fp8),
// run on the host (tests/test_fp8_kernel.py).
//
// The test extracts the kernel's FP8 section into fp8_extract.inc and compiles this file with
// -DFP8_BLOCK_COLS=... and the CUDA include directory: cuda_fp8.h converts e4m3 on the host as
// well, so the conversion is NVIDIA's, not a stand-in. The 32 lanes of a warp are threads;
// warp_sum meets them at a barrier. Input on stdin, binary, per case: int32 k, begin, end, slots,
// shared_k, scale_cols, then the packed row and k float32 inputs. The row is one FP8 row of k
// columns with one scale per scale_cols columns (slots 1, shared_k 0: dot_segment_fp8), or a
// routed down row (dot_segment_fp8_pieces): slots pieces of (k - shared_k) / slots columns, then
// with shared_k > 0 the shared expert's piece of shared_k columns, each piece a row of
// FP8_BLOCK_COLS-column blocks (ir/fp8.py: packed_row_bytes). Output: one line per case, the
// float32 bits of the warp's sum, or "lanes differ" if the lanes disagree.
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "host_warp_threads.h"

#include "fp8_extract.inc"

static int packed_bytes(int k, int scale_cols) { return (k + 4 * ((k + scale_cols - 1) / scale_cols) + 15) / 16 * 16; }

int main() {
  int32_t head[6];
  while (std::fread(head, sizeof head, 1, stdin) == 1) {
    const int k = head[0], begin = head[1], end = head[2], slots = head[3], shared_k = head[4], cols = head[5];
    const bool one_row = slots == 1 && shared_k == 0;
    const int piece_bytes = packed_bytes((k - shared_k) / slots, one_row ? cols : FP8_BLOCK_COLS);
    const int row_bytes = slots * piece_bytes + (shared_k ? packed_bytes(shared_k, FP8_BLOCK_COLS) : 0);
    int shift = 0;
    while ((4 << shift) < cols) ++shift;
    // 16-byte aligned, as ring pages and the staged vector are
    std::vector<float4> row(row_bytes / 16), x((k + 3) / 4);
    if (std::fread(row.data(), 1, row_bytes, stdin) != static_cast<size_t>(row_bytes) ||
        std::fread(x.data(), sizeof(float), k, stdin) != static_cast<size_t>(k))
      return 1;
    float got[32];
    std::vector<std::thread> lanes;
    for (int lane = 0; lane < 32; ++lane)
      lanes.emplace_back([&, lane] {
        this_lane = lane;
        const uint8_t* r = reinterpret_cast<const uint8_t*>(row.data());
        const float* xs = reinterpret_cast<const float*>(x.data());
        got[lane] = one_row ? dot_segment_fp8(r, k, xs, begin, end, lane, shift)
                            : dot_segment_fp8_pieces(r, slots, piece_bytes, k / 8, shared_k / 8, xs, begin, end, lane);
      });
    for (auto& t : lanes) t.join();
    bool same = true;
    for (int lane = 1; lane < 32; ++lane) same = same && std::memcmp(&got[lane], &got[0], 4) == 0;
    uint32_t bits;
    std::memcpy(&bits, &got[0], 4);
    if (same)
      std::printf("%u\n", bits);
    else
      std::printf("lanes differ\n");
  }
  return 0;
}
