"""The conventional decode baselines that `tilertc bench` sets beside the persistent kernel.

A speed claim is only as good as what it is compared with, on the same GPU in the same run:
- `hf_eager`: Hugging Face transformers, eager, with a static KV cache, one Python-driven step
  per token (what most people run);
- `hf_cuda_graph`: the same step captured once in a CUDA graph and replayed per token, which
  removes the host's launch cost but keeps one kernel per op;
- `kernel_per_op`: a hand-written step with fused QKV and gate/up weights and cuBLAS GEMVs,
  captured in CUDA graphs on a GPU (`tilertc.kernel_per_op`), the stand-in for serving engines;
- `bandwidth_ceiling`: how fast this GPU reads a large bf16 matrix through torch, expressed as
  the time a token would take if it only had to read its weights at that rate.

Each decode baseline prefills a prompt (not timed), then decodes greedily; a token's time runs
from the start of its step to the moment its id is on the host, as a streaming server needs it.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from tilertc.inspect import charge_reads, human_bytes
from tilertc.ir.build import build_graph
from tilertc.ir.graph import TensorKind
from tilertc.kernel_per_op import KernelPerOpModel, allocated_bytes, unsupported
from tilertc.model_specs.spec import ModelSpec


class BaselineUnavailable(RuntimeError):
    """This baseline cannot run here (no CUDA device, transformers not installed, a family the
    baseline does not implement); the benchmark reports it as skipped, with this message."""


@dataclass(frozen=True)
class BaselineResult:
    name: str
    ms_per_token_median: float
    ms_per_token_p90: float
    tokens_per_s: float  # from the median
    bytes_per_token: int | None = None  # weight bytes one step reads, where known
    tokens: tuple[int, ...] = field(default=(), repr=False)  # greedy ids, to cross-check runs
    logits: tuple[torch.Tensor, ...] = field(default=(), repr=False)  # each token's, when kept

    @classmethod
    def from_seconds(cls, name: str, seconds: Sequence[float], bytes_per_token: int | None = None,
                     tokens: Sequence[int] = (),
                     logits: Sequence[torch.Tensor] = ()) -> BaselineResult:
        ms = 1e3 * np.asarray(seconds, dtype=np.float64)
        median = float(np.median(ms))
        return cls(name, median, float(np.percentile(ms, 90)), 1e3 / median, bytes_per_token,
                   tuple(tokens), tuple(logits))

    @property
    def bytes_per_s(self) -> float | None:
        """The read rate the median token achieves, for comparison with the ceiling."""
        if self.bytes_per_token is None:
            return None
        return self.bytes_per_token / (self.ms_per_token_median / 1e3)


class StepModel(Protocol):
    """A model that decodes one token per `step` over preallocated state.

    `step` reads its inputs from the tensors it is given and writes nothing but its cache and its
    output, so that a CUDA graph can capture it over fixed input buffers. `ctx_len` is how many
    cache rows attention reads (at least `pos + 1`); `graph_ctx_len` says which `ctx_len` a graph
    that serves a context of a given length is captured with.
    """

    device: torch.device

    def prefill(self, ids: torch.Tensor) -> torch.Tensor: ...

    def step(self, token: torch.Tensor, pos: torch.Tensor, ctx_len: int) -> torch.Tensor: ...

    def warmup(self, token: torch.Tensor, pos: torch.Tensor, ctx_len: int) -> None: ...

    def graph_ctx_len(self, ctx_len: int) -> int: ...


Stepper = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass
class GreedyDecode:
    tokens: list[int]  # the token chosen after the prompt, then one per step
    logits: list[torch.Tensor]  # each token's (the prefill's last, then one per step;
    # float32, CPU), when kept
    seconds: list[float]  # per step


def greedy_decode(model: StepModel, prompt: Sequence[int], n_steps: int,
                  stepper: Stepper | None = None, keep_logits: bool = False) -> GreedyDecode:
    """Prefill `prompt`, then run `n_steps` greedy steps through `stepper` (default: eager)."""
    device = model.device
    prefill_logits = model.prefill(torch.tensor(list(prompt), device=device))
    step = stepper or model.step
    token = prefill_logits.argmax(-1, keepdim=True)
    pos = torch.tensor([len(prompt)], device=device)
    out = GreedyDecode([int(token.item())], [prefill_logits.float().cpu()] if keep_logits else [],
                       [])
    for i in range(n_steps):
        start = time.perf_counter()
        logits = step(token, pos, len(prompt) + i + 1)
        token = logits.argmax(-1, keepdim=True)
        out.tokens.append(int(token.item()))  # waits for the step: the id is on the host now
        pos += 1
        out.seconds.append(time.perf_counter() - start)
        if keep_logits:
            out.logits.append(logits.float().cpu())
    return out


class CUDAGraphStepper:
    """A `StepModel.step` captured in CUDA graphs, one per attention length it needs.

    The graphs read the token and position from buffers this object owns and share one memory
    pool; all are captured up front, so that no capture falls inside a timed step.
    """

    def __init__(self, model: StepModel, ctx_lens: Iterable[int]) -> None:
        ctx_lens = list(ctx_lens)
        self.model = model
        self.token = torch.zeros(1, dtype=torch.long, device=model.device)
        # Warm-up steps before capture write the cache row of the first position to decode,
        # which that position's real step overwrites.
        self.pos = torch.tensor([min(ctx_lens) - 1], device=model.device)
        self.pool = None
        self.graphs = {n: self._capture(n) for n in sorted({model.graph_ctx_len(c)
                                                             for c in ctx_lens})}

    def _capture(self, ctx_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.model.warmup(self.token, self.pos, ctx_len)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.model.step(self.token, self.pos, ctx_len)
        self.pool = graph.pool()
        return graph, out

    def __call__(self, token: torch.Tensor, pos: torch.Tensor, ctx_len: int) -> torch.Tensor:
        self.token.copy_(token)
        self.pos.copy_(pos)
        graph, out = self.graphs[self.model.graph_ctx_len(ctx_len)]
        graph.replay()
        return out


def available_host_bytes() -> int | None:
    """The host memory free for new allocations (Linux's MemAvailable), or None if unknown."""
    return _proc_bytes("/proc/meminfo", "MemAvailable:")


def free_bytes(device: str | torch.device) -> int | None:
    """Memory free for new tensors on `device`: a GPU's free memory and what torch's caching
    allocator holds unused; the host's MemAvailable."""
    device = torch.device(device)
    if device.type != "cuda":
        return available_host_bytes()
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class HostPeak:
    """How far this process's resident memory rose, at its highest, while the block ran.

    Linux keeps a process's peak RSS (VmHWM); writing 5 to /proc/self/clear_refs resets it to
    the current RSS, so that the peak afterwards is the block's own. Memory the C heap keeps
    after a free is still resident, and would hide a new allocation that reuses it: the heap
    returns it to the system first (glibc's malloc_trim). `growth` is None where the reset or
    the figures are not to be had (not Linux, a sandbox that refuses it).
    """

    growth: int | None = None

    def __enter__(self) -> HostPeak:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).malloc_trim(0)
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.start = _proc_bytes("/proc/self/status", "VmRSS:")
        except OSError:
            self.start = None
        return self

    def __exit__(self, *exc: object) -> None:
        peak = _proc_bytes("/proc/self/status", "VmHWM:")
        if self.start is not None and peak is not None:
            self.growth = max(0, peak - self.start)


def _proc_bytes(path: str, field: str) -> int | None:
    """A Linux /proc file's `field` (a count of KiB) in bytes, or None where it is not to be had."""
    try:
        with open(path) as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith(field))
    except (OSError, StopIteration, ValueError):
        return None
    return kib * 1024


# transformers' loader materializes this many tensors at a time (its thread pool,
# `core_model_loading.GLOBAL_WORKERS`, at most 4).
LOADER_THREADS = 4
# A routed expert's tensor in checkpoint naming; transformers fuses a layer's into one tensor
# per projection (`mlp.shared_experts.` is a plain MLP and does not match).
EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.\d+\.")


def hf_host_bytes(weights: dict[str, torch.Tensor], device: str | torch.device,
                  dtype: torch.dtype) -> int:
    """The host memory transformers needs, beyond `weights` themselves, to build its model of
    them on `device` in `dtype` (`load_hf_model`).

    transformers (5.x) builds its modules on the meta device, then makes each parameter from
    its checkpoint tensor with `tensor.to(device, dtype)` and converts the checkpoint's layout
    (stacks a MoE layer's per-expert tensors into fused ones) where the tensors then are:
    - on the host (device "cpu"), a tensor already in `dtype` becomes the parameter itself,
      shared with `weights`; a cast is a copy, and so are the fused experts, of which one
      layer's stacks are in flight besides (before gate and up are concatenated);
    - on any other device the parameters hold no host memory; only the casts in flight do
      (torch casts a blocking host-to-device copy on the host), one per loader thread.
    A tensor of another dtype counts as cast, although transformers keeps the few that its
    modules declare in fp32 as they are (DeepSeek's routing correction bias): a few bytes over.
    """
    size = dtype.itemsize

    def cast(w: torch.Tensor) -> int:
        return w.numel() * size if w.dtype != dtype else 0

    if torch.device(device).type != "cpu":
        return sum(sorted((cast(w) for w in weights.values()), reverse=True)[:LOADER_THREADS])
    experts: dict[str, int] = defaultdict(int)  # bytes of each layer's routed experts
    copied = 0
    for name, w in weights.items():
        if m := EXPERT_TENSOR.match(name):
            experts[m.group(1)] += w.numel() * size
        else:
            copied += cast(w)
    return copied + sum(experts.values()) + max(experts.values(), default=0)


def check_host_memory(spec: ModelSpec, weights: dict[str, torch.Tensor],
                      device: str | torch.device, dtype: torch.dtype) -> None:
    """A host out of memory kills the whole bench, numbers already measured included: skip the
    baseline instead when what transformers holds on the host (`hf_host_bytes`) would not fit
    beside the weights the bench holds there. On a GPU that is next to nothing; on the host a
    MoE model's fused experts are a second copy of nearly all of its weights."""
    need, free = hf_host_bytes(weights, device, dtype), available_host_bytes()
    if free is not None and need > 0.9 * free:
        raise BaselineUnavailable(
            f"the Hugging Face model of {spec.name} on {device} needs ~{human_bytes(need)} of "
            f"host memory beside the {human_bytes(sum(w.nbytes for w in weights.values()))} "
            f"of weights; {human_bytes(free)} is available")


def dequantized_model(spec: ModelSpec, weights: dict[str, torch.Tensor],
                      dtype: torch.dtype = torch.bfloat16
                      ) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """The model an FP8 one dequantizes to: its config without the quantization_config, and
    every FP8 weight times its block scales (`ir/fp8.py: dequantize`) in `dtype`, on the host
    (the other weights as given). What the baselines run beside an FP8 kernel: the bf16
    engines people run today, on the numbers the FP8 kernel computes with. A bf16 model comes
    back as it is."""
    from tilertc.ir.fp8 import dequantize
    from tilertc.model_specs.hf import with_weight_dtype

    if not spec.weight_format.is_fp8:
        return spec, weights
    block = spec.weight_format.block
    out = {}
    for name, w in weights.items():
        if name.endswith("_scale_inv"):
            continue
        scale = weights.get(f"{name}_scale_inv")
        out[name] = w if scale is None else dequantize(w.cpu(), scale.cpu(), block).to(dtype)
    return with_weight_dtype(spec, "bf16"), out


def load_hf_model(spec: ModelSpec, weights: dict[str, torch.Tensor],
                  device: str | torch.device, dtype: torch.dtype,
                  experts_implementation: str | None = None) -> torch.nn.Module:
    """transformers' causal LM of the spec's architecture with `weights`, built on `device`.

    The weights go through transformers' own checkpoint conversion (`from_pretrained` with a
    state dict), which turns the checkpoint's per-expert MoE tensors into the fused expert
    tensors of its modules. `device_map` puts every parameter straight on `device`, tensor by
    tensor, so that a model on a GPU holds no second copy of the weights on the host
    (`hf_host_bytes`); `experts_implementation` picks transformers' MoE expert kernels.
    """
    if spec.weight_format.is_fp8:
        raise BaselineUnavailable("the Hugging Face baselines run bf16 weights; this model's "
                                  "are FP8 (dequantized_model gives the bf16 model)")
    try:
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
        from transformers.utils import is_accelerate_available
    except ImportError as e:
        raise BaselineUnavailable("the Hugging Face baselines need transformers "
                                  "(pip install 'tilertc[hf]')") from e
    if not is_accelerate_available():  # what transformers' device_map needs
        raise BaselineUnavailable("the Hugging Face baselines need accelerate "
                                  "(pip install 'tilertc[hf]')")
    check_host_memory(spec, weights, device, dtype)
    cfg = dict(spec.hf_config)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    if spec.tie_word_embeddings:
        weights = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"]}
    extra = {"experts_implementation": experts_implementation} if experts_implementation else {}
    try:
        model, info = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(
            None, config=config, state_dict=weights, dtype=dtype, attn_implementation="sdpa",
            device_map={"": torch.device(device)}, output_loading_info=True, **extra)
    except RuntimeError as e:  # its conversion of a tensor failed (it reports which)
        raise ValueError(f"transformers did not load the weights as given: {e}") from e
    unloaded = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
    if unloaded or info.get("error_msgs"):
        raise ValueError(f"transformers did not load the weights as given: {unloaded} "
                         f"{info.get('error_msgs', '')}")
    return model.eval()


class HFStepModel:
    """A Hugging Face transformers model of the spec's architecture (`load_hf_model`) with a
    static KV cache. `experts_implementation` picks transformers' MoE expert kernels (None:
    its default; "batched_mm" is what its own generate() uses under CUDA graphs).
    """

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], max_seq_len: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                 experts_implementation: str | None = None) -> None:
        self.model = load_hf_model(spec, weights, device, dtype, experts_implementation)
        from transformers import StaticCache

        self.device, self.max_seq_len = torch.device(device), max_seq_len
        self.config, self.static_cache_type = self.model.config, StaticCache
        self.cache = self.new_cache()
        # The static cache allocates its tensors (and moves its row counter to the device) on
        # its first update; do that now and clear it, so that it cannot fall inside a CUDA
        # graph capture, where a host-to-device copy is not allowed.
        with torch.no_grad():
            zero = torch.zeros(1, dtype=torch.long, device=self.device)
            self._forward(zero, zero, self.cache)
        self.cache.reset()

    def new_cache(self) -> object:
        return self.static_cache_type(config=self.config, max_cache_len=self.max_seq_len)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: object) -> torch.Tensor:
        out = self.model(input_ids=ids[None], position_ids=positions[None], past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return self._forward(ids, torch.arange(ids.numel(), device=self.device), self.cache)

    def step(self, token: torch.Tensor, pos: torch.Tensor, ctx_len: int) -> torch.Tensor:
        """`ctx_len` is not used: transformers' static cache attends over all of its rows."""
        return self._forward(token, pos, self.cache)

    def warmup(self, token: torch.Tensor, pos: torch.Tensor, ctx_len: int) -> None:
        """Run the step on a throwaway cache: the static cache counts the rows written to it, so
        a warm-up step on the real one would shift every later position."""
        self._forward(token, pos, self.new_cache())

    def graph_ctx_len(self, ctx_len: int) -> int:
        return self.max_seq_len


def require_cuda(device: str | torch.device) -> None:
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        raise BaselineUnavailable(f"needs a CUDA device (asked for {device!r}, "
                                  f"CUDA available: {torch.cuda.is_available()})")


def weight_bytes_per_token(spec: ModelSpec, dtype: torch.dtype = torch.bfloat16) -> int:
    """Weight bytes one decode step reads with the weights in `dtype`: the share of the weights
    `tilertc inspect` counts as read (each weight once; of a MoE layer's routed experts, the
    ones a token reads) of all of them, in `dtype`."""
    graph = build_graph(spec, max_seq_len=1)
    weights = graph.weights()
    read = sum(c[TensorKind.WEIGHT] for c in charge_reads(graph, 1).values())
    share = read / sum(t.nbytes for t in weights)
    return round(share * sum(t.numel for t in weights) * dtype.itemsize)


def run_decode_baseline(name: str, model: StepModel, prompt: Sequence[int], n_tokens: int,
                        warmup: int, graphed: bool, bytes_per_token: int | None,
                        keep_logits: bool = False) -> BaselineResult:
    """Decode `warmup + n_tokens` steps and time the last `n_tokens` (and keep each token's
    logits, to cross-check the baseline's numbers, with `keep_logits`)."""
    with torch.no_grad():
        stepper = None
        if graphed:
            first = len(prompt) + 1
            stepper = CUDAGraphStepper(model, range(first, first + warmup + n_tokens))
        run = greedy_decode(model, prompt, warmup + n_tokens, stepper, keep_logits)
    return BaselineResult.from_seconds(name, run.seconds[warmup:], bytes_per_token, run.tokens,
                                       run.logits)


def hf_eager(spec: ModelSpec, weights: dict[str, torch.Tensor], prompt: Sequence[int],
             n_tokens: int, device: str | torch.device = "cuda",
             dtype: torch.dtype = torch.bfloat16, warmup: int = 3) -> BaselineResult:
    """Hugging Face transformers, eager, static KV cache."""
    model = HFStepModel(spec, weights, len(prompt) + warmup + n_tokens + 1, device, dtype)
    return run_decode_baseline("hf-eager", model, prompt, n_tokens, warmup, False,
                               weight_bytes_per_token(spec, dtype))


def hf_cuda_graph(spec: ModelSpec, weights: dict[str, torch.Tensor], prompt: Sequence[int],
                  n_tokens: int, device: str | torch.device = "cuda",
                  dtype: torch.dtype = torch.bfloat16, warmup: int = 3) -> BaselineResult:
    """Hugging Face transformers' decode step captured in one CUDA graph (needs CUDA)."""
    require_cuda(device)
    model = HFStepModel(spec, weights, len(prompt) + warmup + n_tokens + 1, device, dtype,
                        experts_implementation="batched_mm" if spec.moe else None)
    return run_decode_baseline("hf-cuda-graph", model, prompt, n_tokens, warmup, True,
                               weight_bytes_per_token(spec, dtype))


def kernel_per_op(spec: ModelSpec, weights: dict[str, torch.Tensor], prompt: Sequence[int],
                  n_tokens: int, device: str | torch.device = "cuda",
                  dtype: torch.dtype = torch.bfloat16, warmup: int = 3,
                  keep_logits: bool = False) -> BaselineResult:
    """The hand-written kernel-per-op step; captured in CUDA graphs on a CUDA device. Skipped
    (BaselineUnavailable) where its stacked weights and cache would not fit in what is free."""
    if why := unsupported(spec):
        raise BaselineUnavailable(why)
    max_seq_len = len(prompt) + warmup + n_tokens + 1
    need, free = allocated_bytes(spec, weights, max_seq_len, device, dtype), free_bytes(device)
    if free is not None and need > free:
        raise BaselineUnavailable(
            f"the kernel-per-op model of {spec.name} needs ~{human_bytes(need)} of {device} "
            f"memory (stacked projections, KV cache); {human_bytes(free)} is free beside what "
            "is loaded")
    model = KernelPerOpModel(spec, weights, max_seq_len, device, dtype)
    graphed = model.device.type == "cuda"
    name = "kernel-per-op-cuda-graph" if graphed else "kernel-per-op-eager"
    return run_decode_baseline(name, model, prompt, n_tokens, warmup, graphed,
                               weight_bytes_per_token(spec, dtype), keep_logits)


def bandwidth_ceiling(bytes_per_token: int, device: str | torch.device = "cuda",
                      matrix_bytes: int = 1 << 30, reads_per_sample: int = 10,
                      samples: int = 20) -> BaselineResult:
    """Time bf16 matrix-vector products over a `matrix_bytes` matrix (far larger than L2) and
    report the time `bytes_per_token` bytes take at each sample's read rate."""
    device = torch.device(device)
    cols = 4096
    rows = max(1, matrix_bytes // (cols * 2))
    matrix = torch.randn(rows, cols, device=device).to(torch.bfloat16)
    vector = torch.randn(1, cols, device=device).to(torch.bfloat16)
    nbytes = matrix.numel() * matrix.element_size()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    seconds = []
    with torch.no_grad():
        torch.nn.functional.linear(vector, matrix)
        for _ in range(samples):
            sync()
            start = time.perf_counter()
            for _ in range(reads_per_sample):
                torch.nn.functional.linear(vector, matrix)
            sync()
            per_read = (time.perf_counter() - start) / reads_per_sample
            seconds.append(bytes_per_token * per_read / nbytes)
    return BaselineResult.from_seconds(f"bandwidth-ceiling ({nbytes / 2**20:.0f} MiB bf16 GEMV)",
                                       seconds, bytes_per_token)
