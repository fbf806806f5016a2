// One warp's 32 lanes as host threads, for the harnesses that run the kernel's dot products on
// the host (tests/host_fp8_dot.cpp, tests/row_pair_dot.cu): each thread sets this_lane, and
// warp_sum meets the 32 at a barrier.
#pragma once
#include <algorithm>
#include <barrier>
#include <thread>

using std::max;
using std::min;
static std::barrier<> warp_barrier(32);
static float lane_values[32];
thread_local int this_lane;

// Every lane gets the sum of the 32 lanes' values.
static float warp_sum(float v) {
  lane_values[this_lane] = v;
  warp_barrier.arrive_and_wait();
  float s = 0.f;
  for (int l = 0; l < 32; ++l) s += lane_values[l];
  warp_barrier.arrive_and_wait();  // nobody overwrites lane_values before every lane has read them
  return s;
}
