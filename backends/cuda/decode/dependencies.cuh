// ---- compute: dependencies -----------------------------------------------------------------
// Thread 0 of compute acquires; the barrier then publishes what it saw to the other warps.
__device__ bool wait_counter(const Params& p, int counter, unsigned target, int task) {
  bool ok = true;
  if (threadIdx.x == 0) ok = acquire(p, counter, target, task, nullptr);
  return ok;
}

// Only thread 0 reads the task's wait fields: warp 0 waited for the row's copy (cp.async) before
// this call, and the other warps may read the row only past the barrier here, which shows them
// the copy and what thread 0 saw of the counters alike. With DSA, an MLA attention task's wait
// for the indexer's selection (F_SELECTION_WAIT) is skipped while the selection is every token
// (FLAG_EVERY_TOKEN): the task then reads nothing the indexer writes, and its other wait implies
// every other producer (passes/synchronization.py checks that).
#if DSA
// Set by thread 0 at each step's start to mla_selects_all(pos) (a flag word rather than the
// position held through the waits, which made the DeepSeek-V3.2 kernel spill). Word 4's other
// user, GQA attention's merge, is not in a DSA (MLA) kernel.
constexpr int FLAG_EVERY_TOKEN = 4;
#endif
__device__ bool wait_deps(const Params& p, Shared& s, const int* t, long long step, int task) {
  if (threadIdx.x == 0) {
    bool ok = true;
    for (int w = 0; w < 2; ++w) {
      const int c = t[F_WAIT0 + 2 * w];
      if (c < 0) continue;
#if DSA
      if (w == t[F_SELECTION_WAIT] && s.flags[FLAG_EVERY_TOKEN]) continue;
#endif
      const int n = wait_per_step(t, w), lag = wait_lag(t, w);
      const long long want = static_cast<long long>(n) * (step + 1 - lag);
      if (want > 0) ok = acquire(p, c, static_cast<unsigned>(want), task, nullptr) && ok;
    }
    s.flags[2] = ok;
  }
  compute_sync();
  return s.flags[2];
}

// The barrier orders every compute thread's writes before the signalling thread's release, and
// release is cumulative, so no separate fence is needed. The release still waits for those
// writes to reach L2 (a round trip); it is made by a thread of the second warp, so that the
// first warp's thread 0 starts acquiring the next task's counters meanwhile.
constexpr int SIGNAL_THREAD = COMPUTE_WARPS > 1 ? 32 : 0;
__device__ void signal_done(const Params& p, const int* t) {
  compute_sync();
  if (threadIdx.x == SIGNAL_THREAD) red_release(&p.counters[t[F_SIGNAL]], 1);
}
