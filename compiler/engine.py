"""`Engine`: load an artifact onto a GPU and decode with its persistent kernel.

Loading checks the artifact against this compiler and this GPU, checks the weights against
the artifact (every tensor, shape and dtype), packs them into the layout the manifest names,
and loads the cubin through the CUDA driver API. Prefill runs in the interpreter on the GPU
and its KV cache is copied into the kernel's layout; decoding is one cooperative launch that
runs the token loop on the GPU and streams tokens through a host-mapped ring. The kernel picks
each token itself: greedily, or by seeded temperature / top-k / top-p sampling whose exact
semantics (and the reference the kernel is tested against) are `tilertc.ir.sampling`.

An artifact compiled with `--tp N` runs on N GPUs of one host (`TensorParallelEngine`, which
`Engine.load` returns for it): one `Engine` per rank holds its shard of the weights and its
arenas, and the N kernels, launched together, exchange all-reduce rows and the sampler's pairs
through peer (NVLink) pointers (passes/synchronization.py). Sampling under tp is greedy only.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tilertc.artifact import (
    ArtifactError,
    WeightMismatch,
    check_capacity,
    check_device,
    check_weights,
    model_spec,
    read_cubin,
    read_manifest,
    weight_table,
)
from tilertc.ir.build import build_graph
from tilertc.ir.fp8 import pack_rows, pack_tiles, row_scales
from tilertc.ir.interpreter import Interpreter
from tilertc.ir.mla import derive_kv_b, derive_kv_b_scales
from tilertc.ir.rope import cos_sin
from tilertc.ir.sampling import SamplingParams
from tilertc.ir.weights import WeightSource, load_state_dict, quantize_unscaled, random_weights

__all__ = [
    "ArtifactError",
    "Engine",
    "SamplingParams",
    "WeightMismatch",
    "check_capacity",
    "check_device",
    "check_weights",
    "read_manifest",
]

PARAM_WORDS = 24  # decode/task_table.cuh: Params, 8-byte words (two more under tp: rank, peers)
SAMPLE_WORDS = 4  # decode/task_table.cuh: SampleArgs, 8-byte words
STATUS_WORDS = 8
ST_NUCLEUS_CUT = 6  # decode/task_table.cuh: Status, steps whose nucleus was cut to the candidates
ERROR_NAMES = {1: "watchdog", 2: "bad token id", 3: "context overflow", 4: "weight ring stalled"}


def pack_weights(layout: dict[str, Any], weights: dict[str, torch.Tensor],
                 device: torch.device) -> torch.Tensor:
    """The packed weight buffer (bytes) of a manifest's `weights` entry: each task's rows at its
    offset, gate/up pairs interleaved row by row, FP8 rows followed by their scales (or FP8
    tiles, a gate/up task's gate and up tiles in turn), a column slice (a split-K FFN's part
    of W_down) as rows of its columns (docs/artifact.md)."""
    packed = torch.zeros(layout["packed_bytes"], dtype=torch.uint8, device=device)
    # Only the tensors the current entry reads stay on the device, which keeps packing memory
    # small; entries are sorted so that those sharing tensors (the tiles of one gate/up pair,
    # say, or of one weight derived from a checkpoint tensor) come together and a tensor is
    # uploaded (and derived) about once.
    on_dev: dict[tuple[str, str], torch.Tensor] = {}
    for entry in sorted(layout["layout"], key=lambda e: ([seg[0] for seg in e["segments"]],
                                                          e.get("derived", [""])[0])):
        kind, dims = entry.get("derived", ("", None))
        scales = entry.get("scales", [None] * len(entry["segments"]))
        keys = {(seg[0], kind) for seg in entry["segments"]} | {(s, kind) for s in scales if s}
        for key in set(on_dev) - keys:
            del on_dev[key]
        for name, k in keys - set(on_dev):
            w = weights[name].to(device)
            if name in scales:  # per row, as the rows are packed
                block = tuple(entry["block"])
                on_dev[name, k] = derive_kv_b_scales(w, k, dims, block) if k else \
                    row_scales(w, block)
            else:
                on_dev[name, k] = derive_kv_b(w, k, dims) if k else w
        c0, c1 = entry.get("columns", (None, None))  # a column slice (bf16): those of each row
        pack = pack_tiles if entry.get("tiles") else pack_rows
        parts = [pack(on_dev[name, kind][r0:r1], on_dev[scale, kind][r0:r1])
                 if scale else on_dev[name, kind][r0:r1, c0:c1].contiguous().view(torch.uint8)
                 for (name, r0, r1), scale in zip(entry["segments"], scales, strict=True)]
        rows = torch.stack(parts, 1) if entry["interleave"] else torch.cat(parts)
        packed[entry["offset"] : entry["offset"] + rows.numel()] = rows.reshape(-1)
    return packed


def device_bytes(m: dict[str, Any]) -> int:
    """What loading artifact `m` allocates on its GPU (one rank): the packed weights, the act
    arena (float32, `act_arena`) and the KV arena (bf16)."""
    return m["weights"]["packed_bytes"] + 4 * m["arenas"]["act"] + 2 * m["arenas"]["kv"]


def act_arena(m: dict[str, Any], weights: dict[str, torch.Tensor],
              device: torch.device) -> torch.Tensor:
    """The fp32 act arena as a launch finds it: zeros, but the norm weights (buffers with an
    `hf_name`) and the RoPE table."""
    act = torch.zeros(m["arenas"]["act"], dtype=torch.float32, device=device)

    def buffer(name: str) -> torch.Tensor:
        b = m["buffers"][name]
        return act[b["offset"] : b["offset"] + b["numel"]]

    for name, b in m["buffers"].items():
        if b["hf_name"]:
            buffer(name).copy_(weights[b["hf_name"]].float().reshape(-1))
    rope = m["rope"]
    cos, sin = cos_sin(rope["attrs"], rope["head_dim"], torch.arange(m["max_seq_len"]))
    buffer(rope["buffer"]).copy_(torch.cat([cos, sin], 1).float().reshape(-1))
    return act


def copy_cache(m: dict[str, Any], state: dict[str, torch.Tensor], pos: torch.Tensor,
               kv: torch.Tensor) -> None:
    """The interpreter's caches (`state`) at positions `pos` into the kernel's KV arena `kv`:
    GQA keys and values from [position][kv_head][dim] to [kv_head][position][dim]; MLA's
    latent rows ([position][latent | k_pe]) and the DSA indexer's key rows as they are."""
    cfg = m["kv_cache"]
    for names in cfg["layers"].values():
        for name in names.values():
            b = m["buffers"][name]
            dst = kv[b["offset"] : b["offset"] + b["numel"]]
            # rounded to the arena's bf16 first, then moved (under tp, a rank's GPU is not the
            # interpreter's): half the bytes across
            src, at = state[name][pos].to(torch.bfloat16).to(kv.device), pos.to(kv.device)
            if "latent" in names:
                dst.view(state[name].shape)[at] = src
            else:  # src [n, kvh, hd]
                dst.view(cfg["n_kv_heads"], -1, cfg["head_dim"])[:, at] = src.transpose(0, 1)


def ranks(m: dict[str, Any]) -> int:
    """The tensor-parallel ranks an artifact was compiled for."""
    return m.get("tp", {}).get("tp", 1)


def shard_part(full: int, size: int, rank: int, tp: int) -> slice:
    """Rank `rank`'s part of `full` elements cut into parts of `size` (passes/sharding.py): its
    1/tp share, or, with fewer parts than ranks (KV heads replicated over ranks), the part its
    group of tp * size / full consecutive ranks shares."""
    if full % size or size * tp < full:
        raise ArtifactError(f"cannot cut {full} elements into {tp} ranks' parts of {size}")
    i = rank * (full // size) // tp
    return slice(i * size, (i + 1) * size)


# A routed expert's checkpoint tensor: its layer's prefix, the expert's index, the rest.
EXPERT = re.compile(r"(?P<pre>.*\.mlp\.experts\.)(?P<j>\d+)(?P<post>\..*)")


def shard_weights(m: dict[str, Any], weights: dict[str, torch.Tensor],
                  rank: int) -> dict[str, torch.Tensor]:
    """The weights rank `rank` holds: the manifest's sharded tensors (`tp.shards`: axis and
    number of parts by checkpoint name; an FP8 weight's `weight_scale_inv` is one of them, cut
    block for block with the weight) cut to its part, routed experts renumbered
    (`tp.experts_per_rank`: the manifest names rank 0's experts; rank r's j-th is the
    checkpoint's expert r x experts_per_rank + j), every other tensor whole."""
    out = dict(weights)
    for name, sh in m.get("tp", {}).get("shards", {}).items():
        w, axis = weights[name], sh["axis"]
        cut = [slice(None)] * w.dim()
        cut[axis] = shard_part(w.shape[axis], w.shape[axis] // sh["parts"], rank, ranks(m))
        out[name] = w[tuple(cut)]
    local = m.get("tp", {}).get("experts_per_rank")
    if local and rank:
        for name in weights:
            mine = EXPERT.match(name)
            if mine and int(mine["j"]) < local:
                out[name] = weights[f"{mine['pre']}{rank * local + int(mine['j'])}{mine['post']}"]
    return out


def rank_state(m: dict[str, Any], state: dict[str, torch.Tensor],
               rank: int) -> dict[str, torch.Tensor]:
    """The interpreter's caches as rank `rank` holds them: GQA keys and values of its KV heads
    ([position][kv_head][dim]); MLA's latent and index-key caches are whole on every rank."""
    cfg = m["kv_cache"]
    if "n_kv_heads" not in cfg:
        return state
    out = dict(state)
    for names in cfg["layers"].values():
        for name in names.values():
            heads = shard_part(state[name].shape[1], cfg["n_kv_heads"], rank, ranks(m))
            out[name] = state[name][:, heads]
    return out


def _driver():
    from cuda.bindings import driver

    return driver


def sample_words(params: SamplingParams) -> list[int]:
    """decode/task_table.cuh: SampleArgs as int64 words: temperature and top_p as the float64 bits
    of their float32 values (the precision the kernel and the reference use), top_k, the seed's
    bits."""

    def f64_bits(x: np.float32) -> int:
        return int(np.float64(x).view(np.int64))

    return [f64_bits(params.temperature32), f64_bits(params.top_p32), params.top_k,
            int(np.uint64(params.seed).view(np.int64))]


def _check(result: tuple, what: str) -> Any:
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error in {what}: {err}")
    return rest[0] if len(rest) == 1 else rest


class Engine:
    """A compiled model on one GPU, with its KV cache and position."""

    def __init__(
        self,
        artifact: Path,
        manifest: dict[str, Any],
        weights: dict[str, torch.Tensor],
        device: torch.device,
        watchdog_s: float,
        rank: int = 0,
    ) -> None:
        self.artifact, self.m, self.device, self.rank = artifact, manifest, device, rank
        self.spec = model_spec(manifest)
        self.graph = build_graph(self.spec, manifest["max_seq_len"])
        weights = quantize_unscaled(self.graph, weights)
        check_weights(weights, weight_table(self.graph))
        self.weights = weights  # the whole model's (the interpreter's); the rank's are packed
        self.max_seq_len = manifest["max_seq_len"]
        self.watchdog_ns = int(watchdog_s * 1e9)
        self.position = 0
        self.nucleus_cut_steps = 0  # of the last launch: top-p nuclei cut to the candidates
        self._interp: Interpreter | None = None
        self._upload()
        self._load_cubin()

    # -- loading ------------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        artifact: str | Path,
        weights: WeightSource | None = None,
        device: str = "cuda:0",
        random_seed: int | None = None,
        watchdog_s: float = 5.0,
        tp: int | None = None,
    ) -> Engine:
        """Load `artifact` with `weights` (HF state dict or safetensors path), or random weights
        drawn with `random_seed` when `weights` is None. An FP8 artifact takes an FP8 checkpoint
        (e4m3 weights with their `weight_scale_inv`) or a bf16 one, quantized at load. An
        artifact compiled with --tp N loads onto N GPUs (`device` names the first), as a
        `TensorParallelEngine`; `tp`, when given, must be the artifact's."""
        path = Path(artifact)
        m = read_manifest(path)
        dev = torch.device(device)
        if not torch.cuda.is_available():
            raise ArtifactError("no CUDA GPU is available to run the artifact")
        if tp is not None and tp != ranks(m):
            raise ArtifactError(f"{path} was compiled for --tp {ranks(m)}, not --tp {tp}")
        if ranks(m) > 1:
            return TensorParallelEngine.load(path, m, weights, dev, random_seed, watchdog_s)
        check_device(
            m,
            torch.cuda.get_device_capability(dev),
            torch.cuda.get_device_properties(dev).multi_processor_count,
            torch.cuda.get_device_name(dev),
        )
        if weights is None:
            sd = random_weights(build_graph(model_spec(m), m["max_seq_len"]), seed=random_seed or 0)
        else:
            sd = load_state_dict(weights)
        return cls(path, m, sd, dev, watchdog_s)

    def _upload(self) -> None:
        m, dev = self.m, self.device
        lay = m["weights"]
        mine = shard_weights(m, self.weights, self.rank)
        self.packed = pack_weights(lay, mine, dev)
        self.act = act_arena(m, mine, dev)
        self.kv = torch.zeros(m["arenas"]["kv"], dtype=torch.bfloat16, device=dev)
        self.embed = self.weights[m["embedding"]].to(dev).contiguous()
        sched = np.load(self.artifact / "schedule.npz")
        self.tasks = torch.from_numpy(sched["tasks"]).to(dev)
        self.stream_offsets = torch.from_numpy(sched["stream_offsets"]).to(dev)
        self.stream_tasks = torch.from_numpy(sched["stream_tasks"]).to(dev)
        self.counters = torch.zeros(len(m["counters"]), dtype=torch.int32, device=dev)
        self.status = torch.zeros(STATUS_WORDS, dtype=torch.int32, device=dev)
        self.device_tokens = torch.zeros(self.max_seq_len, dtype=torch.int32, device=dev)
        # Host-mapped (pinned, UVA) memory the kernel writes tokens to and reads the stop flag from.
        self.host_tokens = torch.zeros(self.max_seq_len, dtype=torch.int32).pin_memory()
        self.host_count = torch.zeros(1, dtype=torch.int32).pin_memory()
        self.host_stop = torch.zeros(1, dtype=torch.int32).pin_memory()
        self.params = torch.zeros(PARAM_WORDS + 2 * (ranks(m) > 1), dtype=torch.int64, device=dev)
        # tp: every rank's act and counters (decode/task_table.cuh: PeerTable)
        self.peers: torch.Tensor | None = None
        self.sample_args = torch.zeros(SAMPLE_WORDS, dtype=torch.int64, device=dev)
        self.profile: torch.Tensor | None = None

    def _act(self, name: str) -> torch.Tensor:
        b = self.m["buffers"][name]
        return self.act[b["offset"] : b["offset"] + b["numel"]]

    def routing(self) -> dict[int, tuple[list[int], list[float]]]:
        """The kernel's router at the last step, per MoE layer: the chosen experts, best first,
        and their combine weights (the `moe_router` outputs of the interpreter)."""
        return {op.layer: (self._act(op.outputs[0]).view(torch.int32).tolist(),
                           self._act(op.outputs[1]).tolist())
                for op in self.graph.ops() if op.opcode == "moe_router"}

    def selection(self) -> dict[int, list[int]]:
        """The kernel's DSA indexer at the last step, per layer that runs one: the selected
        token ids in increasing order, -1 past them (the `dsa_topk` output of the
        interpreter)."""
        return {op.layer: self._act(op.outputs[0]).view(torch.int32).tolist()
                for op in self.graph.ops() if op.opcode == "dsa_topk"}

    def index_scores(self) -> dict[int, torch.Tensor]:
        """The kernel's DSA indexer scores at the last step, per layer that runs one: a score
        per cache position (fp32; valid up to the step's position, the `dsa_topk` input)."""
        return {op.layer: self._act(op.inputs[0]).clone()
                for op in self.graph.ops() if op.opcode == "dsa_topk"}

    def _load_cubin(self) -> None:
        with torch.cuda.device(self.device):  # the module lives in this GPU's context
            self._load_module()

    def _load_module(self) -> None:
        drv = _driver()
        blob = read_cubin(self.artifact, self.m)
        torch.cuda.init()
        self._module = _check(drv.cuModuleLoadData(blob), "cuModuleLoadData")
        self._func = _check(
            drv.cuModuleGetFunction(self._module, self.m["kernel"]["name"].encode()),
            "cuModuleGetFunction",
        )
        smem = self.m["kernel"]["smem_bytes"]
        attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(drv.cuFuncSetAttribute(self._func, attr, smem), "cuFuncSetAttribute")
        per_sm = _check(
            drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                self._func, self.m["kernel"]["threads"], smem
            ),
            "cuOccupancyMaxActiveBlocksPerMultiprocessor",
        )
        if per_sm < 1:
            raise ArtifactError(
                f"the kernel ({self.m['kernel']['threads']} threads, {smem} B shared "
                "memory) cannot be resident on this GPU"
            )

    # -- decoding -----------------------------------------------------------------------------
    def _launch(self, first_token: int, start_pos: int, n_steps: int, eos: int,
                sampling: SamplingParams) -> None:
        self._prepare(first_token, start_pos, n_steps, eos, sampling)
        self._start()

    def _prepare(self, first_token: int, start_pos: int, n_steps: int, eos: int,
                 sampling: SamplingParams) -> None:
        """The launch's parameters, and the counters, status and host words zeroed (on this
        GPU's stream)."""
        if start_pos + n_steps > self.max_seq_len:
            raise ValueError(
                f"decoding {n_steps} tokens from position {start_pos} exceeds the KV "
                f"capacity of {self.max_seq_len} (compile with a larger --max-seq-len)"
            )
        ptr = [
            t.data_ptr()
            for t in (
                self.tasks,
                self.stream_offsets,
                self.stream_tasks,
                self.packed,
                self.act,
                self.kv,
                self.embed,
                self.counters,
                self.device_tokens,
                self.host_tokens,
                self.host_count,
                self.host_stop,
                self.status,
            )
        ]
        rope_off = self.m["buffers"][self.m["rope"]["buffer"]]["offset"]
        prof = self.profile.data_ptr() if self.profile is not None else 0
        prof_steps = self.profile.shape[0] if self.profile is not None else 0
        words = ptr + [
            first_token,
            start_pos,
            n_steps,
            eos,
            rope_off,
            self.m["sampler_counter"],
            self.watchdog_ns,
            prof,
            prof_steps,
            self.tasks.shape[0],
            self.sample_args.data_ptr(),
        ]
        if self.peers is not None:
            words += [self.rank, self.peers.data_ptr()]
        assert len(words) == self.params.numel()
        self.params.copy_(torch.tensor(words, dtype=torch.int64))
        self.sample_args.copy_(torch.tensor(sample_words(sampling), dtype=torch.int64))
        self.counters.zero_()
        self.status.zero_()
        self.host_count.zero_()
        self.host_stop.zero_()

    def _start(self) -> None:
        """The cooperative launch on this GPU's current stream (asynchronous)."""
        drv = _driver()
        arg = np.array([self.params.data_ptr()], dtype=np.uint64)
        args = np.array([arg.ctypes.data], dtype=np.uint64)
        stream = drv.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        k = self.m["kernel"]
        with torch.cuda.device(self.device):
            self._cooperative_launch(drv, stream, k, args)
        self._launch_args = (arg, args)  # keep alive until the launch has read them

    def _cooperative_launch(self, drv, stream, k: dict[str, Any], args: np.ndarray) -> None:
        _check(
            drv.cuLaunchCooperativeKernel(
                self._func,
                k["ctas"],
                1,
                1,
                k["threads"],
                1,
                1,
                k["smem_bytes"],
                stream,
                args.ctypes.data,
            ),
            "launch",
        )

    def _finish(self) -> int:
        torch.cuda.synchronize(self.device)
        st = self.status.cpu().tolist()
        if st[0]:
            counter = self.m["counters"][st[3]] if 0 <= st[3] < len(self.m["counters"]) else st[3]
            raise RuntimeError(
                f"kernel error: {ERROR_NAMES.get(st[0], st[0])} (SM {st[1]}, task "
                f"{st[2]}, waiting on counter of {counter!r}); the kernel stopped "
                "making progress and was ended by its watchdog"
            )
        self.nucleus_cut_steps = st[ST_NUCLEUS_CUT]
        return int(self.host_count[0])

    def prefill(self, input_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Fill the KV cache for `input_ids` with the interpreter on the GPU; returns its logits."""
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
        check_capacity(self.position, ids.numel(), 0, self.max_seq_len)
        pos = torch.arange(self.position, self.position + ids.numel())
        env = self._prefill_interpreter().run(ids, pos)
        self._copy_cache(pos)
        self.position += ids.numel()
        return env["logits"]

    def _prefill_interpreter(self) -> Interpreter:
        if self._interp is None:
            self._interp = Interpreter(self.graph, self.weights, self.device)
        return self._interp

    def reference(self, cache_dtype: torch.dtype | None = None) -> Interpreter:
        """The interpreter over the engine's weights on its GPU, holding the caches the engine's
        prefills computed (in float32, or rounded to `cache_dtype` as the kernel's copy is):
        what the kernel's next steps are checked against. It shares the weights the prefill
        interpreter put on the device."""
        prefill = self._prefill_interpreter()
        ref = prefill.fresh(cache_dtype)
        for name, cache in ref.state.items():
            cache.copy_(prefill.state[name])
        return ref

    def _copy_cache(self, pos: torch.Tensor) -> None:
        copy_cache(self.m, self._interp.state, pos, self.kv)

    def step(
        self,
        token_id: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> tuple[int, torch.Tensor]:
        """One decode step of the kernel: feed `token_id` at `self.position`; returns (the next
        token, chosen as `generate` does, and the step's logits)."""
        sampling = SamplingParams(temperature, top_k, top_p, seed)
        self._launch(int(token_id), self.position, 1, -1, sampling)
        self._finish()
        self.position += 1
        return int(self.device_tokens[0]), self._logits()

    def _logits(self) -> torch.Tensor:
        return self._act(self.m["logits"]).clone()

    def generate(
        self,
        input_ids: list[int] | torch.Tensor,
        max_new_tokens: int,
        eos_token_id: int | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> Iterator[int]:
        """Prefill `input_ids`, then decode up to `max_new_tokens` in one launch, yielding each
        token as the kernel writes it. Tokens are greedy with temperature 0, else sampled in the
        kernel from softmax(logits / temperature), restricted to the top_k most likely
        (0: off, at most `ir.sampling.K_MAX`) and then to the top_p nucleus, with the
        counter-based RNG keyed by (seed, position): reproducible for a seed, and the same
        tokens as single `step`s with the same arguments. Bad arguments raise ValueError here,
        before any work."""
        sampling = SamplingParams(temperature, top_k, top_p, seed)
        return self._generate(input_ids, max_new_tokens, eos_token_id, sampling)

    def _generate(
        self,
        input_ids: list[int] | torch.Tensor,
        max_new_tokens: int,
        eos_token_id: int | None,
        sampling: SamplingParams,
    ) -> Iterator[int]:
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("generate needs at least one input token")
        check_capacity(self.position, ids.numel(), max_new_tokens, self.max_seq_len)
        if ids.numel() > 1:
            self.prefill(ids[:-1])
        start = self.position
        self._launch(
            int(ids[-1]),
            start,
            max_new_tokens,
            -1 if eos_token_id is None else eos_token_id,
            sampling,
        )
        done = torch.cuda.Event()
        done.record()
        seen = 0
        while True:
            finished = done.query()
            count = int(self.host_count[0])
            while seen < count:
                yield int(self.host_tokens[seen])
                seen += 1
            if finished:
                break
            time.sleep(20e-6)
        seen_total = self._finish()
        for i in range(seen, seen_total):
            yield int(self.host_tokens[i])
        self.position = start + seen_total

    def enable_profile(self, steps: int) -> None:
        """Record (start, dependencies met, done) globaltimer stamps of every task for the first
        `steps` steps of each launch into `self.profile` [steps, tasks, 3] (ns)."""
        self.profile = (
            torch.zeros((steps, self.tasks.shape[0], 3), dtype=torch.int64, device=self.device)
            if steps
            else None
        )

    def stop(self) -> None:
        """Ask a running `generate` to stop after the token in flight."""
        self.host_stop[0] = 1


def _greedy_only(sampling: SamplingParams, tp: int) -> None:
    if sampling.temperature32 != 0:
        raise ValueError(f"sampling under --tp {tp} is greedy only (temperature 0): the ranks "
                         "do not yet draw the same random numbers; compile with --tp 1 to "
                         "sample with temperature, top-k or top-p")


def rank_devices(tp: int, first: torch.device) -> list[torch.device]:
    """The tp GPUs from `first` on, each able to reach every other's memory (P2P over NVLink);
    a clear error when there are fewer or they cannot."""
    start = first.index or 0
    have = torch.cuda.device_count()
    if start + tp > have:
        raise ArtifactError(f"the artifact was compiled for --tp {tp}: it runs on {tp} GPUs "
                            f"from cuda:{start}, and this machine has {have} "
                            f"(cuda:0..cuda:{have - 1})")
    devices = [torch.device("cuda", start + r) for r in range(tp)]
    for a in devices:
        for b in devices:
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                raise ArtifactError(f"--tp {tp}: {a} cannot access the memory of {b} (no P2P "
                                    "between them); the ranks need NVLink or PCIe P2P")
    return devices


def enable_peer_access(devices: list[torch.device]) -> None:
    """Every GPU's context may address every other's memory (cuCtxEnablePeerAccess)."""
    drv = _driver()
    done = drv.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
    for a in devices:
        with torch.cuda.device(a):
            torch.zeros(1, device=a)  # the runtime makes a's primary context current
            for b in devices:
                if b == a:
                    continue
                peer = _check(drv.cuDevicePrimaryCtxRetain(_check(drv.cuDeviceGet(b.index),
                                                                  "cuDeviceGet")),
                              "cuDevicePrimaryCtxRetain")
                (err,) = drv.cuCtxEnablePeerAccess(peer, 0)
                if err not in (drv.CUresult.CUDA_SUCCESS, done):
                    raise RuntimeError(f"CUDA driver error in cuCtxEnablePeerAccess({a} -> {b}): "
                                       f"{err}")


class TensorParallelEngine(Engine):
    """A model compiled with --tp N on N GPUs of one host: one `Engine` per rank (its shard
    of the weights, arenas, counters), peer access between them, the N cooperative kernels
    launched together (each on its GPU's stream), tokens streamed from rank 0. Prefill runs in
    the interpreter on rank 0's GPU; each rank gets its part of the caches."""

    def __init__(self, engines: list[Engine]) -> None:  # the ranks' engines hold the state
        r0 = engines[0]
        self.engines, self.tp = engines, len(engines)
        self.artifact, self.m, self.device, self.rank = r0.artifact, r0.m, r0.device, 0
        self.spec, self.graph, self.weights = r0.spec, r0.graph, r0.weights
        self.max_seq_len, self.watchdog_ns = r0.max_seq_len, r0.watchdog_ns
        self.position, self.nucleus_cut_steps, self._interp = 0, 0, None
        self.act, self.device_tokens = r0.act, r0.device_tokens
        self.host_tokens, self.host_count = r0.host_tokens, r0.host_count
        self.profile = None

    @classmethod
    def load(cls, path: Path, m: dict[str, Any], weights: WeightSource | None,
             first: torch.device, random_seed: int | None,
             watchdog_s: float) -> TensorParallelEngine:
        tp = ranks(m)
        devices = rank_devices(tp, first)
        for dev in devices:
            check_device(m, torch.cuda.get_device_capability(dev),
                         torch.cuda.get_device_properties(dev).multi_processor_count,
                         torch.cuda.get_device_name(dev))
        if weights is None:
            sd = random_weights(build_graph(model_spec(m), m["max_seq_len"]), seed=random_seed or 0)
        else:
            sd = load_state_dict(weights)
        engines = [Engine(path, m, sd, dev, watchdog_s, rank=r) for r, dev in enumerate(devices)]
        enable_peer_access(devices)
        table = [e.act.data_ptr() for e in engines] + [e.counters.data_ptr() for e in engines]
        for e in engines:  # decode.cuh: PeerTable
            e.peers = torch.tensor(table, dtype=torch.int64, device=e.device)
        return cls(engines)

    def _launch(self, first_token: int, start_pos: int, n_steps: int, eos: int,
                sampling: SamplingParams) -> None:
        _greedy_only(sampling, self.tp)
        for e in self.engines:
            e._prepare(first_token, start_pos, n_steps, eos, sampling)
        # every rank's counters are zero before any rank's kernel may arrive on them
        for e in self.engines:
            torch.cuda.synchronize(e.device)
        for e in self.engines:
            e._start()

    def _finish(self) -> int:
        counts = []
        for r, e in enumerate(self.engines):
            try:
                counts.append(e._finish())
            except RuntimeError as err:
                raise RuntimeError(f"rank {r} of {self.tp}: {err}") from None
        if len(set(counts)) > 1:
            raise RuntimeError(f"the ranks decoded different numbers of tokens: {counts}")
        return counts[0]

    def _copy_cache(self, pos: torch.Tensor) -> None:
        for e in self.engines:
            copy_cache(self.m, rank_state(self.m, self._interp.state, e.rank), pos, e.kv)

    def _logits(self) -> torch.Tensor:
        """The whole vocabulary's logits: rank r holds rows [r V/tp, (r + 1) V/tp)."""
        return torch.cat([e._act(self.m["logits"]).to(self.device) for e in self.engines])

    def enable_profile(self, steps: int) -> None:
        raise ValueError("profiling runs one GPU; profile the artifact compiled with --tp 1")

    def stop(self) -> None:
        for e in self.engines:
            e.host_stop[0] = 1
