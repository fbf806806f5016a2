"""Tiling: split every fused op into tasks so that each SM streams the same bytes.

Decides the tile of each task. A matrix-vector op of R output rows (`norm_matvec`,
`matvec_add`, and `head_matvec`, whose rows each read their head's own input) is cut into
min(R, #SMs) tasks of consecutive rows whose counts differ by at most one (whole 8-row groups
for MLA's v expansion where it writes o_proj's ready digits: `writes_v_digits`, a knob): one
task per SM per op is the finest split that keeps every SM's weight stream equal, and tasks
larger than a ring page are streamed page by page anyway, so smaller tiles would only add task
overhead.
An op that starts with earlier ops it does not wait for takes only the SMs they leave, when
that is at least half (`sms_beside`: MLA's q absorption beside the DSA indexer, 99 SMs), so
that both run at once. A small op whose result is not wanted before a larger one's that starts
with it shares the SMs with that one by bytes (`beside_partner`: the indexer's bf16 head
weights on 3 SMs, q_b_proj on the other 129). The MoE router's logits take tasks of
`ROUTER_ROWS` rows where the shared expert's gate/up starts with them (`router_sms`), so that
it runs beside them on the other SMs and the top-k, which the routed experts' loads wait for,
comes sooner.
Unless the `fp8_mma` knob is 0, a dense FP8 projection whose shape fits is cut in whole tiles
of 8 rows (16 where K is not a multiple of 1024; the tensor cores' operand: `_fp8_tiles_fit`,
`ir/fp8.py: pack_tiles`) and its weights marked `tiled`; so are the routed experts' (a gate/up
slot's rows, a down projection's rows whose pieces are a tile's K wide: `tile_weights`).
Attention is tiled by KV head group (a task owns the query heads that share one KV head, so
each key is read once for all of them) and, within a group, by context chunk, so that the KV
cache of a layer is read by many SMs at once instead of a few: the chunk count is the SM count
over the group count (capped at 32, or at the `attn_chunks` knob, to try fewer; MLA's too).
The chunks' partial softmax results are merged by the last chunk task of the group to finish,
which alone signals the op; it stages the chunks' results in shared memory a batch at a time
(`merge_chunks` of them, as many as fit a third of it: with many query heads per group, e.g.
Qwen3-30B-A3B's 8 of 128 dims, 17 of its 32 chunks), so that the chunk count follows the SMs,
not shared memory, and the ring keeps the rest. MLA's are merged by v_expand's tasks as they
stage their heads (passes/fusion_mla.py says why), so every MLA chunk task signals.
MLA attention is tiled the same way with groups of up to `MLA_HEADS_PER_TASK` heads (they all
share the latent cache; the group size bounds what a task stages), over the context or, with
DSA, over the top-k list. The DSA indexer's scores are tiled by context chunk. The routed
gate/up is tiled per slot (one slot per chosen expert). With every slot busy (tp 1) a slot's
rows go to #SMs // slots tasks, about one task per SM in all: the op is latency-bound, and one
task per SM per slot paid each task's fixed cost (staging the input, the epilogue, the signal)
slots times per SM. Under expert parallelism (fewer slots busy than provisioned) each slot's
rows go over all SMs, so that the expected case, a few busy slots, still spreads over the GPU
(`routed_tasks_per_slot`). The routed down projection is tiled by output rows like any
projection, each row gathering every slot's piece. Routed weights are chosen at run time, and
under expert parallelism a slot is busy with probability top_k / (tp x slots), which is what
their bytes are counted at. `embed`,
`argmax`, `moe_topk` and `dsa_topk` are one task each: they move a few kilobytes.
A split-K FFN (`ffn_split_k`) is tiled by slices of the intermediate dimension, one per SM:
widths are whole groups of 8 columns (the kernel's 16-byte pieces of a down row) and differ by
at most 8 (llama-3.2-1b: 8192 columns over 132 SMs, 56 or 64). A task streams its slice's
gate/up rows (pairs, interleaved, of `hidden` columns each) and then W_down's columns of the
slice as `hidden` rows of the slice's width, so every SM streams the same bytes.
"""

from __future__ import annotations

import networkx as nx

from tilertc.ir.fp8 import (
    DIGIT_GROUP_ROWS,
    TILE_BLOCK_COLS,
    packed_row_bytes,
    tile_rows,
    tile_unit_bytes,
    tile_unit_cols,
    tiled_row_bytes,
)
from tilertc.ir.graph import DTYPE_BYTES, Tensor
from tilertc.passes.fusion_moe import down_inputs
from tilertc.passes.program import Program, ScheduleError, Task, WeightSegment

MAX_ATTENTION_CHUNKS = 32
MERGE_SMEM_SHARE = 3  # the merge's staged chunk results get at most 1/3 of shared memory
MLA_HEADS_PER_TASK = 16
# The q absorption's first task also runs MLA's latent prologue and appends the row (decode/mla.cuh:
# mla_append_latent), which took ~2.4 us beyond the op's median task on the H200 (the last task
# of the op in every profiled step, DeepSeek-V3.2 and GLM-5, session 37), about a ring page of
# its short rows (2.7 us): it takes half a share of the rows, the others the rest.
LATENT_APPEND_SHARE = 0.5
# The MoE router's rows a task, where the shared expert's gate/up runs beside it (`router_sms`):
# DeepSeek-V3.2's and GLM-5's 256 experts on 32 SMs. One-layer FP8 models on the H200, µs from
# o_proj's end to the MoE down's: 132 router tasks 128.1 (DeepSeek-V3.2) and 114.8 (GLM-5), 32
# tasks 123.7 and 110.3; 16 tasks 130.1 (DeepSeek-V3.2, before the two-stage top-k); bench
# ms/token GLM-5 0.303 / 0.304 / 0.292 with 132 / 64 / 32 (docs/performance.md, session 38).
ROUTER_ROWS = 8
DENSE_PROJECTIONS = ("norm_matvec", "matvec_add")
MATVEC = (*DENSE_PROJECTIONS, "head_matvec")
SPLIT_K_COLS = 8  # a split-K FFN slice is whole 16-byte pieces of bf16 down rows
ROUTED = ("moe_gate_up", "moe_down_add")


def scale_cols(w: Tensor) -> int:
    """The columns one packed scale of FP8 weight `w` covers: its block's, or fewer for a
    weight derived from a checkpoint tensor (`ir/mla.py: derived_scale_cols`)."""
    return w.attrs.get("scale_cols", w.attrs["block"][1])


def weight_row_bytes(w: Tensor) -> int:
    """Bytes of one packed row of weight `w`: its bf16 values, or its FP8 values followed by
    its scales (`ir/fp8.py: packed_row_bytes`), or a tiled FP8 weight's share of a tile
    (`ir/fp8.py: tiled_row_bytes`)."""
    if w.attrs.get("tiled"):
        return tiled_row_bytes(w.shape[1])
    if "scale_inv" in w.attrs:
        return packed_row_bytes(w.shape[1], scale_cols(w))
    return w.shape[1] * DTYPE_BYTES[w.dtype]


def down_piece_bytes(program: Program, op) -> tuple[int, int]:
    """A `moe_down_add` row's pieces: (bytes of one slot's, of the shared expert's or 0). Each
    piece is a whole packed row of its expert (in an FP8 model: its values, then its own
    scales), so that pieces gathered from anywhere keep their format."""
    g = program.graph
    _, _, _, _, _, experts, shared = down_inputs(op)
    return (weight_row_bytes(g.tensors[experts[0]]),
            weight_row_bytes(g.tensors[shared]) if shared else 0)


def row_bytes(program: Program, op) -> int:
    """Bytes of weights behind one output row of a matrix-vector op (of a routed op: with
    every slot busy; of a split-K FFN: a gate/up pair, its widest rows)."""
    g = program.graph
    if op.opcode == "moe_down_add":  # one piece per slot, then the shared expert's
        routed, shared = down_piece_bytes(program, op)
        return op.attrs["slots"] * routed + shared
    ws = _weights(op)
    # One format per op: a task's rows are all read by one variant of the kernel's dot product.
    formats = sorted({g.tensors[w].dtype for w in ws})
    if len(formats) > 1:
        raise ScheduleError(f"op {op.name!r}: its weights mix formats {formats}; a fused "
                            "matrix-vector op streams rows of one format")
    per = [weight_row_bytes(g.tensors[w]) for w in ws]
    return sum(per) if op.attrs.get("interleave") else per[0]


def _weights(op) -> list[str]:
    """The weights one output row of a matrix-vector op reads (a routed op's: expert 0's)."""
    return {"norm_matvec": op.inputs[2:], "moe_gate_up": op.inputs[3:5],
            "ffn_split_k": op.inputs[2:4]}.get(op.opcode, [op.inputs[1]])


def tile_weights(op) -> tuple[int, list[str]]:
    """The columns of one tiled row of `op` and the weights whose rows are tiled alike: a
    projection's K and weights; the routed gate/up's K and every expert's gate and up weights;
    a MoE down projection's piece, a slot's intermediate columns, and every expert's down
    weight, then the shared expert's (each piece of a row from its own weight, its sum over its
    own part of the input: decode/shared.cuh, tile_pieces)."""
    if op.opcode == "moe_down_add":
        _, _, _, _, _, experts, shared = down_inputs(op)
        return op.attrs["intermediate_size"], [*experts, *([shared] if shared else [])]
    if op.opcode == "moe_gate_up":
        return op.attrs["K"], list(op.inputs[3:])
    return op.attrs["K"], _weights(op)


def _fp8_tiles_fit(program: Program, op) -> bool:
    """Whether the FP8 weights of `op` stream as tiles for the tensor cores (unless the
    `fp8_mma` knob is 0; decode/tile_pages.cuh: tile_pages, ir/fp8.py: pack_tiles): a dense
    projection (`norm_matvec`, `matvec_add`), the routed gate/up, or a MoE down projection (whose
    shared expert, if any, is a slot wide) on one GPU, whose weights are 128-column scale blocks, of
    rows in whole tiles (`ir/fp8.py: tile_rows`: 8, or 16 when K is a multiple of 512 but not
    of 1024; they then never straddle a scale block's rows), and whose K (a down projection's:
    a slot's) cuts into segments of whole blocks. MLA's head rows and other shapes keep their
    rows."""
    if (program.config["tuning"].get("fp8_mma") is False or program.tp > 1
            or op.opcode not in (*DENSE_PROJECTIONS, *ROUTED)):
        return False
    k, names = tile_weights(op)
    if op.opcode == "moe_down_add" and op.attrs["shared_intermediate"] not in (0, k):
        return False
    ws = [program.graph.tensors[w] for w in names]
    return tile_unit_cols(k) is not None and all(
        "scale_inv" in w.attrs and "scale_cols" not in w.attrs and w.shape[1] == k
        and w.attrs["block"][1] == TILE_BLOCK_COLS and w.attrs["block"][0] % tile_rows(k) == 0
        and w.shape[0] % tile_rows(k) == 0 for w in ws)


def writes_v_digits(program: Program, op) -> bool:
    """Whether `op` is MLA's v expansion and writes o_proj's input as ready digits: where the
    `vexp_digits` knob asks (off: measured no faster; docs/performance.md, sessions 43 and 45:
    the layer's end 0-2.4 µs sooner, the bench within its spread), ready digits are not off and
    o_proj streams FP8 tiles. Its tasks are then whole groups of DIGIT_GROUP_ROWS rows, which a
    producer of digits needs (passes/digits.py)."""
    tuning = program.config["tuning"]
    return (bool(tuning.get("vexp_digits")) and tuning.get("ready_digits") is not False
            and op.opcode == "head_matvec" and "merges" in op.attrs
            and any(c.opcode == "matvec_add" and c.inputs[0] == op.outputs[0]
                    and _fp8_tiles_fit(program, c) for c in program.graph.consumers(op.name)))


def is_tiled(program: Program, op) -> bool:
    """Whether tiling chose FP8 tiles for the weights of `op` (`_fp8_tiles_fit`)."""
    return (op.opcode in (*MATVEC, *ROUTED)
            and bool(program.graph.tensors[tile_weights(op)[1][0]].attrs.get("tiled")))


def has_tiles(program: Program) -> bool:
    """Whether any op of `program` streams FP8 tiles (`is_tiled`)."""
    return any(is_tiled(program, op) for op in program.graph.ops())


def is_fp8_rows(program: Program, op) -> bool:
    """Whether the weights of matrix-vector op `op` stream as FP8 rows (not tiles)."""
    return (op.opcode in MATVEC and not is_tiled(program, op)
            and program.graph.tensors[_weights(op)[0]].dtype == "fp8_e4m3")


def stream_row_bytes(program: Program, op) -> int:
    """Bytes of what a ring page holds whole of a matrix-vector op: a row, or a tiled op's
    unit (decode/shared.cuh: stream_rows)."""
    if is_tiled(program, op):
        return tile_unit_bytes(tile_weights(op)[0])
    return row_bytes(program, op)


def segment_bytes(program: Program, s: WeightSegment) -> int:
    """Packed bytes of a weight segment: its rows, or of each row only its columns (bf16)."""
    w = program.graph.tensors[s.tensor]
    if s.cols is not None:
        return (s.row1 - s.row0) * (s.cols[1] - s.cols[0]) * DTYPE_BYTES[w.dtype]
    return (s.row1 - s.row0) * weight_row_bytes(w)


def busy(program: Program, op) -> float:
    """The expected fraction of a routed op's slots that hold an expert of this rank."""
    a = op.attrs
    return min(1.0, a["top_k"] / (program.tp * a["slots"]))


def _segments(program: Program, op, r0: int, r1: int) -> list[WeightSegment]:
    g = program.graph
    if op.opcode in ("matvec_add", "head_matvec"):
        return [WeightSegment(op.inputs[1], r0, r1)]
    ws = list(op.inputs[2:])
    if op.attrs.get("interleave"):
        return [WeightSegment(w, r0, r1) for w in ws]
    segs, base = [], 0
    for w in ws:  # rows of the concatenation [W0; W1; ...]
        n = g.tensors[w].shape[0]
        lo, hi = max(r0, base), min(r1, base + n)
        if lo < hi:
            segs.append(WeightSegment(w, lo - base, hi - base))
        base += n
    return segs


def _bounds(rows: int, n: int, first: float = 1.0) -> list[int]:
    """Bounds of n tasks over `rows`: even, except that the first takes `first` of a share."""
    if n == 1 or first == 1.0:
        return [rows * i // n for i in range(n + 1)]
    head = max(1, round(rows / n * first))
    return [0] + [head + (rows - head) * i // (n - 1) for i in range(n)]


def _tile_rows(program: Program, op) -> None:
    tiled = _fp8_tiles_fit(program, op)
    for w in _weights(op) if tiled else ():
        program.graph.tensors[w].attrs["tiled"] = True
    rows, rb = op.attrs["rows"], row_bytes(program, op)
    quantum = (tile_rows(op.attrs["K"]) if tiled
               else DIGIT_GROUP_ROWS if writes_v_digits(program, op) else 1)
    sms, beside = sms_beside(program, op)
    narrowed = router_sms(program, op, sms) if is_router(program, op) else sms
    router, sms = narrowed < sms, narrowed
    partner = beside_partner(program, op)
    if partner is not None:  # the SMs the two share, in proportion to their bytes
        other = program.graph.op(partner)
        theirs = other.attrs["rows"] * row_bytes(program, other)
        sms = -(-sms * rows * rb // (rows * rb + theirs))  # its tasks no larger than the partner's
    n = min(rows // quantum, sms)
    appends = "kv_a" in op.attrs.get("io", {})  # its first task appends MLA's latent row
    share = LATENT_APPEND_SHARE if appends else 1.0
    bounds = [quantum * b for b in _bounds(rows // quantum, n, share)]
    for i in range(n):
        r0, r1 = bounds[i], bounds[i + 1]
        program.tasks.append(Task(op.name, op.opcode, i, (r0, r1),
                                  _segments(program, op, r0, r1), (r1 - r0) * rb))
    sizes = {b - a for a, b in zip(bounds, bounds[1:], strict=False)}
    op.attrs["tile"] = {"tasks": n, "rows_per_task": (min(sizes), max(sizes)),
                        "bytes_per_task": max(sizes) * rb}
    if partner is not None:
        op.attrs["tile"]["beside"] = partner
    program.decide("tiling", f"{op.name}: {rows} rows x {rb} B -> {n} tasks of "
                   f"{min(sizes)}-{max(sizes)} rows" + (
                       ", the first (which also appends the latent row) a smaller share"
                       if appends and bounds[1] < max(sizes) else "") + (
                       f", FP8 tiles of {quantum} rows for the tensor cores (units of "
                       f"{tile_unit_cols(op.attrs['K'])} columns)" if tiled else
                       f", whole groups of {quantum} rows: it writes its consumer's digits"
                       if quantum > 1 else "") + (
                       f", on the SMs that {', '.join(beside)} leave" if beside else "") + (
                       f", beside {partner} (by bytes)" if partner else "") + (
                       f", on {n} SMs: the ops that start with it run beside it" if router else ""))


def sms_beside(program: Program, op) -> tuple[int, list[str]]:
    """The SMs a matrix-vector op is tiled over, and the ops it leaves SMs to: those earlier
    in program order that run after its last producer too and that it does not wait for,
    when their tasks leave it at least half the SMs (the DSA indexer's scores and top-k beside
    MLA's q absorption: 33 tasks, so the absorption takes 99 SMs and both run at once; the MoE
    top-k beside the shared expert's gate/up, which takes the other 131); else every SM, the
    op then queueing behind them where they share an SM. With every SM taken by it, the
    shared expert had put two tasks on one SM (the cost model charges a task its bytes, here
    a third of its measured time), whose routed gate/up then started ~7 us late: GLM-5's MoE
    layer waited for that SM (session 37)."""
    g, sms = program.graph, program.target.num_sms
    names, order = _program_order(program)
    producers = [p for p in g.nx.predecessors(op.name) if p != op.name]
    if not producers:
        return sms, []
    start = max(producers, key=order.__getitem__)
    # every path from the start to the op runs between the two in program order
    window = g.nx.subgraph(names[order[start]:order[op.name] + 1])
    partners = {b for b in window if g.op(b).attrs.get("tile", {}).get("beside") == op.name}
    # (an op with a task on every SM runs ahead of it there, not beside it: the MoE router
    # before the shared expert's gate/up, which then leaves one SM to the router's top-k)
    beside = sorted((b for b in (nx.descendants(window, start) | partners)
                     - nx.ancestors(window, op.name) - {op.name}
                     if g.op(b).attrs["tile"]["tasks"] < sms), key=order.__getitem__)
    left = sms - sum(g.op(b).attrs["tile"]["tasks"] for b in beside)
    return (left, beside) if beside and 2 * left >= sms else (sms, [])


def is_router(program: Program, op) -> bool:
    """Whether matrix-vector op `op` computes the MoE router's logits (a top-k reads them)."""
    return any(c.opcode == "moe_topk" for c in program.graph.consumers(op.name))


def router_sms(program: Program, router, sms: int) -> int:
    """The SMs the MoE router's logits take: the `router_tasks` knob's count; else, where the
    shared expert's gate/up starts with it (the same producers, neither waiting for the
    other), tasks of ROUTER_ROWS rows, so that the shared expert runs beside it on the other
    SMs (`sms_beside`) instead of after it on every SM, and the top-k, and with it the routed
    experts' loads, comes sooner; else every SM."""
    asked = program.config["tuning"].get("router_tasks")
    if asked is not None:
        if asked < 1:
            raise ScheduleError(f"router_tasks={asked}: the MoE router needs at least one task")
        return min(sms, asked)
    g = program.graph
    producers = set(g.nx.predecessors(router.name))
    shared = any(o.name != router.name and o.opcode in MATVEC
                 and set(g.nx.predecessors(o.name)) == producers
                 and not nx.has_path(g.nx, router.name, o.name)
                 and not nx.has_path(g.nx, o.name, router.name) for o in g.ops())
    return min(sms, -(-router.attrs["rows"] // ROUTER_ROWS)) if shared else sms


def beside_partner(program: Program, op) -> str | None:
    """The op that matrix-vector op `op` shares the SMs with, by bytes, if any: a later
    matrix-vector op that neither waits for the other, that every consumer of `op` waits for
    too, and whose last producer starts with `op` (the same producers) and comes before it in
    program order. On every SM `op` then runs after that producer, beside the partner, and its
    result is not wanted before the partner's, so it takes only its share of the SMs instead
    of putting a task ahead of the partner's on each of them. DeepSeek-V3.2's indexer head
    weights (64 bf16 rows, 918 KB) beside q_b_proj: as one row a task they took 64 SMs for
    ~4.4 us each (the fixed cost of a task) ahead of q_b_proj there, which the index scores,
    their only consumer, wait for anyway."""
    g = program.graph
    names, order = _program_order(program)
    producers = set(g.nx.predecessors(op.name))
    consumers = list(g.nx.successors(op.name))
    for name in names[order[op.name] + 1:] if consumers else ():
        if g.op(name).opcode not in MATVEC:
            continue
        # its producers all before `op` in program order (so it does not wait for `op`), the
        # last of them a sibling of `op`; and every consumer of `op` waits for it
        last = max(g.nx.predecessors(name), key=order.__getitem__, default=None)
        if (last is not None and order[last] < order[op.name]
                and set(g.nx.predecessors(last)) == producers
                and all(nx.has_path(g.nx, name, c) for c in consumers)):
            return name
    return None


def _program_order(program: Program) -> tuple[list[str], dict[str, int]]:
    """The ops' names in program order (a topological order) and each one's place in it."""
    names = list(program.graph.nx.nodes)
    return names, {name: i for i, name in enumerate(names)}


def split_k_slices(program: Program, op) -> list[int]:
    """Bounds of the intermediate slices of a split-K FFN's tasks (whole SPLIT_K_COLS)."""
    inter = op.attrs["intermediate_size"]
    if inter % SPLIT_K_COLS:
        raise ScheduleError(f"op {op.name!r}: intermediate size {inter} is not a multiple of "
                            f"{SPLIT_K_COLS}; a split-K slice of W_down must be whole 16-byte "
                            "pieces")
    groups = inter // SPLIT_K_COLS
    return [SPLIT_K_COLS * b for b in _bounds(groups, min(groups, program.target.num_sms))]


def _tile_split_k(program: Program, op) -> None:
    gate, up, down = op.inputs[2:5]
    hidden, rb = op.attrs["K"], row_bytes(program, op)
    bounds = split_k_slices(program, op)
    n = len(bounds) - 1
    for i in range(n):
        c0, c1 = bounds[i], bounds[i + 1]
        segs = [WeightSegment(gate, c0, c1), WeightSegment(up, c0, c1),
                WeightSegment(down, 0, hidden, (c0, c1))]
        program.tasks.append(Task(op.name, op.opcode, i, (c0, c1), segs,
                                  sum(segment_bytes(program, s) for s in segs)))
    widths = sorted({bounds[i + 1] - bounds[i] for i in range(n)})
    op.attrs["tile"] = {"tasks": n, "columns_per_task": (widths[0], widths[-1]),
                        "bytes_per_task": widths[-1] * (rb + 2 * hidden)}
    program.decide("tiling", f"{op.name}: {op.attrs['intermediate_size']} intermediate columns "
                   f"-> {n} tasks of {'-'.join(map(str, widths))} columns (split-K): each its "
                   f"gate/up rows ({rb} B each), then W_down's columns as {hidden} rows of the "
                   "slice's width; partial sums added into the output")


def routed_tasks_per_slot(program: Program, op) -> int:
    """How many tasks a `moe_gate_up` slot's rows are split into.

    Every slot busy (tp 1, `busy` = 1): about one task per SM in all, #SMs // slots per slot
    (at least one), so that each SM runs one gate/up task per layer. The op is latency-bound
    at one task per SM per slot: on the H200, Qwen3-30B-A3B's 8 slots x 132 SMs = 1056 tasks
    of ~47 KB took 3.8 us each, mostly fixed cost (staging the normalized input, claiming
    pages, the epilogue and signal; docs/performance.md), and its 50 MB streamed at 1.2 TB/s.
    Under expert parallelism (busy < 1) each slot keeps its rows over all SMs (min(rows, #SMs)
    tasks): a slot is empty with probability 1 - busy, and an empty slot's tasks only wait and
    signal, so a busy slot's rows still stream on the whole GPU; with whole slots on
    #SMs // slots SMs, the SMs of the one or two busy slots would stream everything while the
    rest idle."""
    a = op.attrs
    if busy(program, op) < 1:
        return min(a["intermediate_size"], program.target.num_sms)
    return min(a["intermediate_size"], max(1, program.target.num_sms // a["slots"]))


def _tile_routed(program: Program, op) -> None:
    a, sms = op.attrs, program.target.num_sms
    frac = busy(program, op)
    tile = {"busy": frac}
    tiled, (k, names) = _fp8_tiles_fit(program, op), tile_weights(op)
    for w in names if tiled else ():
        program.graph.tensors[w].attrs["tiled"] = True
    # a task's rows are whole tiles (rows, then each row's share of its tiles: row_bytes)
    quantum = tile_rows(k) if tiled else 1
    tiles = (f", FP8 tiles of {quantum} rows for the tensor cores (units of "
             f"{tile_unit_cols(k)} columns)" if tiled else "")
    if op.opcode == "moe_gate_up":
        rb, inter = row_bytes(program, op), a["intermediate_size"]
        n = min(routed_tasks_per_slot(program, op), inter // quantum)
        bounds = [quantum * b for b in _bounds(inter // quantum, n)]
        for slot in range(a["slots"]):
            for i in range(n):
                r0, r1 = slot * inter + bounds[i], slot * inter + bounds[i + 1]
                program.tasks.append(Task(op.name, op.opcode, slot * n + i, (r0, r1),
                                          weight_bytes=round((r1 - r0) * rb * frac)))
        sizes = [b - b0 for b0, b in zip(bounds, bounds[1:], strict=False)]
        lo, hi = min(sizes), max(sizes)
        tile.update(tasks=a["slots"] * n, tasks_per_slot=n, rows_per_task=(lo, hi))
        what = (f"{a['slots']} slots x {inter} rows x {rb} B -> {a['slots']} x {n} tasks of "
                + (f"{lo}-{hi} rows" if lo != hi else f"{lo} row" + "s" * (lo != 1))
                + (f": every slot busy, so #SMs // slots = {sms // a['slots']} tasks per slot "
                   "(at most its rows), about one gate/up task per SM: fewer, larger tasks, "
                   "each task's fixed cost paid once per SM" if frac == 1 else
                   ": every slot over all SMs (expert parallelism: an empty slot's tasks are "
                   "skipped quickly, a busy one's rows stream on every SM)") + tiles)
    else:
        routed, shared = down_piece_bytes(program, op)
        n = min(a["rows"] // quantum, sms)
        bounds = [quantum * b for b in _bounds(a["rows"] // quantum, n)]
        for i in range(n):
            r0, r1 = bounds[i], bounds[i + 1]
            segs = [WeightSegment(op.inputs[-1], r0, r1)] if shared else []
            program.tasks.append(Task(op.name, op.opcode, i, (r0, r1), segs,
                                      round((r1 - r0) * (a["slots"] * routed * frac + shared))))
        tile["tasks"] = n
        what = (f"{a['rows']} rows x ({a['slots']} slots + shared) -> {n} tasks" + tiles
                + (", each tile's pieces from its slot's expert" if tiled else ""))
    op.attrs["tile"] = tile
    program.decide("tiling", f"{op.name}: {what}; weights picked at run time by expert id"
                   + (f", each slot busy with probability {frac:.3g}" if frac < 1 else ""))


def _tile_chunked(program: Program, op, groups: int, heads: int, rows: int,
                  row_bytes_: int, what: str, merge: str = "last chunk") -> None:
    """Tasks per (group, context chunk). At most MAX_ATTENTION_CHUNKS chunks per group, or the
    `attn_chunks` knob's. `merge`: who merges a group's chunk results, the last chunk of the
    group to finish (which alone signals) or the consumer op named (every chunk signals)."""
    cap = program.config["tuning"].get("attn_chunks", MAX_ATTENTION_CHUNKS)
    if cap < 1:
        raise ScheduleError(f"attn_chunks={cap}: attention needs at least one chunk per group")
    chunks = max(1, min(cap, program.target.num_sms // groups))
    for gi in range(groups):
        for c in range(chunks):
            program.tasks.append(Task(op.name, op.opcode, gi * chunks + c, (gi, gi + 1),
                                      other_bytes=-(-rows // chunks) * row_bytes_))
    last = merge == "last chunk"
    op.attrs["tile"] = {"tasks": groups * chunks, "chunks": chunks, "merge": merge,
                        "signals": groups if last else groups * chunks, "heads_per_task": heads}
    program.decide("tiling", f"{op.name}: {groups} {what} ({heads} query heads each) x "
                   f"{chunks} context chunks = {groups * chunks} tasks; " + (
                       "the last chunk of a group to finish merges it" if last else
                       f"{merge} merges each head's chunks as it stages its input"))


def _tile_attention(program: Program, op) -> None:
    """GQA attention by KV group and context chunk; the merge stages `merge_chunks` chunk
    results at a time, besides the chunk's own result (one more)."""
    a = op.attrs
    hd, group = a["head_dim"], a["n_heads"] // a["n_kv_heads"]
    _tile_chunked(program, op, a["n_kv_heads"], group, program.graph.attrs["max_seq_len"],
                  2 * hd * 2, "KV groups")
    fit = program.target.smem_per_block // MERGE_SMEM_SHARE // (group * (hd + 2) * 4) - 1
    tile = op.attrs["tile"]
    tile["merge_chunks"] = max(1, min(tile["chunks"], fit))
    if tile["merge_chunks"] < tile["chunks"]:
        program.decide("tiling", f"{op.name}: the merge stages {tile['merge_chunks']} of the "
                       f"{tile['chunks']} chunk results at a time (a third of shared memory)")


def _tile_mla_attention(program: Program, op) -> None:
    a, seq = op.attrs, program.graph.attrs["max_seq_len"]
    heads = max(d for d in range(1, min(a["n_heads"], MLA_HEADS_PER_TASK) + 1)
                if a["n_heads"] % d == 0)
    rows = seq
    if a["dsa"]:
        rows = min(seq, program.graph.tensors[op.inputs[3]].numel)
    cache = program.graph.tensors[op.inputs[2]]
    expand = next(o.name for o in program.graph.consumers(op.name)
                  if o.attrs.get("merges") == op.name)
    _tile_chunked(program, op, a["n_heads"] // heads, heads, rows,
                  cache.shape[1] * DTYPE_BYTES[cache.dtype],
                  "head groups" + (" over the indexer's top-k" if a["dsa"] else ""), expand)


def _tile_dsa_score(program: Program, op) -> None:
    seq = program.graph.attrs["max_seq_len"]
    chunks = min(MAX_ATTENTION_CHUNKS, program.target.num_sms, seq)
    cache = program.graph.tensors[op.outputs[1]]
    for c in range(chunks):
        program.tasks.append(Task(op.name, op.opcode, c, (c, c + 1), other_bytes=-(-seq // chunks)
                                  * cache.shape[1] * DTYPE_BYTES[cache.dtype]))
    op.attrs["tile"] = {"tasks": chunks, "context_chunks": chunks}
    program.decide("tiling", f"{op.name}: {chunks} context chunks, all indexer heads each")


def tile(program: Program) -> Program:
    for op in program.graph.ops():
        if op.opcode in MATVEC:
            _tile_rows(program, op)
        elif op.opcode in ROUTED:
            _tile_routed(program, op)
        elif op.opcode == "ffn_split_k":
            _tile_split_k(program, op)
        elif op.opcode == "attention":
            _tile_attention(program, op)
        elif op.opcode == "mla_attention":
            _tile_mla_attention(program, op)
        elif op.opcode == "dsa_score":
            _tile_dsa_score(program, op)
        else:
            program.tasks.append(Task(op.name, op.opcode, 0, (0, 1)))
            op.attrs["tile"] = {"tasks": 1}
    return program
