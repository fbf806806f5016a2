// What one hand-off between two ops costs, and how much of it a different protocol could save.
// Session 50 put nine hand-offs on a DeepSeek-V3.2 MoE layer's critical path at ~1.2 us each (an
// H100 timeline, docs/performance.md). The kernel hands off by counter: the producing task's
// threads store, meet at a barrier, one thread adds to a counter with release semantics (which
// waits for the stores to reach L2), the consumer's thread 0 spins on the counter with acquire
// loads, and only then does every thread load the data: about three L2 round trips after the
// last store. Here every SM runs a chain of hops, one vector of 7168 values a hop: each CTA writes
// its slice, then waits for and reads the whole vector (checking every value) before writing its
// slice of the next. Per hop, with one protocol a launch:
//
//   counter     the kernel's protocol: float stores, barrier, red.release.gpu; ld.acquire.gpu spin
//   tagged      each value stored with its hop's tag in one 8-byte word (st.relaxed.gpu); no
//               counter: the consumer loads the words (ld.relaxed.gpu) until every tag is its hop's
//   tag+count   tagged words and a counter added without release (red.relaxed.gpu): the consumer
//               waits on the counter, then loads the words once, re-loading any with a stale tag
//   nowait      float stores, no signal, the vector loaded at once (a floor, not a protocol: its
//               values may be stale; their count is printed, not checked)
//
// With --load every CTA also runs a loader warp that streams a 4 GiB buffer through shared memory
// by cp.async.bulk, 16 KB copies, 32 to 128 KB of them in flight (a ring of two 65 KB pages keeps
// 65-130 KB in flight per SM while its compute streams), so the hops cross an L2 and a memory
// system under load; the GB/s the loaders reached is printed. Every protocol but nowait must
// read every value right (the run fails otherwise).
// Results: docs/performance.md, session 51. Build and run (on an H200 or H100):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o handoff_bench tools/handoff_bench.cu
//   ./handoff_bench && ./handoff_bench --load
#include <cuda_runtime.h>
#include <cstdio>
#include <cstring>

constexpr int V = 7168;            // DeepSeek-V3.2's hidden size: the vector a hop hands on
constexpr int BUFFERS = 8;         // a hop's vector reuses buffer hop % 8 (a CTA is never 8 hops ahead)
constexpr int THREADS = 256;       // compute threads; the loader warp is one more
constexpr int PER_THREAD = V / THREADS;  // values a thread reads
static_assert(PER_THREAD * THREADS == V && PER_THREAD <= 32);
constexpr int MAX_SLOTS = 8, SLOT_BYTES = 16 << 10;  // up to 128 KB in flight
constexpr long long STREAM_BYTES = 4ll << 30;
enum Protocol { COUNTER, TAGGED, TAG_COUNT, NOWAIT };
const char* const NAMES[] = {"counter", "tagged", "tag+count", "nowait"};

__device__ __forceinline__ float value(int hop, int j) { return static_cast<float>((hop & 1023) * V + j); }
__device__ __forceinline__ unsigned long long word(int hop, int j) {
  return (static_cast<unsigned long long>(hop + 1) << 32) | __float_as_uint(value(hop, j));
}
__device__ __forceinline__ unsigned long long ld_relaxed_u64(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned ld_relaxed(const unsigned* p) {
  unsigned v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

struct Buffers {
  float* plain;               // [BUFFERS][V]
  unsigned long long* words;  // [BUFFERS][V]
  unsigned* counters;         // [BUFFERS]
  unsigned* wrong;            // values read wrong, all CTAs
  const char* stream;         // STREAM_BYTES
  unsigned long long* streamed;
};

// Spins until the phase of shared-memory mbarrier `bar` with parity `parity` has completed.
__device__ __forceinline__ void wait_parity(unsigned bar, unsigned parity) {
  unsigned ready = 0;
  while (!ready)
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 " selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(ready) : "r"(bar), "r"(parity) : "memory");
}

// The loader warp's lane 0: copies into n_slots shared-memory slots until compute is done.
__device__ void stream_weights(const Buffers& b, int n_slots, char* slots, unsigned long long* bars,
                               volatile int* done) {
  long long offset = static_cast<long long>(blockIdx.x) * SLOT_BYTES, copies = 0;
  for (int k = 0; !*done; ++k) {
    const int slot = k % n_slots;
    const unsigned bar = static_cast<unsigned>(__cvta_generic_to_shared(bars + slot));
    if (k >= n_slots) wait_parity(bar, ((k / n_slots) - 1) & 1);  // the slot's previous copy has landed
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(SLOT_BYTES) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     static_cast<unsigned>(__cvta_generic_to_shared(slots + slot * SLOT_BYTES))),
                 "l"(b.stream + offset), "r"(SLOT_BYTES), "r"(bar)
                 : "memory");
    ++copies;
    offset = (offset + static_cast<long long>(gridDim.x) * SLOT_BYTES) % STREAM_BYTES;
  }
  for (int k = 0; k < n_slots; ++k) {  // let the last copies land before the CTA exits
    const unsigned bar = static_cast<unsigned>(__cvta_generic_to_shared(bars + k));
    const long long uses = (copies - k + n_slots - 1) / n_slots;
    if (uses > 0) wait_parity(bar, static_cast<unsigned>((uses - 1) & 1));
  }
  atomicAdd(b.streamed, static_cast<unsigned long long>(copies) * SLOT_BYTES);
}

template <Protocol P>
__global__ void __launch_bounds__(THREADS + 32) hops(Buffers b, int n_hops, int n_slots) {
  extern __shared__ __align__(128) char slots[];
  __shared__ unsigned long long bars[MAX_SLOTS];
  __shared__ int done;
  __shared__ unsigned wrong_warps[THREADS / 32];
  if (threadIdx.x == 0) {
    done = 0;
    for (int k = 0; k < MAX_SLOTS; ++k) {
      const unsigned bar = static_cast<unsigned>(__cvta_generic_to_shared(bars + k));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x >= THREADS) {
    if (n_slots && threadIdx.x == THREADS) stream_weights(b, n_slots, slots, bars, &done);
    return;
  }
  const int per_cta = (V + gridDim.x - 1) / gridDim.x, lo = blockIdx.x * per_cta, hi = min(V, lo + per_cta);
  unsigned wrong = 0;
  for (int hop = 0; hop < n_hops; ++hop) {
    if (hop > 0) {  // wait for and read the vector of hop - 1
      const int h = hop - 1, buf = h % BUFFERS;
      const unsigned target = gridDim.x * (h / BUFFERS + 1);
      if constexpr (P == COUNTER || P == TAG_COUNT) {
        if (threadIdx.x == 0)
          while ((P == COUNTER ? ld_acquire(&b.counters[buf]) : ld_relaxed(&b.counters[buf])) < target) {
          }
        asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory");
      }
      float x[PER_THREAD];
      if constexpr (P == COUNTER || P == NOWAIT) {
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) {
          const int j = threadIdx.x + i * THREADS;
          x[i] = __ldcg(b.plain + buf * V + j);
        }
      } else {
        unsigned pending = (1u << PER_THREAD) - 1;
        while (pending) {
          unsigned long long w[PER_THREAD];
#pragma unroll
          for (int i = 0; i < PER_THREAD; ++i) {
            const int j = threadIdx.x + i * THREADS;
            w[i] = pending >> i & 1 ? ld_relaxed_u64(b.words + buf * V + j) : 0;
          }
#pragma unroll
          for (int i = 0; i < PER_THREAD; ++i)
            if ((pending >> i & 1) && static_cast<int>(w[i] >> 32) == h + 1) {
              pending &= ~(1u << i);
              x[i] = __uint_as_float(static_cast<unsigned>(w[i]));
            }
        }
      }
#pragma unroll
      for (int i = 0; i < PER_THREAD; ++i) wrong += x[i] != value(h, threadIdx.x + i * THREADS);
      // the consumer's own work on what it read: a barrier, as a block reduction has
      unsigned w = __reduce_add_sync(0xffffffffu, wrong);
      if (threadIdx.x % 32 == 0) wrong_warps[threadIdx.x / 32] = w;
      asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory");
    }
    const int buf = hop % BUFFERS;  // write this CTA's slice of the hop's vector
    for (int j = lo + static_cast<int>(threadIdx.x); j < hi; j += THREADS) {
      if constexpr (P == COUNTER || P == NOWAIT) {
        b.plain[buf * V + j] = value(hop, j);
      } else {
        asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(b.words + buf * V + j), "l"(word(hop, j)) : "memory");
      }
    }
    if constexpr (P == COUNTER || P == TAG_COUNT) {
      asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory");
      if (threadIdx.x == 32) {
        if constexpr (P == COUNTER)
          asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(&b.counters[buf]) : "memory");
        else
          asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;" ::"l"(&b.counters[buf]) : "memory");
      }
    }
  }
  asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory");
  if (threadIdx.x == 0) {
    unsigned total = 0;
    for (int w = 0; w < THREADS / 32; ++w) total += wrong_warps[w];
    atomicAdd(b.wrong, total);
    *reinterpret_cast<volatile int*>(&done) = 1;
  }
}

template <Protocol P>
bool run(const Buffers& b, int ctas, int n_slots, int n_hops) {
  const int smem = MAX_SLOTS * SLOT_BYTES;
  cudaFuncSetAttribute(hops<P>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  float best = 1e30f;
  unsigned wrong = 0;
  unsigned long long streamed = 0;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int rep = 0; rep < 5; ++rep) {
    cudaMemset(b.counters, 0, BUFFERS * sizeof(unsigned));
    cudaMemset(b.wrong, 0, sizeof(unsigned));
    cudaMemset(b.streamed, 0, sizeof(unsigned long long));
    cudaMemset(b.words, 0, sizeof(unsigned long long) * BUFFERS * V);
    cudaEventRecord(start);
    hops<P><<<ctas, THREADS + 32, smem>>>(b, n_hops, n_slots);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms;
    cudaEventElapsedTime(&ms, start, stop);
    if (ms < best) {
      best = ms;
      cudaMemcpy(&streamed, b.streamed, sizeof(streamed), cudaMemcpyDeviceToHost);
    }
    unsigned w;
    cudaMemcpy(&w, b.wrong, sizeof(w), cudaMemcpyDeviceToHost);
    wrong += w;
  }
  const cudaError_t err = cudaGetLastError();
  printf("%3d KB in flight  %-10s %6.3f us a hop", n_slots * SLOT_BYTES >> 10, NAMES[P], best * 1000.f / n_hops);
  if (n_slots) printf("   loader %6.0f GB/s", streamed / (best * 1e-3) / 1e9);
  printf("   values read wrong: %u%s\n", wrong, err == cudaSuccess ? "" : cudaGetErrorString(err));
  return err == cudaSuccess && (P == NOWAIT || wrong == 0);
}

int main(int argc, char** argv) {
  const bool load = argc > 1 && strcmp(argv[1], "--load") == 0;
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, device);
  Buffers b{};
  cudaMalloc(&b.plain, sizeof(float) * BUFFERS * V);
  cudaMalloc(&b.words, sizeof(unsigned long long) * BUFFERS * V);
  cudaMalloc(&b.counters, BUFFERS * sizeof(unsigned));
  cudaMalloc(&b.wrong, sizeof(unsigned));
  cudaMalloc(&b.streamed, sizeof(unsigned long long));
  char* stream = nullptr;
  if (load) {
    cudaMalloc(&stream, STREAM_BYTES);
    cudaMemset(stream, 1, STREAM_BYTES);
  }
  b.stream = stream;
  const int n_hops = 4000;
  printf("%s, %d CTAs of %d compute threads, %d hops of %d values%s\n", prop.name, sms, THREADS, n_hops, V,
         load ? ", a loader warp streaming in every CTA (16 KB copies)" : "");
  bool ok = true;
  for (int n_slots = load ? 2 : 0; n_slots <= (load ? MAX_SLOTS : 0); n_slots += 2) {
    ok = run<COUNTER>(b, sms, n_slots, n_hops) && ok;
    ok = run<TAGGED>(b, sms, n_slots, n_hops) && ok;
    ok = run<TAG_COUNT>(b, sms, n_slots, n_hops) && ok;
    ok = run<NOWAIT>(b, sms, n_slots, n_hops) && ok;
  }
  return ok ? 0 : 1;
}
