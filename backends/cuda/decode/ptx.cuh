// ---- PTX wrappers ---------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(ok) : "r"(smem_addr(bar)), "r"(parity) : "memory");
  return ok != 0;
}
// Orders this thread's shared-memory stores before what the async proxy does there next: the
// tensor cores' reads of staged digits, a bulk copy into a ring page that compute wrote.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// The ring's copies: weights and past keys / values, each read once a step and far more than
// L2 holds, so they are marked evict-first: they leave L2 before the activations, digits and
// counters that SMs hand each other (llama-3.1-8b FP8 on an H200: 1.6 % faster a token,
// docs/performance.md, session 27).
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "{\n .reg .b64 policy;\n createpolicy.fractional.L2::evict_first.b64 policy, 1.0;\n"
      " cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], "
      "policy;\n}\n" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
// A bulk copy of what other SMs read too, left to L2's own policy: an MLA attention block's
// latent rows, which every head group's task of the chunk reads.
__device__ __forceinline__ void bulk_copy_shared_data(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
#if TP > 1  // the exchanges between GPUs synchronize at system scope
__device__ __forceinline__ unsigned ld_acquire_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_sys(unsigned* p, unsigned v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
#endif
__device__ __forceinline__ unsigned atom_add_acq_rel(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ void red_release(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
#if FFN_SPLIT_K
__device__ __forceinline__ void red_add_s64(long long* p, long long v) {  // two's complement: u64 add
  asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
#endif
#if FP8_MMA || (MLA && WEIGHT_FP8)
// The tensor-core pieces of the FP8 tiles' path (see tile_pages) and of MLA's FP8 head rows
// (matvec.cuh: head_rows_fp8); the host harness
// (tests/host_kernel.cpp) defines its own of these names. Operands are K-major core matrices
// (8 rows x 16 bytes, 128 B, unswizzled) in shared memory; a descriptor holds the address,
// `lbo` (bytes between the two 16-byte k halves of a k32 step) and `sbo` (bytes between groups
// of 8 rows), each over 16 (PTX ISA: matrix descriptor of wgmma).
__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((smem_addr(p) & 0x3ffff) >> 4) | static_cast<uint64_t>(lbo >> 4) << 16 |
         static_cast<uint64_t>(sbo >> 4) << 32;
}
// Named barrier 2 + k spans compute warpgroup k (barrier 1: compute_sync).
__device__ __forceinline__ void warpgroup_sync(int k) { asm volatile("bar.sync %0, 128;" ::"r"(2 + k) : "memory"); }
// D (+)= A B, A 64 x 32 e4m3, B 32 x N e4m3, D 64 x N f32 over the warpgroup: warp w's lane
// (g = lane / 4, q = lane % 4) holds d[4 i + 0, 1] = D[16 w + g][8 i + 2 q, + 1] and
// d[4 i + 2, 3] = D[16 w + g + 8][the same columns]. `accumulate` 0: D = A B.
template <int N> struct Wgmma;
template <> struct Wgmma<32> {
  static __device__ __forceinline__ void mma(float (&d)[16], uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15}, %16, %17, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
          "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(a), "l"(b), "r"(accumulate));
  }
};
template <> struct Wgmma<16> {
  static __device__ __forceinline__ void mma(float (&d)[8], uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(a), "l"(b), "r"(accumulate));
  }
};
// The same with A from registers, m64n8k32: warp w's lane holds rows 16 w + g and + 8 of A as
// mma.m16n8k32 lays out its A fragment (a0 row g, k 4q .. 4q + 3; a1 row g + 8; a2, a3 the same
// rows at k + 16), so a warp's loads of its 16 rows serve either instruction.
__device__ __forceinline__ void wgmma_m64n8k32_rs(float (&d)[4], const uint32_t (&a)[4], uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
#endif
#if FP8_MMA || (MLA && WEIGHT_FP8)
// prmt.b32: byte i of the result is byte s[4 i .. 4 i + 2] of b:a, or with s[4 i + 3] set that
// byte's sign bit in all 8 bits (which __byte_perm leaves out). The host harness has its own.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
  return d;
}
#endif
#if MLA
// MLA attention's score and value products (mla_chunk) on the tensor cores; the host harness
// (tests/host_kernel.cpp) defines its own of this name. D = A * B + D: A 16x16 bf16 (4 bf16x2
// registers, the lower k in the low half), B 16x8 bf16 (2), D 16x8 f32 (4), the PTX ISA's
// mma.m16n8k16 fragments (group g = lane / 4, q = lane % 4: a0 row g, k 2q, 2q+1; a1 row g+8;
// a2, a3 the same rows at k + 8; b0 column g, k 2q, 2q+1; b1 k + 8; d0, d1 row g, columns 2q,
// 2q+1; d2, d3 row g+8).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif
// 16 bytes from global memory (through L2, as __ldcg) to shared memory, asynchronously: the
// copies a thread has issued complete by its cp_async_wait_all.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
// Waits on a ring mbarrier with the same watchdog as counter waits: a protocol bug becomes an
// error (ERR_RING) instead of a hang. Returns false when the kernel is failing.
// The loader and the compute warps part at the end of a launch through two flag words: compute
// publishes how many pages it consumed, then the quit flag; the loader polls for it. Both are
// shared-memory atomics, ordered by a fence, because the loader cannot join a barrier while it
// may be blocked on a page that compute will never release.
__device__ __forceinline__ bool quit_seen(volatile int* quit) {
  return atomicAdd(const_cast<int*>(quit), 0) != 0;
}

__device__ bool ring_wait(const Params& p, uint64_t* bar, uint32_t parity, volatile int* quit) {
  unsigned spins = 0;
  unsigned long long start = 0;
  while (!mbar_try_wait(bar, parity)) {
    if (quit && quit_seen(quit)) return false;
    if ((++spins & 4095) == 0) {
      if (start == 0) start = now_ns();
      if (*reinterpret_cast<volatile int*>(&p.status[ST_ERROR]) != ERR_NONE) return false;
      if (now_ns() - start > static_cast<unsigned long long>(p.watchdog_ns)) {
        if (atomicCAS(&p.status[ST_ERROR], ERR_NONE, ERR_RING) == ERR_NONE) p.status[ST_ERROR_SM] = blockIdx.x;
        return false;
      }
    }
  }
  return true;
}

// An opaque copy of x: the compiler cannot hoist what is computed from it out of the loop it is
// in. The kernel is at its register limit inside attention; a value hoisted out of the step loop
// stays live through attention and spills.
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

// e^x as one MUFU.EX2 without __expf's fix-up for results under 2^-126 (flushed to 0 here: a
// softmax weight that small adds nothing); attention's inner loop takes two a lane and key round.
// The host harness (tests/host_kernel.cpp) defines its own.
__device__ __forceinline__ float exp_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.44269504088896341f));
  return y;
}

// Named barrier 1 spans the compute warps only, so the loader never takes part.
__device__ __forceinline__ void compute_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(COMPUTE_WARPS * 32) : "memory");
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
