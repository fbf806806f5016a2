// ---- tensor parallelism: exchanges between ranks (passes/synchronization.py) --------------
#if TP > 1
// An exchanging task writes its part into its rank's slot of its receive buffer on every rank,
// then arrives on its exchange counter on every rank and waits until all TP have arrived on
// this rank's. Each writing thread fences at system scope before the barrier: its stores go
// over NVLink, and the arrival's release (by another thread) must not overtake them.
__device__ __forceinline__ void publish_partial(const Params& p, const int* t, int row, float y) {
  const long long at = t[F_XCHG_BUF] + p.rank * t[F_XCHG_STRIDE] + row;
#pragma unroll 1  // unrolled, it costs run_matvec the register that DeepSeek-V3.2's kernel lacks
  for (int r = 0; r < TP; ++r) __stcg(p.peers->act[r] + at, y);
}

__device__ void exchange_arrive(const Params& p, const int* t) {
  __threadfence_system();
  compute_sync();
  if (threadIdx.x == SIGNAL_THREAD) {
#pragma unroll
    for (int r = 0; r < TP; ++r) red_release_sys(p.peers->counters[r] + t[F_XCHG], 1);
  }
}
// Waits (with the watchdog) until every rank's copy of the task has arrived on this rank's
// exchange counter; false when the kernel is failing.
__device__ bool exchange_await(const Params& p, Shared& s, const int* t, long long step, int task) {
  bool ok = true;
  if (threadIdx.x == 0) ok = acquire<true>(p, t[F_XCHG], static_cast<unsigned>(TP * (step + 1)), task, nullptr);
  if (threadIdx.x == 0) s.flags[2] = ok;
  compute_sync();
  return s.flags[2];
}

// The all-reduce of an exchanging matrix-vector task (o_proj, the down projection): its rows'
// partial sums from every rank, added in rank order (the same sum on every rank), plus the
// residual, into its output rows.
__device__ void sum_ranks(const Params& p, const int* t, int ct) {
  const int row0 = t[F_ROW0], rows = t[F_ROW1] - row0, stride = t[F_XCHG_STRIDE];
  const float* slot = p.act + t[F_XCHG_BUF] + row0;
  for (int i = ct; i < rows; i += COMPUTE_WARPS * 32) {
    float y = __ldcg(slot + i);
#pragma unroll
    for (int r = 1; r < TP; ++r) y += __ldcg(slot + r * stride + i);
    __stcg(p.act + t[F_OUT] + row0 + i, y + __ldcg(p.act + t[F_AUX] + row0 + i));
  }
}
__device__ bool exchange_rows(const Params& p, Shared& s, const int* t, long long step, int task, int ct) {
  exchange_arrive(p, t);
  if (!exchange_await(p, s, t, step, task)) return false;
  sum_ranks(p, t, ct);
  return true;
}
#endif
