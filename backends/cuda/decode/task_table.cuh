// tilertc persistent decode kernel: the device library, the first of its parts (the others
// follow in backends/cuda/codegen.py: LIBRARY's order, in one translation unit).
//
// One CTA per SM runs that SM's static instruction stream for every decode step. The last warp
// is the loader: one lane walks the stream ahead of compute and keeps a ring of shared-memory
// pages full of weights (bulk async copies completing on mbarriers), across op, layer and token
// boundaries. The other warps compute; before a task they acquire the counters of the ops it
// depends on, after it they release its own. The generated prelude defines the model's
// constants (HIDDEN, HEAD_DIM, ...) and the ring geometry before the library.
#include <cuda_bf16.h>
#include <stdint.h>
#include <type_traits>
#if WEIGHT_FP8
#include <cuda_fp8.h>
#endif
#ifndef FFN_SPLIT_K  // the prelude defines it (and FIXED_FRAC_BITS) in kernels with split-K FFNs
#define FFN_SPLIT_K 0
#endif
#ifndef FP8_MMA  // the prelude defines it in FP8 kernels compiled with --tune fp8_mma=1
#define FP8_MMA 0
#endif
#ifndef READY_DIGITS  // the prelude defines it where producers write FP8 tile inputs' digits
#define READY_DIGITS 0
#endif

namespace tilertc {

// ---- the task table (written by backends/cuda/encode.py; keep the two in step) -------------
enum Opcode : int {
  OP_EMBED = 0, OP_NORM_MATVEC = 1, OP_MATVEC_ADD = 2, OP_ATTENTION = 3, OP_ARGMAX = 4,
  OP_MOE_TOPK = 5, OP_MOE_GATE_UP = 6, OP_MOE_DOWN_ADD = 7, OP_HEAD_MATVEC = 8, OP_MLA_ATTENTION = 9,
  OP_DSA_SCORE = 10, OP_DSA_TOPK = 11, OP_FFN_SPLIT_K = 12
};
enum Epilogue : int { EPI_NONE = 0, EPI_SILU_MUL = 1, EPI_ARGMAX = 2 };
enum Field : int {
  F_OPCODE, F_EPILOGUE, F_ROW0, F_ROW1, F_K, F_IN, F_OUT, F_AUX, F_AUX2, F_W_LO, F_W_HI,
  F_ROW_BYTES, F_WAIT0, F_WAIT0_N, F_WAIT1, F_WAIT1_N, F_SIGNAL, F_KCACHE, F_VCACHE, F_EPS,
  F_SCALE, F_COUNT, F_CHUNK, F_ARRIVE, F_AUX3, F_W_FORMAT,
#if MOE  // a routed task's rows are F_SLOTS pieces, piece j from the expert in slot F_SLOT0 + j
  F_ROUTE,          // the router's counter, which the loader acquires before reading the ids
  F_IDS,            // act offset of the router's expert ids (int32)
  F_SLOT0, F_SLOTS,
  F_EXPERT_STRIDE,  // bytes / 16 between consecutive experts' packed weights of the op
#endif
#if MOE_SHARED_K  // a down task's rows end with the shared expert's down rows, which are static
  F_SHARED_IN,                // act offset of the shared expert's activations
  F_SHARED_LO, F_SHARED_HI,   // byte offset / 16 of the task's shared rows in the packed weights
#endif
#if MLA  // a head_matvec's rows come in heads of F_HEAD_ROWS, each reading its own F_K inputs
  F_IN_STRIDE,      // act floats between consecutive heads' inputs
  F_HEAD_ROWS,
  F_APPEND,         // 1: this task also normalizes, rotates and appends the step's latent cache row
#endif
#if MLA && WEIGHT_FP8
  F_SCALE_SHIFT,    // log2 of the 4-column groups per scale of its rows (q absorption's: fewer than a block's)
#endif
#if DSA  // a dsa_score task's key LayerNorm bias (its weight: F_AUX3)
  F_NORM_BIAS,
  F_SELECTION_WAIT,  // an MLA attention task's wait (0, 1) for the indexer's selection; -1: none
#endif
#if FFN_SPLIT_K  // a split-K FFN's output is a fixed-point sum (see the split-K FFN section)
  F_FIXED_IN,       // 1: F_IN (a norm_matvec's input) is a fixed-point buffer
  F_FIXED_RES,      // 1: F_AUX (a matvec_add's residual) is a fixed-point buffer
  F_FIXED_OUT,      // a matvec_add: act offset of the fixed-point start value it also writes; -1: none
#endif
#if READY_DIGITS  // passes/digits.py: an FP8 tile task's input made as digits by its producer
  F_DIGITS_IN,      // act offset of the digits this task reads in place of its input; -1: none
  F_DIGITS_OUT,     // act offset of the digits this task writes of its rows for their consumer; -1: none
  F_DIGITS_K,       // that consumer's input length
  F_DIGITS_GAMMA,   // that consumer's norm weight (act offset); -1: it does not normalize
#endif
#if TP > 1  // a task that exchanges with the other ranks (tensor parallelism, see exchange)
  F_XCHG,         // its exchange counter, -1: none
  F_XCHG_BUF,     // act offset of its receive buffer: one slot per rank
  F_XCHG_STRIDE,  // floats between consecutive ranks' slots
#endif
  TASK_FIELDS
};
enum WeightFormat : int { WF_BF16 = 0, WF_FP8 = 1, WF_FP8_TILES = 2 };  // F_W_FORMAT of a matrix-vector task
constexpr int LAG_SHIFT = 24;  // a wait's per-step count in the low bits, its step lag above
// A task's wait w (0, 1): the increments its counter gets per step, and its step lag.
__device__ __forceinline__ int wait_per_step(const int* t, int w) { return t[F_WAIT0_N + 2 * w] & ((1 << LAG_SHIFT) - 1); }
__device__ __forceinline__ int wait_lag(const int* t, int w) { return t[F_WAIT0_N + 2 * w] >> LAG_SHIFT; }

// ---- kernel parameters: 8-byte words, laid out by backends/cuda/runtime.py ---------------
struct Params {
  const int* tasks;            // [n_tasks][TASK_FIELDS]
  const int* stream_offsets;   // [num_ctas + 1] into stream_tasks
  const int* stream_tasks;     // task ids, per CTA in order
  const uint8_t* weights;      // packed weights
  float* act;                  // fp32 arena: activations, norm weights, RoPE table, scratch
  __nv_bfloat16* kv;           // bf16 KV-cache arena
  const __nv_bfloat16* embed;  // [VOCAB][HIDDEN] embedding table
  unsigned* counters;          // one per fused op, zeroed before launch
  int* tokens;                 // [n_steps] device copy of sampled tokens
  int* host_tokens;            // host-mapped ring [n_steps]
  int* host_count;             // host-mapped: tokens written so far
  int* host_stop;              // host-mapped: the host asks the kernel to stop
  int* status;                 // [STATUS_WORDS] error code, where, steps done
  long long first_token, start_pos, n_steps, eos_token, rope_offset, sampler_counter;
  long long watchdog_ns;
  unsigned long long* profile;  // null, or [profile_steps][n_tasks][3] globaltimer stamps
  long long profile_steps, n_tasks;
  const struct SampleArgs* sample;  // the sampling parameters (below)
#if TP > 1
  long long rank;                 // this GPU's rank among TP
  const struct PeerTable* peers;  // every rank's arenas (below)
#endif
};
#if TP > 1
// Tensor parallelism: where every rank's act arena and counters lie, as this GPU addresses them
// (peer pointers over NVLink; this rank's own at [rank]). In global memory, read where used.
struct PeerTable {
  float* act[TP];
  unsigned* counters[TP];
};
#endif
// In their own block, read where they are used: held in registers from the kernel's start like
// the other parameters, they (and what the compiler derives from them) would crowd the
// registers every task needs, and spill.
struct SampleArgs {
  double temperature, top_p;  // float32 values (the host rounds them); temperature 0: greedy
  long long top_k;            // 0: off
  unsigned long long seed;
};
enum Status : int {
  ST_ERROR, ST_ERROR_SM, ST_ERROR_TASK, ST_ERROR_COUNTER, ST_STOP, ST_STEPS, ST_NUCLEUS_CUT, STATUS_WORDS
};
enum ErrorCode : int { ERR_NONE = 0, ERR_WATCHDOG = 1, ERR_BAD_TOKEN = 2, ERR_CONTEXT = 3, ERR_RING = 4 };
