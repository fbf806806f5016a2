// A TileLang row-segment tile (backends/tilelang), run on the host (tests/test_tilelang_backend.py).
//
// The test lowers a tile with TileLang, turns it into the __device__ function the kernel
// composes, and writes it to tile.inc with `#define TILE` naming it. Here the warp's 32 lanes run
// one after another with host stand-ins for the few CUDA types and intrinsics the tile uses. The
// tile's only exchange between lanes is tl::AllReduce (warp shuffles), so every lane runs twice:
// the first pass records each lane's value at the reduction, the butterfly of xor-shuffles is
// then computed over the recorded values in the kernel's order, and the second pass returns it.
// stdin: N, then N bf16 weights and N fp32 inputs as bit patterns; stdout: lane 0's result bits.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define __device__
#define __forceinline__ inline
#define __restrict__

struct bfloat16_t {
  uint16_t bits;
  explicit operator float() const {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
struct __nv_bfloat162 {
  bfloat16_t x, y;
};
struct float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) uint2 {
  uint32_t x, y;
};
struct alignas(16) uint4 {
  uint32_t x, y, z, w;
};
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
static inline float2 __bfloat1622float2(__nv_bfloat162 v) { return {float(v.x), float(v.y)}; }

constexpr int LANES = 32;
static int pass, lane_now;
static float recorded[LANES], reduced[LANES];
static int reductions[LANES];
static void (*butterfly)() = nullptr;  // the reduction the tile used, noted in the first pass

namespace tl {
struct SumOp {
  float operator()(float a, float b) const { return a + b; }
};
template <int threads>
struct NamedBarrier {};
template <class Reducer, int threads, int scale, int offset, class Barrier>
struct AllReduce {
  static_assert(threads <= LANES, "a tile reduction wider than a warp cannot be composed");
  static float run(float x) {
    if (++reductions[lane_now] > 1) {
      std::fprintf(stderr, "the harness runs tiles with one reduction\n");
      std::exit(2);
    }
    if (pass == 1) return reduced[lane_now];
    butterfly = &all_lanes;
    recorded[lane_now] = x;
    return x;
  }
  static void all_lanes() {  // the xor-shuffle rounds of the reduction, every lane at once
    float v[LANES];
    std::memcpy(v, recorded, sizeof v);
    for (int off = threads / 2; off >= scale; off /= 2) {
      float next[LANES];
      for (int l = 0; l < LANES; ++l) next[l] = Reducer()(v[l], v[l ^ off]);
      std::memcpy(v, next, sizeof v);
    }
    std::memcpy(reduced, v, sizeof v);
  }
};
}  // namespace tl

#include "tile.inc"

int main() {
  int n;
  if (std::scanf("%d", &n) != 1) return 2;
  auto* w = static_cast<bfloat16_t*>(aligned_alloc(16, sizeof(bfloat16_t) * (n + 8)));
  auto* x = static_cast<float*>(aligned_alloc(16, sizeof(float) * (n + 8)));
  for (int i = 0; i < n; ++i) {
    unsigned bits;
    if (std::scanf("%u", &bits) != 1) return 2;
    w[i].bits = static_cast<uint16_t>(bits);
  }
  for (int i = 0; i < n; ++i) {
    uint32_t bits;
    if (std::scanf("%u", &bits) != 1) return 2;
    std::memcpy(&x[i], &bits, 4);
  }
  float y[LANES] = {};
  for (pass = 0; pass < 2; ++pass) {
    std::memset(reductions, 0, sizeof reductions);
    for (lane_now = 0; lane_now < LANES; ++lane_now) TILE(w, x, &y[lane_now], lane_now);
    if (pass == 0 && butterfly) butterfly();
  }
  uint32_t out;
  std::memcpy(&out, &y[0], 4);
  std::printf("%u\n", out);
  return 0;
}
