"""Seeded sampling: the semantics of the in-kernel sampler, its reference, and a model of it.

The kernel samples the next token itself (lm_head + sampling are the last tasks of a step), so
that the token loop never returns to the host. This module defines what it computes, in
numpy, so that the kernel can be checked against it given the kernel's own logits.

**Randomness** is counter-based: the uniform for vocabulary row `r` at decode position `pos`
under `seed` is a pure function of the three, `u = ((h >> 12) + 0.5) * 2^-52` with
`h = mix64(mix64(mix64(seed) ^ pos) ^ r)`, where `mix64` is SplitMix64's output function
(Steele, Lea & Flood 2014; add the golden gamma, then Stafford's variant-13 finalizer). No
state is carried between steps or tokens, so a step's draws do not depend on which SM computes
which rows, on the order they run in, or on whether the step ran inside a multi-token launch or
alone: the token loop equals repeated single steps for a seed. Integer arithmetic mod 2^64 is
bit-identical in CUDA and numpy; `u` takes 52 bits so that it is exact in float64 and never 0
or 1. `pos` is the position of the token fed to the step (the sampled token goes to pos + 1).

**Temperature only** (top_k == 0, top_p == 1): the Gumbel-max trick. With g_r = -log(-log u_r),
argmax_r (logit_r / T + g_r) is exactly a draw from softmax(logits / T). Every lm_head task
scores its own rows and keeps its best (score, row) pair, the same reduction greedy decoding
uses for (logit, row): sampling costs two logarithms per row, fully parallel, and no extra
pass. The noise is computed in float64 (52-bit uniforms keep the Gumbel tail, up to ~36.7,
and its resolution where the winner lives, ~log(vocab)); the score is float32:
`logit / T + float32(g)` with IEEE division and addition, the same operations in both
implementations, so that the kernel's token is this module's token except where two scores
differ in the last bit of the float64 logarithm.

**top-k / top-p** need an order over the whole vocabulary, which no task sees. Each lm_head
task keeps its `slots` largest logits (slots = min(K_MAX, its rows)) with their rows, the
largest logit m_t and s_t = sum exp((logit - m_t) / T) over its rows; the sampler merges them:
the global top K_MAX are within the union of every task's top K_MAX, and
Z = sum_t s_t exp((m_t - M) / T) is the exact softmax normalizer over the vocabulary. On the
K_MAX best candidates, sorted by (logit descending, row ascending), it applies
- top-k: keep the k best (k <= K_MAX, checked);
- top-p: keep the smallest prefix whose mass reaches top_p (a token is kept when the tokens
  before it hold less than top_p), the mass taken under softmax(logits / T) over the tokens
  top-k kept, or over the whole vocabulary when top_k == 0 (the usual convention:
  temperature, then top-k, then top-p renormalized over what top-k kept);
and draws by Gumbel-max over the kept set S: argmax_{r in S} (logit_r / T + g_r), with the same
noise as the temperature-only path, exactly a draw from softmax(logits / T) restricted to S.
Only the nucleus is approximate: with top_k == 0 a nucleus of more than K_MAX tokens (a flat
distribution with top_p near 1) is cut to the K_MAX most likely tokens; the kernel counts such
steps (`Engine.nucleus_cut_steps`). With top_k > 0 everything is exact. The cut keeps the
kernel to one pass over the logits: an exact nucleus needs a selection over the whole
vocabulary by cumulative mass after the normalizer is known, a second pass of every lm_head
row through one SM (several µs a token) for a case top-k avoids.

Temperature 0 is greedy (the first largest logit), whatever top_k and top_p say.

Selecting the top `want` of many (key, row) pairs inside a CTA is done without sorting: keys
are floats mapped to order-preserving uint32; the want-th largest key is found bit by bit
from the top (32 block-wide counts of "keys >= probe"), ties at that key are cut by row, again
bit by bit. `select_top` below is that algorithm, line for line, so it is tested here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

K_MAX = 64  # most candidates the sampler keeps; top_k may not exceed it
MIN_TEMPERATURE = 1e-6  # below it logit / T overflows float32 for large logits

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_MUL1 = _U64(0xBF58476D1CE4E5B9)
_MUL2 = _U64(0x94D049BB133111EB)


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. Construction validates; the kernel reads temperature and
    top_p as float32 (see `temperature32`, `top_p32`)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise ValueError(f"temperature must be a finite number, got {t!r}")
        if t < 0 or 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, "
                             f"got {t!r}")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= K_MAX:
            raise ValueError(f"top_k must be an integer from 0 (off) to {K_MAX} (the kernel "
                             f"keeps at most {K_MAX} candidates), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {p!r}")
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s < 2**64:
            raise ValueError(f"seed must be an integer in [0, 2^64), got {s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filtered(self) -> bool:
        """Whether top-k or top-p applies (the candidate path); else Gumbel-max over all rows."""
        return not self.greedy and (self.top_k > 0 or self.top_p32 < 1)

    @property
    def temperature32(self) -> np.float32:
        return np.float32(self.temperature)

    @property
    def top_p32(self) -> np.float32:
        return np.float32(self.top_p)


# -- the random numbers ------------------------------------------------------------------------

def mix64(x: np.ndarray | int) -> np.ndarray:
    """SplitMix64's output function of x (x plus the golden gamma, then mixed), elementwise."""
    with np.errstate(over="ignore"):
        z = np.asarray(x, dtype=_U64) + _GOLDEN
        z = (z ^ (z >> _U64(30))) * _MUL1
        z = (z ^ (z >> _U64(27))) * _MUL2
    return z ^ (z >> _U64(31))


def stream_key(seed: int, positions: np.ndarray | int) -> np.ndarray:
    """The key of (seed, position): everything a step's draws share."""
    return mix64(mix64(seed) ^ np.asarray(positions, dtype=_U64))


def uniforms(seed: int, positions: np.ndarray | int, rows: np.ndarray | int) -> np.ndarray:
    """u in (0, 1), float64, for each (position, row) (numpy broadcasting)."""
    key = stream_key(seed, positions)
    h = mix64(key ^ np.asarray(rows, dtype=_U64))
    return ((h >> _U64(12)).astype(np.float64) + 0.5) * 2.0**-52


def gumbel(seed: int, positions: np.ndarray | int, rows: np.ndarray | int) -> np.ndarray:
    """Standard Gumbel noise -log(-log u), computed in float64, rounded to float32."""
    return (-np.log(-np.log(uniforms(seed, positions, rows)))).astype(np.float32)


def gumbel_scores(logits: np.ndarray, temperature: np.float32, seed: int, position: int,
                  rows: np.ndarray) -> np.ndarray:
    """float32 logit / T + g for `rows`: the kernel's operations (IEEE division, addition)."""
    with np.errstate(over="ignore"):
        return logits[rows] / temperature + gumbel(seed, position, rows)


# -- the reference ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Sample:
    """A sampled token and how robust the choice is: `margin` is the smaller of the winner's
    score lead over the runner-up (relative to max(1, |score|)) and, under top-p, the distance
    of the nucleus boundary from top_p (in probability); a kernel computing with other
    roundings may differ only where `margin` is tiny. `kept`: the tokens it was drawn among;
    `cut`: the nucleus was cut to the candidates."""

    token: int
    margin: float
    kept: int
    cut: bool = False


def _as_f32(logits: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(logits, torch.Tensor):
        logits = logits.detach().float().cpu().numpy()
    x = np.asarray(logits, dtype=np.float32).reshape(-1)
    if x.size == 0:
        raise ValueError("sampling needs at least one logit")
    return x


def _best(scores: np.ndarray, rows: np.ndarray) -> tuple[int, float]:
    """The row of the largest score (the lowest row among equal ones) and its relative lead."""
    top = scores.max()
    token = int(rows[scores == top].min())
    rest = scores[rows != token]
    lead = float(top) - float(rest.max()) if rest.size else math.inf
    return token, lead / max(1.0, abs(float(top)))


def by_rank(logits: np.ndarray) -> np.ndarray:
    """Rows sorted by logit descending, row ascending among equal logits."""
    return np.lexsort((np.arange(logits.size), -logits.astype(np.float64)))


def nucleus(q: np.ndarray, z: float, top_p: float) -> tuple[int, float]:
    """How many of the sorted masses `q` (normalizer `z`) the nucleus keeps: token j is kept
    when the tokens before it hold less than top_p. Returns (count, the distance from top_p,
    in probability, of the mass before the last kept and before the first dropped token, or
    of all of `q` when none is dropped)."""
    before = np.concatenate(([0.0], np.cumsum(q)))  # before[j]: mass of tokens 0..j-1
    keep = int(np.count_nonzero(before[:-1] < top_p * z))
    gaps = [abs(before[j] / z - top_p) for j in (keep - 1, keep) if 0 < j <= q.size]
    return keep, min(gaps, default=math.inf)


def sample(logits: np.ndarray | torch.Tensor, params: SamplingParams, position: int,
           candidates: int | None = K_MAX) -> Sample:
    """The token the kernel samples from `logits` [vocab] at decode `position`: float64
    arithmetic except where the kernel's float32 operations define the result (scores).
    `candidates`: how many of the most likely tokens the nucleus may use (the kernel's K_MAX;
    None: the whole vocabulary, the exact nucleus)."""
    x = _as_f32(logits)
    rows = np.arange(x.size)
    if params.greedy:
        token, lead = _best(x, rows)
        return Sample(token, lead, 1)
    temp = params.temperature32
    if not params.filtered:
        token, lead = _best(gumbel_scores(x, temp, params.seed, position, rows), rows)
        return Sample(token, lead, x.size)
    order = by_rank(x)
    n = x.size if candidates is None else min(candidates, x.size)
    k = min(params.top_k, n) if params.top_k else n
    x64, t64, m = x.astype(np.float64), float(temp), float(x[order[0]])
    q = np.exp((x64[order[:k]] - m) / t64)
    z = q.sum() if params.top_k else np.exp((x64 - m) / t64).sum()
    keep, mass_gap, cut = k, math.inf, False
    if params.top_p32 < 1:
        keep, mass_gap = nucleus(q, z, float(params.top_p32))
        cut = not params.top_k and keep == n < x.size and q.sum() < float(params.top_p32) * z
    kept = order[:keep]
    token, lead = _best(gumbel_scores(x, temp, params.seed, position, kept), kept)
    return Sample(token, min(lead, mass_gap), keep, cut)


def sample_tokens(logits: torch.Tensor, positions: torch.Tensor,
                  params: SamplingParams) -> torch.Tensor:
    """The sampler as an interpreter op: logits [T, vocab], positions [T] -> tokens [T, 1]
    (int64, on the logits' device). Greedy is exactly the `argmax` op."""
    if params.greedy:
        return logits.argmax(-1, keepdim=True)
    tokens = [sample(row, params, int(pos)).token
              for row, pos in zip(logits, positions.tolist(), strict=True)]
    return torch.tensor(tokens, dtype=torch.long, device=logits.device)[:, None]


# -- a model of the kernel's algorithm ----------------------------------------------------------

def order_key(x: np.ndarray) -> np.ndarray:
    """float32 -> uint32 with the same order (decode/sampling.cuh: order_key)."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    return np.where(bits >> np.uint32(31), ~bits, bits | np.uint32(0x80000000)).astype(np.uint32)


def row_bits(vocab: int) -> int:
    """Bits that hold every row id below `vocab`."""
    return max(0, (vocab - 1).bit_length())


def select_top(keys: np.ndarray, rows: np.ndarray, want: int, bits_of_rows: int) -> np.ndarray:
    """Mask of the `want` largest keys (ties: the lowest rows), by counting: the want-th largest
    key bit by bit from the top, then, if more keys equal it than fit, the largest row taken among
    those, bit by bit. decode/sampling.cuh's `select_top` takes the same rows (its key by 8-bit
    digits in a block-wide histogram: `kth_largest`)."""
    keys = keys.astype(np.uint32)
    kth, at = 0, keys.size  # at: how many keys are >= kth
    for b in range(31, -1, -1):
        probe = kth | (1 << b)
        n = int(np.count_nonzero(keys >= probe))
        if n >= want:
            kth, at = probe, n
    last = np.iinfo(np.int64).max  # the largest row taken among keys equal to kth
    if at > want:
        need = want - int(np.count_nonzero(keys > kth))
        tie = keys == kth
        last = 0
        for b in range(bits_of_rows - 1, -1, -1):
            probe = last | (1 << b)
            if np.count_nonzero(tie & (rows < probe)) < need:
                last = probe
    return (keys > kth) | ((keys == kth) & (rows <= last))


NO_CANDIDATE = np.array([0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]  # order key 0


@dataclass(frozen=True)
class TaskRecord:
    """What one lm_head task leaves for the sampler: m_t, s_t, and its candidates."""

    top: float
    mass: float
    logits: np.ndarray  # float32 [slots]; an unused slot holds NO_CANDIDATE (a NaN)
    rows: np.ndarray  # int [slots]; unused slots -1


def task_record(logits: np.ndarray, row0: int, row1: int, slots: int, temperature: np.float32,
                vocab: int) -> TaskRecord:
    """The lm_head task of rows [row0, row1): float32 as in the kernel."""
    y = logits[row0:row1]
    top = y.max()
    with np.errstate(under="ignore"):
        mass = np.exp((y - top) / temperature).sum(dtype=np.float32)
    rows = np.arange(row0, row1)
    if y.size > slots:
        keep = select_top(order_key(y), rows, slots, row_bits(vocab))
        y, rows = y[keep], rows[keep]
    pad = slots - y.size
    return TaskRecord(float(top), float(mass),
                      np.concatenate((y, np.full(pad, NO_CANDIDATE, np.float32))),
                      np.concatenate((rows, np.full(pad, -1))))


def merge_records(records: list[TaskRecord], params: SamplingParams, position: int,
                  vocab: int) -> Sample:
    """The sampler task: the global top candidates of the records, then top-k, top-p and a
    Gumbel-max draw over the kept ones."""
    ys = np.concatenate([r.logits for r in records])
    rows = np.concatenate([r.rows for r in records])
    valid = order_key(ys) != 0  # as the kernel tells an unused slot
    ys, rows = ys[valid], rows[valid]
    want = min(K_MAX, vocab)
    keep = select_top(order_key(ys), rows, want, row_bits(vocab))
    ys, rows = ys[keep], rows[keep]
    order = np.lexsort((rows, -ys.astype(np.float64)))
    ys, rows = ys[order], rows[order]
    temp = params.temperature32
    t64, m = float(temp), float(ys[0])
    k = min(params.top_k, want) if params.top_k else want
    q = np.exp((ys[:k].astype(np.float64) - m) / t64)
    if params.top_k:
        z = q.sum()
    else:
        z = sum(r.mass * math.exp((r.top - m) / t64) for r in records)
    n, cut, mass_gap = k, False, math.inf
    if params.top_p32 < 1:
        n, mass_gap = nucleus(q, z, float(params.top_p32))
        cut = not params.top_k and n == want < vocab and q.sum() < float(params.top_p32) * z
    kept = rows[:n]
    scores = ys[:n] / temp + gumbel(params.seed, position, kept)
    token, lead = _best(scores, kept)
    return Sample(token, min(lead, mass_gap), n, cut)


def tiled_sample(logits: np.ndarray | torch.Tensor, params: SamplingParams, position: int,
                 tasks: int) -> Sample:
    """The kernel's sampling over `tasks` lm_head tasks of consecutive rows (as tiling cuts
    them): greedy and temperature-only reduce each task's best (value, row) pair; top-k /
    top-p go from per-task records through the sampler's merge to the token."""
    x = _as_f32(logits)
    if not 0 < tasks <= x.size:
        raise ValueError(f"{tasks} tasks cannot split {x.size} rows (tiling makes at most one "
                         "task per row)")
    bounds = [x.size * i // tasks for i in range(tasks + 1)]
    if not params.filtered:
        rows = np.arange(x.size)
        values = x if params.greedy else gumbel_scores(x, params.temperature32, params.seed,
                                                       position, rows)
        pairs = [_best(values[b0:b1], rows[b0:b1]) for b0, b1 in
                 zip(bounds[:-1], bounds[1:], strict=True)]
        best = max(values[row] for row, _ in pairs)
        token = min(row for row, _ in pairs if values[row] == best)
        return Sample(token, _best(values, rows)[1], 1 if params.greedy else x.size)
    slots = candidate_slots(x.size, tasks)
    records = [task_record(x, bounds[i], bounds[i + 1], slots, params.temperature32, x.size)
               for i in range(tasks)]
    return merge_records(records, params, position, x.size)


def candidate_slots(rows: int, tasks: int) -> int:
    """Candidates each of `tasks` lm_head tasks over `rows` vocabulary rows keeps."""
    return min(K_MAX, -(-rows // tasks))


def partials_floats(rows: int, tasks: int) -> int:
    """fp32 words of `sample_partials`: (m_t, s_t) per task, then every task's candidate
    logits, then their rows (decode/sampling.cuh: CANDIDATE_LOGITS, CANDIDATE_ROWS)."""
    return tasks * (2 + 2 * candidate_slots(rows, tasks))
