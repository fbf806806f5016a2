// ---- compute: embedding and sampling -------------------------------------------------------
__device__ bool run_embed(const Params& p, const int* t, long long step, int ct) {
  const long long token = step == 0 ? p.first_token : __ldcg(p.tokens + step - 1);
  if (token < 0 || token >= VOCAB) {
    if (ct == 0) atomicCAS(&p.status[ST_ERROR], ERR_NONE, ERR_BAD_TOKEN);
    return false;
  }
  const __nv_bfloat16* row = p.embed + token * HIDDEN;
  for (int i = ct; i < HIDDEN; i += COMPUTE_WARPS * 32) __stcg(p.act + t[F_OUT] + i, __bfloat162float(row[i]));
  return true;
}

// Publish the step's token to the device and to the host-mapped ring, and decide whether the
// run goes on.
__device__ void publish_token(const Params& p, long long step, int tok) {
  p.tokens[step] = tok;
  volatile int* ring = p.host_tokens;
  ring[step] = tok;
  __threadfence_system();
  *reinterpret_cast<volatile int*>(p.host_count) = static_cast<int>(step + 1);
#if TP > 1  // the ranks' stop flags as the sampler's exchange agreed on them (run_argmax_ranks)
  const bool stop = tok == p.eos_token || p.act[TP_STOP_AT] != 0.f || step + 1 == p.n_steps;
#else
  const bool stop = tok == p.eos_token || *reinterpret_cast<volatile int*>(p.host_stop) != 0 ||
                    step + 1 == p.n_steps;
#endif
  if (stop) p.status[ST_STOP] = static_cast<int>(step + 1);
}

// The best of the lm_head tasks' (max, row) pairs (F_COUNT of them at F_IN), in thread 0: every
// thread loads pairs at once (one round trip to L2, not one per task), then the CTA reduces.
__device__ __forceinline__ void best_of_tasks(const Params& p, Shared& s, const int* t, int ct, float& best,
                                              int& tok) {
  const float* part = p.act + t[F_IN];
  best = -INFINITY;
  tok = 0x7fffffff;
  for (int i = ct; i < t[F_COUNT]; i += COMPUTE_WARPS * 32)
    keep_best(__ldcg(part + 2 * i), __float_as_int(__ldcg(part + 2 * i + 1)), best, tok);
  cta_best(s, best, tok, ct);
}

// The sampler: greedy and temperature-only reduce the lm_head tasks' (max, row) pairs (of
// logits or of Gumbel-max scores) in thread 0; top-k / top-p merge the tasks' candidates.
__device__ void run_argmax(const Params& p, Shared& s, const int* t, long long step, long long pos, int ct) {
  if (sample_mode(s) == SAMPLE_FILTERED) {
    const int tok = sample_filtered(p, sampling(p), s, t, pos, ct);
    if (ct == 0) publish_token(p, step, tok);
    return;
  }
  float best;
  int tok;
  best_of_tasks(p, s, t, ct, best, tok);
  if (ct == 0) publish_token(p, step, tok);
}

#if TP > 1
// The greedy sampler over ranks: this rank's best (logit, row) pair of its vocabulary rows (row
// made global) and its reading of the host's stop flag go to every rank; every rank then takes
// the best of the TP pairs in rank order (ties to the lower row, as over the whole vocabulary)
// and stops if any rank saw the flag, so all ranks emit the same token and stop together.
__device__ void argmax_publish(const Params& p, Shared& s, const int* t, int ct) {
  float best;
  int tok;
  best_of_tasks(p, s, t, ct, best, tok);
  if (ct == 0) {
    const int row = tok == 0x7fffffff ? tok : tok + static_cast<int>(p.rank) * TP_VOCAB_ROWS;
    const float stop = *reinterpret_cast<volatile int*>(p.host_stop) != 0;
    const long long at = t[F_XCHG_BUF] + p.rank * t[F_XCHG_STRIDE];
    for (int r = 0; r < TP; ++r) {
      __stcg(p.peers->act[r] + at, best);
      __stcg(p.peers->act[r] + at + 1, __int_as_float(row));
      __stcg(p.peers->act[r] + at + 2, stop);
    }
  }
}
__device__ void argmax_agree(const Params& p, const int* t, long long step, int ct) {
  if (ct == 0) {
    const float* slot = p.act + t[F_XCHG_BUF];
    float stop = 0.f, best = -INFINITY;
    int tok = 0x7fffffff;
    for (int r = 0; r < TP; ++r) {
      keep_best(__ldcg(slot + r * t[F_XCHG_STRIDE]), __float_as_int(__ldcg(slot + r * t[F_XCHG_STRIDE] + 1)), best, tok);
      stop = fmaxf(stop, __ldcg(slot + r * t[F_XCHG_STRIDE] + 2));
    }
    p.act[TP_STOP_AT] = stop;
    publish_token(p, step, tok);
  }
}
__device__ bool run_argmax_ranks(const Params& p, Shared& s, const int* t, long long step, int task, int ct) {
  argmax_publish(p, s, t, ct);
  exchange_arrive(p, t);
  if (!exchange_await(p, s, t, step, task)) return false;
  argmax_agree(p, t, step, ct);
  return true;
}
#endif
