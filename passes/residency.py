"""Residency and pipeline depth: where every tensor lives and how deep the weight ring is.

Decides:
- weights stream from HBM through a ring of shared-memory pages (bulk async copies); the
  ring gets all shared memory not needed for the activation vector a task reads, as pages of
  `page_bytes` (at least `PAGE_KB`, grown to hold a dense row op's largest task whole where
  that keeps the ring's depth: `_page_holding_row_tasks`; and at least a block of an MLA
  attention task's cache rows and the RoPE factors, which it keeps in its page of the ring),
  and its depth is checked against Little's law (bytes in flight per SM must cover the SM's
  share of bandwidth times the HBM latency);
- activations (a few KB per layer), norm weights and the RoPE table are L2-resident global
  fp32 buffers in one arena, each activation with its own buffer so that no task of a step
  overwrites what another may still read;
- the KV cache is a bf16 arena laid out [layer][kv_head][position][head_dim], so that an
  attention task reads its head's keys contiguously;
- the input vector of a matrix-vector task is staged in shared memory as fp32, next to its
  row sums (the warps that share a row meet there); an FP8 tile task's as four e4m3 digits
  per column and a factor per 128-column block (and a normed task's norm weight, copied in
  with its input), and its pages hold whole tile units; a
  split-K FFN task's intermediate slice replaces its staged input there once its gate/up rows
  are done;
- a split-K FFN's output is a 64-bit fixed-point buffer (`fx64`, two words of the arena per
  element), which its tasks add into;
- attention chunks leave their partial softmax results in one global scratch buffer that the
  merging task reads (MLA chunks in their own, `mla_partials`);
- expert and token ids (MoE routing, DSA top-k) are int32 buffers in the same arena;
- lm_head tasks leave their results for the sampler in `argmax_partials` and, for top-k /
  top-p, `sample_partials` (ir/sampling.py).
"""

from __future__ import annotations

from tilertc.ir.fp8 import tile_unit_bytes
from tilertc.ir.graph import TensorKind
from tilertc.ir.sampling import partials_floats
from tilertc.passes.digits import digits_floats
from tilertc.passes.program import Buffer, Program, ScheduleError
from tilertc.passes.roles import compute_warps
from tilertc.passes.sharding import exchange_ops
from tilertc.passes.tiling import MATVEC, ROUTED, is_fp8_rows, is_tiled, stream_row_bytes

ALIGN = 16  # elements; keeps every buffer 64-byte aligned
# the tiled ops whose tasks normalize their input first (decode/shared.cuh: normed; its third,
# ffn_split_k, takes bf16 weights only, never tiles)
NORMED = ("norm_matvec", "moe_gate_up")
PAGE_KB = 64  # smallest ring page: fewer, larger pages cost fewer hand-offs per byte
# (llama-3.2-1b on the H200: 16 KB pages 1.44 ms/token, 32 KB 1.19, 48 KB 1.12, 64 KB 1.09)
REDUCTION_FLOATS = 1024  # cross-warp reduction scratch
MLA_KEYS = 32  # cache rows an MLA attention task scores, then accumulates, at a time
MLA_TILE_ROWS = 16  # heads an MLA attention task's mma tiles hold (MLA_HEADS of them used)
MLA_KSPLIT = 4  # warps sharing the k-steps of one tile of an MLA block's scores
DSA_KEYS = 64  # index key rows a DSA indexer task stages, then scores, at a time
FLAG_BYTES = 32
TASK_SLOT = 64  # fields a task row's slot in shared memory holds (decode/kernel.cuh: run_compute)
# task rows in shared memory: this task's, the next one's (copied in while this task waits for
# its dependencies) and the one before's (which its signalling thread may still read)
TASK_SLOTS = 3
TASK_ROW_BYTES = TASK_SLOTS * TASK_SLOT * 4


def smem_bytes(pages: int, page: int, vec_floats: int, acc_floats: int) -> int:
    """Shared memory of one CTA: the ring, two mbarriers per page, the staged vector, the row
    sums, reduction scratch, flags and task rows (the layout of decode/shared.cuh's `carve`)."""
    floats = -(-vec_floats // 4) * 4 + -(-acc_floats // 4) * 4 + REDUCTION_FLOATS
    return pages * page + 16 * pages + 4 * floats + FLAG_BYTES + TASK_ROW_BYTES


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _mla_row(rank: int, rope: int) -> int:
    """bf16 values a staged MLA cache row (or query) takes: padded to a multiple of 64 values
    plus 8, so that fragment loads hit distinct banks."""
    return -(-(rank + rope) // 64) * 64 + 8


def _mla_block(rank: int, rope: int) -> int:
    """Bytes of a block of `MLA_KEYS` staged MLA cache rows (bf16)."""
    return MLA_KEYS * _mla_row(rank, rope) * 2


def mla_block_bytes(program: Program) -> int:
    """Bytes of the ring page of the program's MLA attention (0 without one): its tasks keep
    every other block in a ring page (decode/mla.cuh: mla_chunk), so that the next block's copies
    land while one is computed, and after the block the position's RoPE cos | sin (fp32), which
    the loader puts there with, maybe, the first block (decode/loader.cuh: load_mla_page)."""
    return max((_mla_block(op.attrs["kv_lora_rank"], op.attrs["qk_rope_head_dim"])
                + 4 * op.attrs["qk_rope_head_dim"]
                for op in program.graph.ops() if op.opcode == "mla_attention"), default=0)


def mla_staged_floats(heads: int, rank: int, rope: int) -> int:
    """Shared memory (fp32 words) of an MLA attention chunk task (decode/mla.cuh: MlaStage, whose
    static_assert checks it against MAX_K): the queries of a 16-row mma tile as bf16 hi and
    lo, a block of `MLA_KEYS` cache rows (bf16; rows and queries padded to a multiple of 64
    values plus 8, so that fragment loads hit distinct banks), the block's scores summed over
    each of `MLA_KSPLIT` k-ranges, its probabilities (bf16 hi and lo, rows of MLA_KEYS + 8),
    each head's softmax state (the position's RoPE cos | sin are in the task's ring page:
    mla_block_bytes)."""
    row = _mla_row(rank, rope)
    tile = MLA_TILE_ROWS * row + _mla_block(rank, rope) // 4 + MLA_KSPLIT * MLA_TILE_ROWS * MLA_KEYS
    return tile + MLA_TILE_ROWS * (MLA_KEYS + 8) + 3 * heads


def dsa_staged_floats(heads: int, dim: int) -> int:
    """Shared memory (fp32 words) of a DSA indexer chunk task (decode/dsa.cuh: DsaStage, whose
    static_assert checks it against MAX_K): the queries as bf16 hi and lo in m-tiles of 16
    heads, a block of `DSA_KEYS` key rows (bf16; rows and queries padded to a multiple of 64
    values plus 8, so that fragment loads hit distinct banks), each m-tile's sums of a block's
    keys, the head weights (per padded head) and the step's normed key."""
    rows = -(-heads // MLA_TILE_ROWS) * MLA_TILE_ROWS
    row = -(-dim // 64) * 64 + 8
    return rows * row + DSA_KEYS * row // 2 + rows // MLA_TILE_ROWS * DSA_KEYS + rows + dim


def _staged_floats(program: Program) -> int:
    """Shared memory (fp32) the MLA and DSA tasks stage: a head_matvec the inputs of the heads
    its rows span (v expansion, which merges them, also each chunk's factor per head; FP8
    rows then their e4m3 digits); an MLA chunk see `mla_staged_floats`; a DSA chunk see
    `dsa_staged_floats`."""
    g = program.graph
    need = [0]
    for t in program.tasks:
        if t.opcode == "head_matvec":
            a = g.op(t.op).attrs
            per = a["rows_per_head"]
            chunks = g.op(a["merges"]).attrs["tile"]["chunks"] if "merges" in a else 0
            # FP8 rows: after the merge, each head's x also as 4 e4m3 digits a column and a
            # factor per scale block of at least 32 columns, and one head more of both (zeros)
            # (decode/matvec.cuh: head_rows_fp8; counted for all, a few KB)
            k = a["K"]
            per_head, extra = k + chunks, 0
            if is_fp8_rows(program, g.op(t.op)):
                per_head, extra = max(per_head, 2 * k + k // 32), k + k // 32
            need.append((-(-t.rows[1] // per) - t.rows[0] // per) * per_head + extra)
    for op in g.ops():
        a = op.attrs
        if op.opcode == "mla_attention":
            need.append(mla_staged_floats(a["tile"]["heads_per_task"], a["kv_lora_rank"],
                                          a["qk_rope_head_dim"]))
        elif op.opcode == "dsa_score":
            need.append(dsa_staged_floats(a["n_heads"], a["head_dim"]))
    return max(need)


def _tile_staged_floats(op) -> int:
    """Shared memory (fp32 words) of an FP8 tile task's input: 4 bytes of digits per column
    and a factor per 128-column block; a normed task's norm weight beside them
    (decode/tile_digits.cuh: stage_digits), or, where its producer made the digits, the rest of
    their buffer, copied in with them (passes/digits.py, decode/ready_digits.cuh:
    stage_ready_digits)."""
    k = op.attrs["K"]
    if op.attrs.get("ready_digits"):
        return k // 128 + digits_floats(op)
    return k * (2 if op.opcode in NORMED else 1) + k // 128


def _tile_floats(program: Program, op) -> int:
    """An FP8 tile task's input and, past it, the row sums of every compute warpgroup but the
    first (which adds into the row sums' own space; decode/tile_pages.cuh: tile_sums)."""
    return _tile_staged_floats(op) + (compute_warps(program) // 4 - 1) * _row_sums(op)


def _row_sums(op) -> int:
    """The most row sums a task of a matrix-vector op keeps (a gate/up row's two halves)."""
    return _most_rows(op) * (2 if op.attrs.get("interleave") else 1)


def _most_rows(op) -> int:
    """The most output rows a task of a matrix-vector op has."""
    tile = op.attrs["tile"]
    if "rows_per_task" in tile:
        return tile["rows_per_task"][1]
    return -(-op.attrs["rows"] // tile["tasks"])


def rope_dim(attn) -> int:
    """The dims RoPE rotates per head, which the RoPE table holds cos and sin for: GQA's
    head_dim, MLA's qk_rope_head_dim (its key's rope part and every query's)."""
    a = attn.attrs
    return a["qk_rope_head_dim"] if attn.opcode == "mla_attention" else a["head_dim"]


def ring_depth(ring: int, page: int) -> int:
    """Pages of `page` bytes that `ring` bytes of shared memory hold, each page with its two
    mbarriers (8 B each)."""
    return (ring - 16) // (page + 16)


def _page_holding_row_tasks(program: Program, mv_ops: list, page: int, ring: int) -> int:
    """The ring page, grown to hold whole the largest task of a dense op of rows that spills
    past it, where the ring keeps as many pages. A page costs a round of the compute warps
    however few rows it holds, so a task one row past its page pays a page for that row:
    qwen3-30b-a3b FP8's o_proj tasks of 16 rows of 4224 B against a 64 KB page, 3.8 % of its
    step (the H200, docs/performance.md, session 43). Larger pages as such gained nothing there
    (llama-3.2-1b, the MLA layers), so the page grows only to a task that needs it."""
    largest: dict[str, int] = {}
    rows = {op.name for op in mv_ops if op.opcode in MATVEC and not is_tiled(program, op)}
    for t in program.tasks:
        if t.op in rows:
            largest[t.op] = max(largest.get(t.op, 0), t.weight_bytes)
    fits = {op: size for op, size in ((op, -(-b // 1024) * 1024) for op, b in largest.items())
            if size > page and ring_depth(ring, size) == ring_depth(ring, page)}
    if not fits:
        return page
    grown = max(fits.values())
    kinds = sorted({op.split(".", 2)[-1] for op in fits})  # layers.N.<kind>
    program.decide("residency", f"ring page {page} -> {grown} B, so that each task of "
                   f"{', '.join(kinds)} (rows) takes one page instead of two")
    return grown


def place(program: Program) -> Program:
    g, tgt = program.graph, program.target
    # -- shared memory plan
    mv_ops = [op for op in g.ops() if op.opcode in (*MATVEC, *ROUTED, "ffn_split_k")]
    for op in mv_ops:
        if op.attrs["K"] % 8:
            raise ScheduleError(
                f"op {op.name!r}: input length {op.attrs['K']} is not a multiple of 8; "
                "weight rows must be whole 16-byte pieces for bulk copies"
            )
    for op in g.ops():
        if op.opcode == "attention" and op.attrs["head_dim"] % 8:
            raise ScheduleError(
                f"op {op.name!r}: head_dim {op.attrs['head_dim']} is not a multiple of 8; "
                "KV-cache rows must be whole 16-byte pieces for bulk copies"
            )
    max_k = max(_tile_floats(program, op) if is_tiled(program, op) else op.attrs["K"]
                for op in mv_ops)
    attn = [op.attrs for op in g.ops() if op.opcode == "attention"]
    # attention stages its query heads, the new key and value, and its merge buffer there too
    # (and, in the task that merges a group, every chunk's max and sum per head and a batch of
    # `merge_chunks` chunk results, copied in whole 16-byte pieces)
    attn_floats = max(
        (
            (a["tile"]["merge_chunks"] + 1) * a["n_heads"] // a["n_kv_heads"] * (a["head_dim"] + 2)
            + (2 * a["tile"]["chunks"] + 1) * a["n_heads"] // a["n_kv_heads"]
            + 8  # the merge's copies past its batch (aligned as the key below, by its + 4)
            + a["n_heads"] // a["n_kv_heads"] * a["head_dim"]
            + 5 * a["head_dim"]
            + a["head_dim"] + 4  # this step's key and value in bf16, 16-byte aligned
            for a in attn
        ),
        default=0,
    )
    # a split-K FFN task's slice: its gate/up pairs' sums, then its intermediate values
    widest = max((op.attrs["tile"]["columns_per_task"][1] for op in mv_ops
                  if op.opcode == "ffn_split_k"), default=0)
    vec_floats = max(max_k, attn_floats, _staged_floats(program), widest)
    act_smem = vec_floats * 4
    acc_floats = max(_row_sums(op) for op in mv_ops if op.opcode != "ffn_split_k")
    acc_floats = max(acc_floats, 2 * widest)
    ring = tgt.smem_per_block - smem_bytes(0, 0, vec_floats, acc_floats)
    max_row = max(stream_row_bytes(program, op) for op in mv_ops)
    worst = max(mv_ops, key=lambda op: stream_row_bytes(program, op))
    half = (ring - 32) // 2  # two pages and their mbarriers must fit
    if half < max_row:
        raise ScheduleError(
            f"op {worst.name!r}: one weight row is {max_row} B; two rows do not fit "
            f"the {tgt.smem_per_block} B of shared memory of {tgt.name} next to "
            f"the {act_smem} B input vector"
        )
    block = mla_block_bytes(program)
    if half < block:
        raise ScheduleError(
            f"an MLA attention block of {block} B does not fit a ring page: "
            f"{tgt.smem_per_block} B of shared memory of {tgt.name} leave {half} B a page"
        )
    least = max(max_row, block)  # a page holds a row, and an MLA key block
    asked = program.config.get("tuning", {}).get("page_kb", PAGE_KB) * 1024
    if block > max(asked, max_row):
        program.decide("residency", f"pages of at least {block} B: an MLA attention task keeps "
                       f"every other block of {MLA_KEYS} cache rows and the RoPE factors in one")
    page = max(least, asked)
    if any(is_tiled(program, op) for op in mv_ops):  # pages of whole FP8 tile units, any size
        unit = tile_unit_bytes(8 * 1024)  # the largest: 8 segments of 256-column units
        page = max(unit, round(page / unit) * unit)
    page = max(least, min(-(-page // 1024) * 1024, half // 1024 * 1024))
    if "page_kb" not in program.config.get("tuning", {}):
        page = _page_holding_row_tasks(program, mv_ops, page, ring)
    pages = ring_depth(ring, page)  # at least 2 fit (`half` above)
    in_flight_needed = tgt.hbm_bandwidth / tgt.num_sms * tgt.hbm_latency_ns * 1e-9
    program.config.update(
        page_bytes=page,
        ring_pages=pages,
        vec_floats=vec_floats,
        acc_floats=acc_floats,
        smem_bytes=smem_bytes(pages, page, vec_floats, acc_floats),
    )
    program.decide(
        "residency",
        f"weight ring: {pages} pages x {page // 1024} KB = "
        f"{pages * page // 1024} KB per SM in flight (Little's law needs "
        f"{in_flight_needed / 1024:.0f} KB at {tgt.hbm_bandwidth / 1e12:.2f} TB/s, "
        f"{tgt.hbm_latency_ns:.0f} ns)",
    )
    program.decide(
        "residency",
        f"input vector in shared memory: {vec_floats} fp32 "
        f"({act_smem // 1024} KB); row sums: {acc_floats} fp32",
    )
    # -- global buffers
    act_off = kv_off = 0
    for t in g.tensors.values():
        if t.kind is TensorKind.ACTIVATION and t.dtype == "int64":  # expert and token ids
            program.buffers[t.name] = Buffer(t.name, act_off, t.numel, "int32", "act")
            act_off += _align(t.numel)
        elif t.kind is TensorKind.ACTIVATION and t.dtype == "fx64":  # a split-K FFN's sum
            program.buffers[t.name] = Buffer(t.name, act_off, t.numel, "fx64", "act")
            act_off += _align(2 * t.numel)
        elif t.kind in (TensorKind.ACTIVATION, TensorKind.OUTPUT) and t.dtype != "int64":
            program.buffers[t.name] = Buffer(t.name, act_off, t.numel, "fp32", "act")
            act_off += _align(t.numel)
        elif t.kind is TensorKind.WEIGHT and len(t.shape) == 1:
            program.buffers[t.name] = Buffer(t.name, act_off, t.numel, "fp32", "act")
            act_off += _align(t.numel)
        elif t.kind is TensorKind.KV_CACHE:
            program.buffers[t.name] = Buffer(t.name, kv_off, t.numel, "bf16", "kv")
            kv_off += _align(t.numel)
    for op in g.ops():
        if op.opcode in ("attention", "mla_attention"):
            dim = rope_dim(op)
            seq = g.attrs["max_seq_len"]
            program.buffers["rope_table"] = Buffer("rope_table", act_off, seq * dim, "fp32", "act")
            act_off += _align(seq * dim)
            break
    if attn:
        a, chunks = (
            attn[0],
            max(op.attrs["tile"]["chunks"] for op in g.ops() if op.opcode == "attention"),
        )
        part = a["n_kv_heads"] * chunks * (a["n_heads"] // a["n_kv_heads"]) * (a["head_dim"] + 2)
        # one buffer serves every layer: a layer's merge finishes before the next layer's
        # attention can start (it waits on o_proj, which waits on the merge)
        program.buffers["attn_partials"] = Buffer("attn_partials", act_off, part, "fp32", "act")
        act_off += _align(part)
    mla = [op.attrs for op in g.ops() if op.opcode == "mla_attention"]
    if mla:  # chunk results of MLA attention, one buffer for every layer as for GQA (their
        # merge is v_expand's staging, which the next layer's attention waits for too)
        part = max(
            a["tile"]["tasks"] * a["tile"]["heads_per_task"] * (a["kv_lora_rank"] + 2) for a in mla
        )
        program.buffers["mla_partials"] = Buffer("mla_partials", act_off, part, "fp32", "act")
        act_off += _align(part)
    lm = [op for op in g.ops() if op.attrs.get("epilogue") == "argmax"]
    if lm:
        n = lm[0].attrs["tile"]["tasks"]
        program.buffers["argmax_partials"] = Buffer(
            "argmax_partials", act_off, 2 * n, "fp32", "act"
        )
        act_off += _align(2 * n)
        # top-k / top-p: each task's softmax partial and best candidates (ir/sampling.py)
        part = partials_floats(lm[0].attrs["rows"], n)
        program.buffers["sample_partials"] = Buffer("sample_partials", act_off, part, "fp32", "act")
        act_off += _align(part)
    for op in g.ops():  # one per producer, named after its first reader (passes/digits.py)
        if op.attrs.get("ready_digits") == op.name:
            name, n = f"{op.name}.digits", digits_floats(op)
            program.buffers[name] = Buffer(name, act_off, n, "fp32", "act")
            act_off += _align(n)
    act_off = _exchange_buffers(program, act_off)
    program.config.update(act_arena=act_off, kv_arena=kv_off)
    program.decide(
        "residency",
        f"activations, norm weights, RoPE table: L2-resident fp32 arena of "
        f"{act_off * 4 / 1024:.0f} KB; KV cache: bf16 arena of {kv_off * 2 / 2**20:.1f} MB",
    )
    return program


# The sampler's exchange under tp: per rank (best value, best row, stop flag, unused).
SAMPLE_EXCHANGE_FLOATS = 4


def _exchange_buffers(program: Program, act_off: int) -> int:
    """Under tp > 1, the receive buffers of the exchanges (passes/synchronization.py): per
    all-reducing op, tp slots of its output rows (slot r holds rank r's partial sum); for the
    sampler, tp slots of SAMPLE_EXCHANGE_FLOATS. One per op, not shared between ops: another
    rank may write an op's slot as soon as its own copy of the task has run."""
    if program.tp == 1:
        return act_off
    ops = exchange_ops(program)
    for op in ops:
        name = f"{op.name}.exchange"
        n = program.tp * op.attrs["rows"]
        program.buffers[name] = Buffer(name, act_off, n, "fp32", "act")
        act_off += _align(n)
    n = program.tp * SAMPLE_EXCHANGE_FLOATS
    program.buffers["sample_exchange"] = Buffer("sample_exchange", act_off, n, "fp32", "act")
    program.decide("residency", f"tp {program.tp}: receive buffers of {len(ops)} all-reduces "
                   f"({sum(program.tp * op.attrs['rows'] for op in ops) * 4 / 2**20:.2f} MB) "
                   "and the sampler's exchange in the act arena, written by every rank")
    return act_off + _align(n)
