"""Emit the CUDA source of a scheduled program and build it into one cubin with nvcc.

The source is the device library (the parts of `LIBRARY`, in backends/cuda/decode/; the last
holds the one `__global__`) preceded by a generated prelude of the model's constants, so that loops
over heads and head dimensions unroll. The schedule itself (tasks, streams) is data the runtime
uploads, so the cubin only changes when the model's shape or the ring geometry does.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from tilertc.ir.sampling import K_MAX, candidate_slots, row_bits
from tilertc.passes.fusion import FIXED_FRAC_BITS
from tilertc.passes.program import Program, ScheduleError
from tilertc.passes.residency import (
    DSA_KEYS,
    FLAG_BYTES,
    MLA_KEYS,
    REDUCTION_FLOATS,
    TASK_SLOT,
    TASK_SLOTS,
)
from tilertc.passes.tiling import has_tiles, scale_cols

# The device library: the parts of one translation unit, in the order the kernel's source
# lists them (a part uses what the parts before it define; task_table.cuh opens the namespace,
# kernel.cuh closes it and defines the kernel). One source file a kernel, so that an artifact's
# kernel.cu is the whole of what built its cubin.
LIBRARY_DIR = Path(__file__).with_name("decode")
LIBRARY = tuple(LIBRARY_DIR / f"{part}.cuh" for part in (
    "task_table",    # opcodes, task fields, kernel parameters
    "ptx",           # PTX wrappers: bulk copies, mbarriers, wgmma, mma, counters' loads and adds
    "shared",        # the shared-memory plan, a task row's derived sizes, acquiring a counter
    "loader",        # the loader warp: the weight ring's pages, routed experts' pieces
    "dependencies",  # compute: a task's waits and its signal
    "sampling",      # the sampler's candidates, top-k / top-p, Gumbel draws
    "exchange",      # tensor parallelism: exchanges between ranks
    "staging",       # a matrix-vector task's input in shared memory; MLA's merge of chunk results
    "tile_digits",   # FP8 tiles: the input as e4m3 digits
    "ready_digits",  # FP8 tiles: digits written by the producer
    "dot",           # a row's dot product (bf16, FP8, short rows)
    "pages",         # the ring's pages dealt to groups of warps
    "tile_pages",    # FP8 tiles: a task's pages on wgmma
    "matvec",        # matrix-vector tasks: page loop, epilogues, lm_head's sampling
    "attention",     # GQA attention, one context chunk of one KV group, and its merge
    "tokens",        # embedding, argmax, the step's token
    "moe_router",    # the MoE router's top-k
    "mla",           # absorbed MLA attention
    "dsa",           # the DSA lightning indexer's scores and top-k
    "split_k",       # a dense MLP as one split-K op
    "kernel",        # the compute warps' instruction stream and the kernel
))
KERNEL_NAME = "tilertc_decode"
# The router is one warp: every expert's score in its registers, lane k keeps the k-th choice;
# its group-limited selection keeps the chosen groups as bits of a word.
MAX_EXPERTS = 256
MAX_GROUPS = 32


def check_supported(program: Program) -> None:
    """The CUDA backend runs the dense fused opcodes, MoE (Qwen3-MoE's and DeepSeek-V3's
    routing, routed and shared experts), absorbed MLA and the DSA indexer, on one GPU and under
    tensor parallelism (routed experts split over the ranks); anything else is refused by name
    here, before any source is emitted."""
    from tilertc.backends.cuda.encode import OPCODES

    _check_tp(program)
    for op in program.graph.ops():
        if op.opcode not in OPCODES:
            raise ScheduleError(
                f"op {op.name!r}: fused opcode {op.opcode!r} is not yet in the "
                f"CUDA backend (it runs {', '.join(OPCODES)}); `tilertc "
                "explain` shows the schedule"
            )
        _check_moe(op)
        _check_mla(op)
        _check_fp8_scales(program, op)
    _check_dsa(program)


MAX_TP = 8


def _check_tp(program: Program) -> None:
    """Under --tp N the kernel exchanges all-reduce rows and the sampler's pairs between ranks
    (passes/synchronization.py), on at most the GPUs of one host."""
    tp = program.tp
    if tp == 1:
        return
    if tp > MAX_TP:
        raise ScheduleError(f"--tp {tp}: the CUDA backend runs at most {MAX_TP} ranks (the GPUs "
                            "of one NVLink host)")


def _tp(program: Program) -> dict[str, object]:
    """The ranks, each rank's vocabulary rows (the sampler makes its best row global) and where
    the sampler keeps the stop decision the ranks agreed on."""
    from tilertc.passes.residency import SAMPLE_EXCHANGE_FLOATS

    if program.tp == 1:
        return {"TP": 1}
    lm = next(op for op in program.graph.ops() if op.attrs.get("epilogue") == "argmax")
    return {"TP": program.tp, "TP_VOCAB_ROWS": lm.attrs["rows"],
            "TP_STOP_AT": program.buffers["sample_exchange"].offset + SAMPLE_EXCHANGE_FLOATS - 1}


def _check_fp8_scales(program: Program, op) -> None:
    """The FP8 dot product finds a scale by a shift of the 4-column group's index: a scale
    must cover a whole number of groups, a power of two of them (MLA's q absorption rows have
    one scale per gcd(128, nope + v) columns: ir/mla.py: derived_scale_cols)."""
    if op.opcode != "head_matvec":
        return
    w = program.graph.tensors[op.inputs[1]]
    cols = scale_cols(w) if "scale_inv" in w.attrs else 4
    if cols % 4 or (cols // 4) & (cols // 4 - 1):
        raise ScheduleError(f"op {op.name!r}: not yet in the CUDA backend: FP8 rows with one "
                            f"scale per {cols} columns (the dot product reads 4 columns, a "
                            "power of two of groups, per scale; kv_b heads of "
                            f"{op.attrs['qk_nope_head_dim'] + op.attrs['v_head_dim']} rows)")


def _check_mla(op) -> None:
    """The kernel's MLA reads a latent cache row as whole 16-byte pieces and sums the heads'
    outputs in 8-column mma tiles."""
    if op.opcode != "mla_attention":
        return
    a = op.attrs
    width = a["kv_lora_rank"] + a["qk_rope_head_dim"]
    missing = []
    if width % 8:
        missing.append(f"latent cache rows of {width} values (not whole 16-byte pieces)")
    if a["qk_rope_head_dim"] % 2:
        missing.append(f"an odd rope dimension {a['qk_rope_head_dim']}")
    if a["kv_lora_rank"] % 8:
        missing.append(f"a latent rank of {a['kv_lora_rank']} (not whole 8-column mma tiles)")
    if missing:
        raise ScheduleError(f"op {op.name!r}: not yet in the CUDA backend: "
                            f"{' and '.join(missing)} (it runs absorbed MLA)")


def _check_dsa(program: Program) -> None:
    """A DSA kernel's indexer and attention are compiled for one shape: every MLA attention
    reads an indexer's selection, every indexer has the same heads, scales and top-k, reads key
    rows as whole 16-byte pieces, and rotates the dims MLA rotates (whole 4-dim units, the
    partners of each too) with MLA's RoPE parameters (so that both read one RoPE table; only
    the pairing may differ)."""
    ops = program.graph.ops()
    scores = [op for op in ops if op.opcode == "dsa_score"]
    attn = [op for op in ops if op.opcode == "mla_attention"]
    if not scores:
        return
    missing = []
    if not all(op.attrs["dsa"] for op in attn):
        missing.append("MLA attention layers without the indexer beside ones with it")
    shape = {(op.attrs["n_heads"], op.attrs["head_dim"], op.attrs["softmax_scale"],
              op.attrs["head_weight_scale"], op.attrs["rope"]["interleaved"]) for op in scores}
    topk = {op.attrs["topk"] for op in ops if op.opcode == "dsa_topk"}
    if len(shape) > 1 or len(topk) > 1:
        missing.append("indexers of different shapes or top-k")
    mla = attn[0].attrs

    def no_interleave(rope: dict) -> dict:
        return {k: v for k, v in rope.items() if k != "interleaved"}

    for op in scores:
        a = op.attrs
        if a["head_dim"] % 8:
            missing.append(f"index key rows of {a['head_dim']} values (not whole 16-byte pieces)")
        if a["rotary_dim"] % 8:
            missing.append(f"{a['rotary_dim']} rotated index dims (not whole 4-dim units, "
                           "partners' too)")
        if (a["rotary_dim"] != mla["qk_rope_head_dim"]
                or no_interleave(a["rope"]) != no_interleave(mla["rope"])):
            missing.append("an indexer RoPE other than MLA's")
        if missing:
            raise ScheduleError(f"op {op.name!r}: not yet in the CUDA backend: "
                                f"{' and '.join(missing)}")


def _dsa(program: Program) -> dict[str, object]:
    """The indexer's constants: its heads and key width, the scales of its score, the pairing
    of its RoPE, the top-k and the key rows it stages at a time."""
    a = next(op for op in program.graph.ops() if op.opcode == "dsa_score").attrs
    topk = next(op for op in program.graph.ops() if op.opcode == "dsa_topk").attrs["topk"]
    return {"DSA_HEADS": a["n_heads"], "DSA_DIM": a["head_dim"], "DSA_TOPK": topk,
            "DSA_KEYS": DSA_KEYS,
            "DSA_SOFTMAX_SCALE": f"{float(a['softmax_scale'])!r}f",
            "DSA_HEAD_WEIGHT_SCALE": f"{float(a['head_weight_scale'])!r}f",
            "DSA_ROPE_INTERLEAVED": int(a["rope"]["interleaved"])}


def _check_moe(op) -> None:
    """The kernel's router is one warp (softmax or sigmoid scores, an optional correction
    bias, groups as bits of a word) and its down tasks gather whole 16-byte pieces of rows."""
    a = op.attrs
    missing = []
    if op.opcode == "moe_topk":
        if a["scoring"] not in ("softmax", "sigmoid"):
            missing.append(f"{a['scoring']} router scores")
        if a["num_experts"] > MAX_EXPERTS:
            missing.append(f"more than {MAX_EXPERTS} experts")
        if a["top_k"] > 32:
            missing.append("more than 32 experts per token")
        if a["n_group"] > MAX_GROUPS:
            missing.append(f"more than {MAX_GROUPS} expert groups")
    elif op.opcode == "moe_down_add":
        if a["intermediate_size"] * 2 % 16:
            missing.append("expert rows that are not whole 16-byte pieces")
        if a["shared_intermediate"] * 2 % 16:
            missing.append("shared expert rows that are not whole 16-byte pieces")
    if missing:
        raise ScheduleError(f"op {op.name!r}: not yet in the CUDA backend: "
                            f"{' and '.join(missing)} (it runs Qwen3-MoE and DeepSeek-V3 "
                            "routing)")


def _moe(program: Program, topk: dict) -> dict[str, object]:
    """The router's constants and the shared expert's width (0: none), which every MoE layer
    of a model shares: the router keeps its scores in registers, the loader and the staging
    of a down task know where its routed pieces end and how wide a slot's are (a constant, so
    that a down task's start divides by none). Under tp > 1 also each rank's experts and
    slots (route_local keeps the chosen experts of its rank)."""
    downs = [op for op in program.graph.ops() if op.opcode == "moe_down_add"]
    shared = {op.attrs["shared_intermediate"] for op in downs}
    slot = {op.attrs["intermediate_size"] for op in downs}
    for what, widths in (("shared experts", shared), ("expert widths", slot)):
        if len(widths) > 1:
            raise ScheduleError(f"MoE layers with different {what} ({sorted(widths)}) are "
                                "not yet in the CUDA backend")
    return {"MOE_EXPERTS": topk["num_experts"], "MOE_TOP_K": topk["top_k"],
            "MOE_NORM_TOPK_PROB": int(topk["norm_topk_prob"]),
            "MOE_SCALING": f"{float(topk['routed_scaling_factor'])!r}f",
            "MOE_SIGMOID": int(topk["scoring"] == "sigmoid"),
            "MOE_BIAS": int(topk["bias"]), "MOE_GROUPS": topk["n_group"],
            "MOE_TOPK_GROUP": topk["topk_group"], "MOE_SHARED_K": shared.pop(),
            "MOE_SLOT_K": slot.pop(),
            **({} if program.tp == 1 else {"MOE_LOCAL": topk["num_experts"] // program.tp,
                                            "MOE_SLOTS": downs[0].attrs["slots"]})}


def _gqa(attn: dict, seq: int) -> dict[str, object]:
    """GQA attention's constants and the KV capacity (the device library compiles GQA attention only
    without MLA)."""
    hd, group = attn["head_dim"], attn["n_heads"] // attn["n_kv_heads"]
    if hd % 2:
        raise ScheduleError(f"attention: head_dim {hd} is odd; RoPE rotates pairs of dimensions")
    return {
        "N_HEADS": attn["n_heads"],
        "N_KV_HEADS": attn["n_kv_heads"],
        "HEAD_DIM": hd,
        "GROUP": group,
        "ATTN_MERGE_CHUNKS": attn["tile"]["merge_chunks"],
        "MAX_SEQ": seq,
        "QK_NORM": int(attn["qk_norm"]),
        "QK_NORM_EPS": f"{attn['eps']!r}f" if attn["qk_norm"] else "0.0f",
        "ROPE_INTERLEAVED": int(attn["rope"]["interleaved"]),
    }


def _mla(attn: dict) -> dict[str, object]:
    """MLA attention's constants: the latent rank and rope dims, the heads of a task, the keys
    a chunk task takes at a time (passes/residency.py sized its shared memory for them)."""
    return {
        "MLA_RANK": attn["kv_lora_rank"],
        "MLA_ROPE": attn["qk_rope_head_dim"],
        "MLA_NOPE": attn["qk_nope_head_dim"],
        "MLA_HEADS": attn["tile"]["heads_per_task"],
        "MLA_KEYS": MLA_KEYS,
        "MLA_ROPE_INTERLEAVED": int(attn["rope"]["interleaved"]),
    }


def _fp8_mma(program: Program) -> dict[str, object]:
    """FP8 tiles on the tensor cores (passes/tiling.py: _fp8_tiles_fit; decode/tile_pages.cuh:
    tile_pages), compiled in only where the schedule has any, so that other kernels are what
    they were without them. The `fp8_mma` knob at 1 asks for them: refused by name where they
    cannot run (bf16 weights; tensor parallelism, as their staged input and row sums are one
    GPU's)."""
    if program.config["tuning"].get("fp8_mma") is True:
        if not program.spec.weight_format.is_fp8:
            raise ScheduleError("fp8_mma multiplies FP8 weight rows on the tensor cores, but "
                                f"{program.spec.name}'s weights are bf16; compile with "
                                "--weight-dtype fp8 or without fp8_mma")
        if program.tp > 1:
            raise ScheduleError(f"fp8_mma runs at --tp 1 only, not --tp {program.tp}; compile "
                                "without fp8_mma")
    return {"FP8_MMA": 1} if has_tiles(program) else {}


def constants(program: Program) -> dict[str, object]:
    check_supported(program)
    spec, cfg = program.spec, program.config
    attn = next(op for op in program.graph.ops() if op.opcode in ("attention", "mla_attention"))
    mla, seq = attn.opcode == "mla_attention", program.graph.attrs["max_seq_len"]
    lm = next(op for op in program.graph.ops() if op.attrs.get("epilogue") == "argmax").attrs
    fmt = spec.weight_format
    # The FP8 dot product is compiled only into kernels that stream FP8 rows, so that a bf16
    # kernel's code is what it was without it.
    fp8 = {"FP8_BLOCK_COLS": fmt.block[1]} if fmt.is_fp8 else {}
    # Likewise the router and the routed experts' loader paths are compiled only into MoE
    # kernels, and DeepSeek's routing and shared expert only where their constants say so.
    topk = next((op for op in program.graph.ops() if op.opcode == "moe_topk"), None)
    dsa = any(op.opcode == "dsa_score" for op in program.graph.ops())
    moe = {} if topk is None else _moe(program, {**topk.attrs, "bias": len(topk.inputs) > 1})
    # The split-K FFN's code and task fields only in kernels that have one (the device library
    # defines FFN_SPLIT_K 0 otherwise), so that other kernels are what they were without it.
    split_k = any(op.opcode == "ffn_split_k" for op in program.graph.ops())
    ffn = {"FFN_SPLIT_K": 1, "FIXED_FRAC_BITS": FIXED_FRAC_BITS} if split_k else {}
    # and the ready digits' (passes/digits.py) only in kernels whose schedule has them
    ready = any(op.attrs.get("ready_digits") for op in program.graph.ops())
    return {
        "COMPUTE_WARPS": cfg["compute_warps"],
        "PAGE_GROUPS": cfg["page_groups"],
        "RING_PAGES": cfg["ring_pages"],
        "PAGE_BYTES": cfg["page_bytes"],
        "MAX_K": -(-cfg["vec_floats"] // 4) * 4,
        "ACC_FLOATS": -(-cfg["acc_floats"] // 4) * 4,
        "MISC_FLOATS": REDUCTION_FLOATS,
        "FLAG_WORDS": FLAG_BYTES // 4,
        "TASK_SLOT": TASK_SLOT,
        "TASK_SLOTS": TASK_SLOTS,
        "HIDDEN": spec.hidden_size,
        "VOCAB": spec.vocab_size,
        **({"MAX_SEQ": seq} if mla else _gqa(attn.attrs, seq)),
        **ffn,
        **({"READY_DIGITS": 1} if ready else {}),
        "SAMPLE_K": K_MAX,
        "SAMPLE_TASKS": lm["tile"]["tasks"],
        "SAMPLE_SLOTS": candidate_slots(lm["rows"], lm["tile"]["tasks"]),
        "SAMPLE_ROW_BITS": row_bits(spec.vocab_size),
        "WEIGHT_FP8": int(fmt.is_fp8),
        **fp8,
        **_fp8_mma(program),
        "MOE": int(topk is not None),
        **moe,
        # MLA's opcodes and task fields, in place of GQA attention, only in MLA kernels
        "MLA": int(mla),
        **(_mla(attn.attrs) if mla else {}),
        # the DSA indexer's opcodes and field, and attention over its selection, only with it
        "DSA": int(dsa),
        **(_dsa(program) if dsa else {}),
        # tensor parallelism: the exchanges between ranks only where there are several
        **_tp(program),
    }


def emit_source(program: Program) -> str:
    consts = constants(program)
    lines = [
        f"// Generated by tilertc for {program.spec.name} on {program.target.name}; "
        "the device library follows the prelude."
    ]
    lines += [f"#define {k} {v}" for k, v in consts.items()]
    return "\n".join(lines) + "\n\n" + library_source()


def library_source() -> str:
    """The device library's parts, in order, each after a line naming its file."""
    return "\n".join(f"// backends/cuda/decode/{part.name}\n{part.read_text()}" for part in LIBRARY)


def find_nvcc() -> str:
    for cand in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).exists():
            return cand
    raise FileNotFoundError("nvcc not found: install the CUDA toolkit (13.0) or put nvcc on PATH")


def compile_cubin(source: Path, cubin: Path, arch: str,
                  extra_flags: Sequence[str] = ()) -> dict[str, int]:
    """nvcc `source` into `cubin` for `arch`; returns ptxas's resource report. `extra_flags`
    (e.g. the TileLang backend's include paths) go before the output and input."""
    virt = arch.replace("sm_", "compute_")
    cmd = [
        find_nvcc(),
        "-cubin",
        f"-gencode=arch={virt},code={arch}",
        "-O3",
        "-std=c++17",
        "-Xptxas",
        "-v",
        *extra_flags,
        "-o",
        str(cubin),
        str(source),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed on {source}:\n{proc.stderr.strip()}")
    report = {}
    for key, pat in (
        ("registers", r"Used (\d+) registers"),
        ("spill_stores", r"(\d+) bytes spill stores"),
        ("stack_bytes", r"(\d+) bytes stack frame"),
    ):
        m = re.search(pat, proc.stderr)
        if m:
            report[key] = int(m.group(1))
    return report
