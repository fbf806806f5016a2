// ---- compute warps: the instruction stream, once per decode step ---------------------------
// A task's fields are read from its row in shared memory, which warp 0 copies in while the task
// before runs (cp.async, no registers held): read from the table in global memory (far larger
// than the L1 beside the shared memory), each of the row's cache lines cost a round trip to L2
// where a task first touched it, on every task's critical path (a v expansion task spent ~1.4 µs
// from its dependencies met to the start of its merge; docs/performance.md, session 41).
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void fetch_task_row(const Params& p, const Shared& s, int slot, int id, int ct) {
  for (int f = ct; f < TASK_FIELDS; f += 32) cp_async4(s.task + slot * TASK_SLOT + f, task_row(p, id) + f);
}

// Inlined into the kernel by force: past nvcc's inlining budget (full-size DeepSeek-V3.2 FP8
// with ready digits) it became a call whose ABI took a 344-byte stack frame.
__device__ __forceinline__ void run_compute(const Params& p, Shared& s) {
  const int ct = threadIdx.x;
  uint32_t consumed = 0;
  bool ok = true;
  // The stream's bounds and the sampler's counter are read per step, not held in registers
  // through every task, for the same reason.
  for (long long step = 0; step < p.n_steps && ok; ++step) {
    const long long pos = p.start_pos + step;
#if DSA  // whether the indexer chooses every token: attention then skips its wait for it (wait_deps)
    if (ct == 0) s.flags[FLAG_EVERY_TOKEN] = mla_selects_all(pos);
#endif
    if (step > 0) {  // every CTA learns from the previous token's sampler whether to go on
      ok = wait_counter(p, opaque(static_cast<int>(p.sampler_counter)), static_cast<unsigned>(step), -1);
      if (ct == 0) s.flags[3] = ok && *reinterpret_cast<volatile int*>(&p.status[ST_STOP]) == 0;
      compute_sync();
      ok = s.flags[3];
      if (!ok) break;
    }
    // the step's first task row (a task's row takes slot i % TASK_SLOTS of its stream index i:
    // the step before's last tasks may have had this slot, and every warp is past them at the
    // barrier above)
    if (ct < 32 && p.stream_offsets[blockIdx.x] < p.stream_offsets[blockIdx.x + 1])
      fetch_task_row(p, s, p.stream_offsets[blockIdx.x] % TASK_SLOTS, p.stream_tasks[p.stream_offsets[blockIdx.x]],
                     ct);
    for (int i = p.stream_offsets[blockIdx.x], end = p.stream_offsets[blockIdx.x + 1]; i < end && ok; ++i) {
      const int id = p.stream_tasks[i];
      if (ct < 32) {  // this task's row is in (wait_deps' barrier shows it to the other warps)
        cp_async_wait_all();
        __syncwarp();
        // the next task's row, into the slot of the task before the one before, which every warp
        // is past: issued here, its copies overlap the dependency wait (past the wait's barrier
        // they held warp 0, and so every warp, ~0.4 us at each task's start: H100, session 57)
        if (i + 1 < end) fetch_task_row(p, s, (i + 1) % TASK_SLOTS, p.stream_tasks[i + 1], ct);
      }
      const int* t = s.task + i % TASK_SLOTS * TASK_SLOT;
      unsigned long long* stamp =
          p.profile && step < p.profile_steps && ct == 0 ? p.profile + (step * p.n_tasks + id) * 3 : nullptr;
      if (stamp) stamp[0] = now_ns();
      zero_row_sums(s, ct);  // every warp is past the task before's last read of them
      ok = wait_deps(p, s, t, step, id);
      if (stamp) stamp[1] = now_ns();
      if (!ok) break;
      bool signal = true;
      // The matrix-vector and sampling tasks get the thread index through opaque(): what they
      // derive from it (warp, lane, shared-memory offsets) is recomputed per task instead of
      // held in registers through every other task, where attention needs them all.
      switch (t[F_OPCODE]) {
        case OP_EMBED: ok = run_embed(p, t, step, ct); break;
#if MOE
        case OP_MOE_TOPK: run_moe_topk(p, s, t, opaque(ct)); break;
        case OP_MOE_GATE_UP:
        case OP_MOE_DOWN_ADD:
#endif
        case OP_NORM_MATVEC:
        case OP_MATVEC_ADD:
          run_matvec(p, s, t, consumed, opaque(ct));
          if (t[F_EPILOGUE] == EPI_ARGMAX) sample_lm_head(p, s, t, pos, opaque(ct));
#if TP > 1
          if (t[F_XCHG] >= 0) ok = exchange_rows(p, s, t, step, id, opaque(ct));
#endif
          break;
#if MLA
        case OP_HEAD_MATVEC:
          run_matvec(p, s, t, consumed, opaque(ct));
          if (t[F_APPEND]) mla_append_latent(p, s, t, pos, opaque(ct));
          break;
        case OP_MLA_ATTENTION: run_mla_attention(p, s, t, pos, consumed, opaque(ct)); break;
#endif
#if DSA
        case OP_DSA_SCORE: run_dsa_score(p, s, t, pos, opaque(ct)); break;
        case OP_DSA_TOPK: run_dsa_topk(p, s, t, pos, opaque(ct)); break;
#endif
#if !MLA
        case OP_ATTENTION: signal = run_attention(p, s, t, step, pos, consumed, ct); break;
#endif
#if TP > 1
        case OP_ARGMAX: ok = run_argmax_ranks(p, s, t, step, id, opaque(ct)); break;
#else
        case OP_ARGMAX: run_argmax(p, s, t, step, pos, opaque(ct)); break;
#endif
#if FFN_SPLIT_K
        case OP_FFN_SPLIT_K: run_split_k(p, s, t, consumed, opaque(ct)); break;
#endif
      }
      if (signal) signal_done(p, t);
      else compute_sync();  // no thread still takes a page (and holds copies) past the lift
      if (ct == SIGNAL_THREAD) lift_hold(s);  // after the signal
#if MLA
      if (t[F_OPCODE] == OP_MLA_ATTENTION) mla_release_page(s, consumed, opaque(ct));  // after the signal
#endif
      if (stamp) stamp[2] = now_ns();
    }
  }
  cp_async_wait_all();  // a row fetched for a task that a failing launch did not run
  compute_sync();
  if (ct == 0) {
    atomicExch(const_cast<int*>(&s.flags[1]), static_cast<int>(consumed));
    __threadfence_block();
    atomicExch(const_cast<int*>(&s.flags[0]), 1);  // quit: the loader drains and leaves
  }
}

}  // namespace tilertc

extern "C" __global__ void __launch_bounds__((COMPUTE_WARPS + 1) * 32, 1)
    tilertc_decode(const tilertc::Params* __restrict__ params) {
  using namespace tilertc;
  extern __shared__ __align__(128) uint8_t smem[];
  const Params p = *params;
  Shared s = carve(smem);
  if (threadIdx.x == 0) {
    for (int i = 0; i < RING_PAGES; ++i) {
      mbar_init(&s.full[i], 1);
      mbar_init(&s.empty[i], GROUP_WARPS * 32);
    }
    s.flags[0] = 0;
    s.flags[1] = 0;
    s.flags[FLAG_HOLD] = 0;
    s.flags[FLAG_SAMPLE_MODE] = sampling(p).mode();
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  // The loader is the last warp, so that the compute warps are whole warpgroups (wgmma).
  if (threadIdx.x >= COMPUTE_WARPS * 32)
    run_loader(p, s);
  else
    run_compute(p, s);
}
