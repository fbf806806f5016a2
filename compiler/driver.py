"""`tilertc.compile`: spec -> scheduled program -> CUDA source -> cubin -> artifact directory.

The artifact is everything the runtime needs and nothing it must recompute: the source (for
reading), one cubin, the task table, and a manifest whose `hash` keys the build (spec,
compiler version, options, decisions). docs/artifact.md describes the format.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tilertc.artifact import ARTIFACT_FORMAT
from tilertc.backends.cuda import codegen, encode
from tilertc.ir.graph import Graph, Tensor, TensorKind
from tilertc.model_specs.hf import with_weight_dtype
from tilertc.model_specs.spec import ModelSpec
from tilertc.passes.cost import roofline_ns, step_ns
from tilertc.passes.fusion_mla import MLA_DIMS
from tilertc.passes.packing import expert_weights, static_bytes
from tilertc.passes.pipeline import PASSES, make_program
from tilertc.passes.program import Program, ScheduleError
from tilertc.passes.residency import rope_dim
from tilertc.passes.tiling import scale_cols, segment_bytes, weight_row_bytes

BACKENDS = ("cuda", "tilelang")


@dataclass(frozen=True)
class CompileOptions:
    """Everything besides the spec that changes the artifact; its hash keys the build."""

    target: str = "h200"
    backend: str = "cuda"
    tp: int = 1
    max_seq_len: int = 4096
    compute_warps: int | None = None  # None: the roles pass decides
    page_kb: int | None = None  # None: the residency pass decides
    page_groups: int | None = None  # None: the roles pass decides
    attn_chunks: int | None = None  # None: the tiling pass decides (attention's chunks per group)
    router_tasks: int | None = None  # None: the tiling pass decides (the MoE router's tasks)
    # Projection weights: "fp8" (e4m3, 128x128 block scales) or "bf16"; None: the model
    # config's own format (bf16 unless it has an FP8 quantization_config).
    weight_dtype: str | None = None
    # A dense MLP as one split-K op per layer instead of gate/up then down (passes/fusion.py:
    # _fuse_split_k); off: measured no faster on the H200 (docs/performance.md).
    ffn_split_k: bool = False
    # FP8 dense projections as tiles on the tensor cores (wgmma, decode/tile_pages.cuh: tile_pages)
    # instead of rows on the CUDA cores. None: the tiling pass tiles what fits (FP8 weights, --tp 1,
    # the CUDA backend) unless the cost model predicts the step faster with rows (make_program);
    # True: asked for, and refused where it cannot run; False: rows only.
    fp8_mma: bool | None = None
    # FP8 tile tasks' inputs written as digits by the projection that makes them, instead of
    # converted by every consumer (passes/digits.py). None: wherever there are FP8 tiles; True:
    # asked for, and refused without FP8 tiles; False: every consumer converts its input.
    ready_digits: bool | None = None
    # MLA's v expansion writes o_proj's input as ready digits (passes/tiling.py:
    # writes_v_digits); off: measured no faster on the H200 (docs/performance.md, session 45).
    vexp_digits: bool = False
    # Source lines in the cubin, for compute-sanitizer and Nsight (same SASS). Off by default:
    # nvcc records the build directory in them, so the cubin would depend on where it was built.
    lineinfo: bool = False

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


# CompileOptions' fields that override a pass's choice (`make_program`'s tuning); the flags
# among them are on or off
TUNING_KNOBS = ("compute_warps", "page_kb", "page_groups", "attn_chunks", "router_tasks",
                "ffn_split_k", "fp8_mma", "ready_digits", "vexp_digits")
TUNING_FLAGS = ("ffn_split_k", "fp8_mma", "ready_digits", "vexp_digits")


def schedule_tuning(options: Mapping[str, Any]) -> dict[str, Any]:
    """The passes' tuning from CompileOptions' fields, or from a manifest's record of them (an
    older one may lack a knob): the knobs that are set, flags on or off (a manifest from before
    fp8_mma was on by default records False for it: its kernel has no tiles; one from before
    ready digits lacks that knob and gets False). FP8 tiles are the CUDA backend's: another
    backend's schedule has none."""
    tuning = {k: options[k] for k in TUNING_KNOBS if options.get(k) is not None}
    if "ready_digits" not in options:  # a manifest from before ready digits: its kernel has none
        tuning["ready_digits"] = False
    if options.get("backend", "cuda") != "cuda":
        tuning.setdefault("fp8_mma", False)
    return tuning


def _buffer_table(program: Program) -> dict[str, dict[str, Any]]:
    out = {}
    for name, b in program.buffers.items():
        t = program.graph.tensors.get(name)
        out[name] = {"arena": b.arena, "offset": b.offset, "numel": b.numel, "dtype": b.dtype,
                     "kind": t.kind.value if t else "scratch",
                     "hf_name": t.hf_name if t is not None and t.kind is TensorKind.WEIGHT
                     else None}
    return out


def _weight_layout(program: Program) -> list[dict[str, Any]]:
    """Per task with static weights: where its rows go and which checkpoint rows they are; for
    FP8 rows also each segment's scale tensor, the block and the packed bytes of one row. Then
    one entry per expert of each routed op, at the op's region + expert x stride."""
    g = program.graph
    layout = []
    for t in program.tasks:
        if not t.segments:  # no weights, or routed ones (below)
            continue
        rows = [s for s in t.segments if s.cols is None]
        ws = [g.tensors[s.tensor] for s in rows]
        routed = t.static_offset >= 0  # a routed task's static rows (the shared expert's)
        sliced = [segment_bytes(program, s) for s in t.segments if s.cols is not None]
        entry = {"offset": t.static_offset if routed else t.weight_offset,
                 "bytes": static_bytes(program, t) if routed else t.weight_bytes - sum(sliced),
                 "interleave": bool(g.op(t.op).attrs.get("interleave")),
                 "format": ws[0].dtype,
                 "segments": [[w.hf_name, s.row0, s.row1]
                              for w, s in zip(ws, rows, strict=True)]}
        if "derived" in ws[0].attrs:  # rows of a weight derived from the checkpoint tensor
            a = g.op(t.op).attrs
            entry["derived"] = [ws[0].attrs["derived"], {k: a[k] for k in MLA_DIMS}]
        layout.append(entry | _fp8_rows(g, ws))
        layout += _column_slices(program, t, entry["offset"] + entry["bytes"])
    for op in g.ops():
        region = op.attrs.get("experts_packed")
        if region is None:
            continue
        for e, names in enumerate(expert_weights(op)):
            ws = [g.tensors[n] for n in names]
            rows = ws[0].shape[0]
            layout.append({"offset": region["offset"] + e * region["stride"],
                           "bytes": rows * region["row_bytes"], "interleave": len(ws) > 1,
                           "format": ws[0].dtype, "expert": [op.name, e],
                           "segments": [[w.hf_name, 0, rows] for w in ws]} | _fp8_rows(g, ws))
    return layout


def _column_slices(program: Program, t, offset: int) -> list[dict[str, Any]]:
    """A task's column slices (a split-K FFN's part of W_down), each packed after its rows at
    `offset`: every row of the segment, only the columns [c0, c1) of each (`columns`)."""
    out = []
    for s in (s for s in t.segments if s.cols is not None):
        w = program.graph.tensors[s.tensor]
        n = segment_bytes(program, s)
        out.append({"offset": offset, "bytes": n, "interleave": False, "format": w.dtype,
                    "segments": [[w.hf_name, s.row0, s.row1]], "columns": list(s.cols)})
        offset += n
    return out


def _fp8_rows(g: Graph, ws: list[Tensor]) -> dict[str, Any]:
    """For FP8 weights, what packing needs besides the rows: each segment's scale tensor, the
    block, the columns one packed scale covers, the packed bytes of one row and whether the
    rows are packed as tiles (`ir/fp8.py: pack_tiles`); none for bf16."""
    if "scale_inv" not in ws[0].attrs:
        return {}
    return {"scales": [g.tensors[w.attrs["scale_inv"]].hf_name for w in ws],
            "block": list(ws[0].attrs["block"]), "scale_cols": scale_cols(ws[0]),
            "row_bytes": weight_row_bytes(ws[0]),
            **({"tiles": True} if ws[0].attrs.get("tiled") else {})}


def _kv_cache(program: Program) -> dict[str, Any]:
    """The caches' layout and each layer's buffers: GQA keys and values per KV head, or MLA's
    latent cache, one row per position shared by all heads (and, with DSA, the indexer's key
    cache, one row of its head_dim per position)."""
    ops = program.graph.ops()
    mla = [op for op in ops if op.opcode == "mla_attention"]
    if mla:
        a = mla[0].attrs
        index_keys = {op.layer: op.outputs[1] for op in ops if op.opcode == "dsa_score"}
        return {"layout": "[position][kv_lora_rank + qk_rope_head_dim] per layer, bf16: the "
                          "normed latent, then the rotated k_pe"
                          + ("; index keys [position][index head_dim], bf16: normed, rotated"
                             if index_keys else ""),
                "width": a["kv_lora_rank"] + a["qk_rope_head_dim"],
                "layers": {str(op.layer): {"latent": op.inputs[2],
                                           **({"index_keys": index_keys[op.layer]}
                                              if op.layer in index_keys else {})}
                           for op in mla}}
    attn = [op for op in ops if op.opcode == "attention"]
    return {"layout": "[kv_head][position][head_dim] per layer, bf16",
            "n_kv_heads": attn[0].attrs["n_kv_heads"], "head_dim": attn[0].attrs["head_dim"],
            "layers": {str(op.layer): {"k": op.inputs[-2], "v": op.inputs[-1]} for op in attn}}


def _tp_record(program: Program) -> dict[str, Any]:
    """The ranks, and how each rank's weights are cut from the checkpoint's (passes/sharding.py):
    for every sharded weight (by its checkpoint name), the axis and the number of equal parts
    it is cut into; rank r holds part r x parts // tp (fewer parts than ranks: KV heads
    replicated over ranks). Routed experts are whole experts per rank: the manifest names rank
    0's, `experts_per_rank` of them (rank r's j-th is the checkpoint's r x that + j). Every
    other weight is whole on every rank."""
    shards: dict[str, dict[str, int]] = {}
    for t in program.graph.tensors.values():
        if "shard" in t.attrs and t.hf_name:
            cut = {"axis": t.attrs["shard"]["axis"], "parts": t.attrs["shard"]["parts"]}
            if shards.setdefault(t.hf_name, cut) != cut:
                raise ScheduleError(f"weight {t.hf_name!r} is cut two ways: {shards[t.hf_name]} "
                                    f"and {cut}")
    local = program.config.get("sharding", {}).get("experts_per_rank")
    return {"tp": program.tp, "shards": shards,
            **({"experts_per_rank": local} if local and program.tp > 1 else {})}


def manifest(program: Program, options: CompileOptions, consts: dict[str, object],
             ptxas: dict[str, int], cubin_sha: str) -> dict[str, Any]:
    from tilertc import __version__

    spec = program.spec
    attn = next(op for op in program.graph.ops() if op.opcode in ("attention", "mla_attention"))
    key = json.dumps({"spec": spec.content_hash(), "compiler": __version__,
                      "options": options.hash(), "decisions": program.decisions,
                      "cubin": cubin_sha}, sort_keys=True)
    return {
        "format": ARTIFACT_FORMAT,
        "compiler_version": __version__,
        "hash": hashlib.sha256(key.encode()).hexdigest()[:24],
        "options": asdict(options),
        "target": {"name": program.target.name, "arch": program.target.arch,
                   "num_sms": program.target.num_sms},
        "model": {"name": spec.name, "spec_hash": spec.content_hash(), "spec": spec.to_dict(),
                  "hf_config": spec.hf_config},
        "kernel": {"name": codegen.KERNEL_NAME, "ctas": program.config["ctas"],
                   "threads": program.config["threads"], "smem_bytes": program.config["smem_bytes"],
                   "constants": consts, "ptxas": ptxas, "cubin_sha256": cubin_sha},
        "max_seq_len": program.graph.attrs["max_seq_len"],
        "arenas": {"act": program.config["act_arena"], "kv": program.config["kv_arena"]},
        "buffers": _buffer_table(program),
        "kv_cache": _kv_cache(program),
        "rope": {"attrs": attn.attrs["rope"], "head_dim": rope_dim(attn),
                 "buffer": "rope_table", "layout": "[position][cos head_dim/2 | sin head_dim/2]"},
        "embedding": "model.embed_tokens.weight",
        "logits": "logits",
        "counters": [c.name for c in program.counters],
        "sampler_counter": next(i for i, c in enumerate(program.counters)
                                if c.name in program.graph.nx
                                and program.graph.op(c.name).opcode == "argmax"),
        "tp": _tp_record(program),
        "weights": {"packed_bytes": program.config["packed_weight_bytes"],
                    "layout": _weight_layout(program)},
        "task_fields": list(encode.fields(program)),
        "cost": {"step_ns": step_ns(program), "roofline_ns": roofline_ns(program)},
        "decisions": program.decisions,
    }


def _kernel_source(program: Program, backend: str) -> tuple[str, tuple[str, ...], dict[str, Any]]:
    """The kernel source, extra nvcc flags, and the backend's manifest record (none for cuda)."""
    if backend == "tilelang":
        from tilertc.backends.tilelang.emit import emit

        emitted = emit(program)
        return emitted.source, emitted.nvcc_flags, emitted.record
    return codegen.emit_source(program), (), {}


def compile(spec: ModelSpec, out_dir: str | Path, options: CompileOptions | None = None,
            progress: Callable[[str], None] | None = None) -> Path:
    """Compile `spec` into an artifact directory; returns its path."""
    options = options or CompileOptions()
    if options.backend not in BACKENDS:
        raise ValueError(f"unknown backend {options.backend!r} (available: {', '.join(BACKENDS)})")
    if options.fp8_mma and options.backend != "cuda":
        raise ScheduleError(f"fp8_mma (FP8 rows on the tensor cores) is in the CUDA backend only, "
                            f"not {options.backend!r}; compile without fp8_mma")
    if options.backend == "tilelang":  # before scheduling: a missing install fails at once
        from tilertc.backends.tilelang.requirement import load_tilelang

        load_tilelang()
    spec = with_weight_dtype(spec, options.weight_dtype)
    say = progress or (lambda _msg: None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    say(f"scheduling ({', '.join(run.__name__ for run in PASSES)})")
    program = make_program(spec, options.target, options.tp, options.max_seq_len,
                           schedule_tuning(asdict(options)))
    say("emitting CUDA source" + (" with TileLang tiles" if options.backend == "tilelang" else ""))
    consts = codegen.constants(program)
    source, nvcc_flags, backend_record = _kernel_source(program, options.backend)
    src = out / "kernel.cu"
    src.write_text(source)
    tasks, offsets, ids = encode.encode(program)
    np.savez(out / "schedule.npz", tasks=tasks, stream_offsets=offsets, stream_tasks=ids)
    say(f"compiling with nvcc for {program.target.arch}")
    cubin = out / "kernel.cubin"
    if options.lineinfo:
        nvcc_flags = (*nvcc_flags, "-lineinfo")
    ptxas = codegen.compile_cubin(src, cubin, program.target.arch, nvcc_flags)
    sha = hashlib.sha256(cubin.read_bytes()).hexdigest()
    m = manifest(program, options, consts, ptxas, sha)
    if backend_record:
        m[options.backend] = backend_record
    (out / "manifest.json").write_text(json.dumps(m, indent=1, default=list))
    return out
