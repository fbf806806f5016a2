// ---- compute: the ring's pages, dealt to groups of warps -----------------------------------
// Every lane of the page's warp group arrives on the slot's `empty` barrier once it has read the
// page, each for its own reads: compute-sanitizer's racecheck does not take a __syncwarp and
// one lane's arrival as ordering the other lanes' reads before the loader's next bulk copy
// into the slot (it reported hazards), and the 32 arrivals measured no slower (llama-3.2-1b).
__device__ __forceinline__ void release_page(Shared& s, int slot) { mbar_arrive(&s.empty[slot]); }

// Pages are dealt round-robin to PAGE_GROUPS groups of warps, so that the latency of one page
// (wait, loads, reductions, release) overlaps with the others' instead of adding up.
constexpr int GROUP_WARPS = COMPUTE_WARPS / PAGE_GROUPS;

__device__ __forceinline__ int warps_per_row(int rows_in_page) {
  int wpr = 1;
  while (wpr * 2 * rows_in_page <= GROUP_WARPS) wpr *= 2;
  return wpr;
}

// Reduces every compute thread's (value, row) pair to the CTA's best, in thread 0: over lanes,
// then over warps; ties go to the lower row.
__device__ void cta_best(Shared& s, float& best, int& best_row, int ct) {
  const int warp = ct >> 5, lane = ct & 31;
  warp_best(best, best_row);
  if (lane == 0) {  // after rstd was read: every thread read it before the loop above
    s.red[2 * COMPUTE_WARPS + 2 + 2 * warp] = best;
    s.red[2 * COMPUTE_WARPS + 3 + 2 * warp] = __int_as_float(best_row);
  }
  compute_sync();
  if (ct == 0) {
    for (int w = 1; w < COMPUTE_WARPS; ++w)
      keep_best(s.red[2 * COMPUTE_WARPS + 2 + 2 * w], __float_as_int(s.red[2 * COMPUTE_WARPS + 3 + 2 * w]), best,
                best_row);
  }
}

// The task's (max, row) pair for the sampler, written to argmax_partials.
__device__ void write_best(const Params& p, Shared& s, const int* t, float best, int best_row, int ct) {
  cta_best(s, best, best_row, ct);
  if (ct == 0) {
    __stcg(p.act + t[F_AUX2], best);
    __stcg(p.act + t[F_AUX2] + 1, __int_as_float(best_row));
  }
}

// A task's last page taken, compute holds the loader's next copies until the task has signalled
// (run_compute lifts the hold; the loader waits in claim_page): a bulk copy issued just before a
// signal delays the signal's release. An MLA attention task that gave its page back after its
// signal, not before, was met by the v expansion 0.3 µs after it, against 2.2-3.2 (H200, session
// 55); with the hold a one-layer FP8 MoE layer ends 4.5-7.3 µs sooner (H100, session 56; docs/
// performance.md). Every page of the task has been issued by then (for_each_page: ENDS_TASK), so
// the hold waits for nothing the task needs.
__device__ __forceinline__ void hold_copies(Shared& s) {
  if ((threadIdx.x & 31) == 0) atomicExch(const_cast<int*>(&s.flags[FLAG_HOLD]), 1);
}
__device__ __forceinline__ void lift_hold(Shared& s) { atomicExch(const_cast<int*>(&s.flags[FLAG_HOLD]), 0); }

// A task's pages of `rows` rows (`per_page` a page) that are this page group's (the loader deals
// a task's pages to the groups in turn), each waited for, read by `body(page, r, n)` (its first
// row r of n) and released; `consumed` counts the task's pages, every group's. With
// BODY_RELEASES the body is `body(page, r, n, slot)` and releases the slot itself, each thread
// once, after its last read of the page, so that the loader refills it while the thread still
// works on what it read. ENDS_TASK: these are the task's last pages, so the last one holds the
// loader's copies (hold_copies); a split-K task streams two sets, and a hold from its first
// would leave compute waiting for pages that the loader is held from copying.
template <bool BODY_RELEASES = false, bool ENDS_TASK = true, class Rows, class Body>
__device__ __forceinline__ void for_each_page(const Params& p, Shared& s, Rows rows, Rows per_page, int group,
                                              uint32_t& consumed, Body body) {
  uint32_t page_index = consumed;
  for (Rows r = 0; r < rows; r += per_page, ++page_index) {
    if (page_index % PAGE_GROUPS != static_cast<uint32_t>(group)) continue;
    const int slot = page_index % RING_PAGES;
    ring_wait(p, &s.full[slot], (page_index / RING_PAGES) & 1, nullptr);
    if (ENDS_TASK && r + per_page >= rows) hold_copies(s);
    if constexpr (BODY_RELEASES) {
      body(s.ring + slot * PAGE_BYTES, r, min(per_page, rows - r), slot);
    } else {
      body(s.ring + slot * PAGE_BYTES, r, min(per_page, rows - r));
      release_page(s, slot);
    }
  }
  consumed = page_index;
}
