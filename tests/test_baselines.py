"""The benchmark's baselines decode what the reference interpreter decodes.

On the CPU, in float32, the Hugging Face step and the kernel-per-op step must pick the same
greedy tokens as `tilertc.Reference` and agree with its logits; the CUDA-graph paths are
checked against their eager selves on a GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tilertc import Reference, build_graph, load_spec
from tilertc.baselines import (
    BaselineResult,
    BaselineUnavailable,
    HFStepModel,
    HostPeak,
    bandwidth_ceiling,
    dequantized_model,
    greedy_decode,
    hf_cuda_graph,
    hf_eager,
    hf_host_bytes,
    kernel_per_op,
    load_hf_model,
    weight_bytes_per_token,
)
from tilertc.ir.weights import random_weights
from tilertc.kernel_per_op import KernelPerOpModel, allocated_bytes

PROMPT = [1, 5, 9, 3]
STEPS = 8
MAX_SEQ = 64


def model_and_weights(name: str) -> tuple:
    spec = load_spec(name)
    return spec, random_weights(build_graph(spec, MAX_SEQ), seed=0, std=0.1)


def reference_decode(spec, weights) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits each was chosen from, of the interpreter, the oracle."""
    ref = Reference(spec, weights, max_seq_len=MAX_SEQ)
    logits = [ref.prefill(PROMPT)[-1]]
    tokens = [int(logits[0].argmax())]
    for _ in range(STEPS):
        logits.append(ref.decode(tokens[-1]))
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def assert_decodes(model, want_tokens: list[int], want_logits: list[torch.Tensor]) -> None:
    """A step model's greedy decode of PROMPT picks `want_tokens`, from logits within 1e-4."""
    with torch.no_grad():
        got = greedy_decode(model, PROMPT, STEPS, keep_logits=True)
    assert got.tokens == want_tokens
    for got_step, want_step in zip(got.logits, want_logits, strict=True):
        torch.testing.assert_close(got_step, want_step, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny"])
@pytest.mark.parametrize("step_model", [HFStepModel, KernelPerOpModel])
def test_step_models_match_reference(name: str, step_model: type) -> None:
    spec, weights = model_and_weights(name)
    want_tokens, want_logits = reference_decode(spec, weights)
    assert_decodes(step_model(spec, weights, MAX_SEQ, "cpu", torch.float32), want_tokens,
                   want_logits)


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "deepseek-v3-tiny"])
@pytest.mark.parametrize("experts", [None, "batched_mm"])
def test_hf_step_model_runs_moe_checkpoints(name: str, experts: str | None) -> None:
    """MoE checkpoints (one tensor per expert) reach transformers' fused expert modules through
    its own conversion; with its default expert kernels and with the batched ones the CUDA-graph
    baseline uses, the step decodes what the interpreter decodes."""
    spec, weights = model_and_weights(name)
    want_tokens, want_logits = reference_decode(spec, weights)
    assert_decodes(HFStepModel(spec, weights, MAX_SEQ, "cpu", torch.float32,
                               experts_implementation=experts), want_tokens, want_logits)


@pytest.mark.parametrize(("name", "missing"), [
    ("qwen3-moe-tiny", "model.layers.1.mlp.experts.3.up_proj.weight"),  # fails its conversion
    ("llama-tiny", "model.layers.0.post_attention_layernorm.weight"),  # left uninitialized
])
def test_hf_step_model_refuses_weights_it_cannot_place(name: str, missing: str) -> None:
    spec, weights = model_and_weights(name)
    del weights[missing]
    with pytest.raises(ValueError, match="did not load the weights"):
        HFStepModel(spec, weights, MAX_SEQ, "cpu", torch.float32)


def test_hf_step_model_skips_a_model_the_host_cannot_hold(monkeypatch) -> None:
    """What transformers holds on the host must fit its free memory, or the baseline is skipped
    with the figures (a host out of memory would kill the whole bench). On the host in float32,
    every bf16 weight is cast: a full copy, twice the checkpoint's bytes."""
    from tilertc import baselines

    spec, weights = model_and_weights("llama-tiny")
    need = hf_host_bytes(weights, "cpu", torch.float32)
    assert need == 2 * sum(w.nbytes for w in weights.values())
    monkeypatch.setattr(baselines, "available_host_bytes", lambda: need)
    with pytest.raises(BaselineUnavailable,
                       match="on cpu needs ~.* of host memory beside .* is available"):
        HFStepModel(spec, weights, MAX_SEQ, "cpu", torch.float32)
    monkeypatch.setattr(baselines, "available_host_bytes", lambda: 2 * need)
    HFStepModel(spec, weights, MAX_SEQ, "cpu", torch.float32)  # fits: builds


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "deepseek-v3-tiny"])
def test_hf_model_off_the_host_needs_no_host_copy(monkeypatch, name: str) -> None:
    """Built on another device (the bench's GPU; here the meta device, through the same
    `device_map` path) from weights already in its dtype, transformers' model holds nothing
    on the host, MoE experts included; on the host the same weights' fused experts are a copy,
    which a host with half of it free cannot hold."""
    from tilertc import baselines

    spec, weights = model_and_weights(name)
    assert hf_host_bytes(weights, "meta", torch.bfloat16) == kept_fp32(weights, torch.bfloat16)
    on_host = hf_host_bytes(weights, "cpu", torch.bfloat16)
    assert on_host > 0
    monkeypatch.setattr(baselines, "available_host_bytes", lambda: on_host // 2)
    model = load_hf_model(spec, weights, "meta", torch.bfloat16)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    with pytest.raises(BaselineUnavailable, match="on cpu needs"):
        load_hf_model(spec, dict(weights), "cpu", torch.bfloat16)


def kept_fp32(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> int:
    """What `hf_host_bytes` counts too many: it takes an fp32 weight of a model of another
    dtype for a cast, where transformers keeps those its modules declare fp32 as they are
    (DeepSeek's routing correction bias, a few bytes)."""
    return sum(w.numel() * dtype.itemsize for w in weights.values()
               if w.dtype == torch.float32 != dtype)


def fused_expert_layer(name: str) -> str | None:
    """The layer of one of transformers' fused expert parameters
    (`model.layers.1.mlp.experts.gate_up_proj`), else None."""
    head, sep, _ = name.rpartition(".experts.")
    return head if sep else None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny", "qwen3-moe-tiny",
                                  "deepseek-v3-tiny"])
def test_hf_host_bytes_counts_what_transformers_copies(name: str, dtype: torch.dtype) -> None:
    """On the host, the parameters transformers made rather than took from the checkpoint
    (those sharing no given tensor's storage: casts, fused experts) are what `hf_host_bytes`
    counts, besides one layer's expert stacks in flight (and `kept_fp32`); a weight already in
    the model's dtype is the given tensor itself."""
    spec, weights = model_and_weights(name)
    given = {w.untyped_storage().data_ptr() for w in weights.values()}
    model = load_hf_model(spec, weights, "cpu", dtype)
    made = {n: p.nbytes for n, p in model.named_parameters()
            if p.untyped_storage().data_ptr() not in given}
    layers: dict[str, int] = {}
    for n, nbytes in made.items():
        if (layer := fused_expert_layer(n)) is not None:
            layers[layer] = layers.get(layer, 0) + nbytes
    held = sum(made.values()) + max(layers.values(), default=0)
    assert held <= hf_host_bytes(weights, "cpu", dtype) <= held + kept_fp32(weights, dtype)
    if dtype == torch.bfloat16:
        assert all(fused_expert_layer(n) for n in made), sorted(made)


def mid_moe(width: int = 512) -> tuple:
    """A Qwen3-MoE of 64 experts of `width` (512: ~200 MB of bf16 weights), nearly all of it
    routed experts: large enough for its copies to stand out of a process's resident memory."""
    spec = load_spec("qwen3-moe-tiny", {"hidden_size": width, "moe_intermediate_size": width,
                                        "num_experts": 64})
    return spec, random_weights(build_graph(spec, MAX_SEQ), seed=0, std=0.1)


def test_hf_model_off_the_host_does_not_grow_host_memory() -> None:
    """Measured: building transformers' model of ~200 MB of MoE weights on another device
    (meta, through the same path as a GPU) raises the process's peak RSS by a small fraction of
    the weights, where building it on the host and moving it would first stack a full copy of
    the experts; on the host, the peak stays within `hf_host_bytes`."""
    load_hf_model(*model_and_weights("qwen3-moe-tiny"), "cpu", torch.bfloat16)  # imports done
    spec, weights = mid_moe()
    nbytes = sum(w.nbytes for w in weights.values())
    with HostPeak() as off_host:
        load_hf_model(spec, weights, "meta", torch.bfloat16)
    if off_host.growth is None:
        pytest.skip("this system does not let a process reset its peak RSS")
    assert off_host.growth < nbytes / 20, (off_host.growth, nbytes)
    with HostPeak() as on_host:
        load_hf_model(spec, weights, "cpu", torch.bfloat16)
    assert 0.8 * nbytes < on_host.growth <= hf_host_bytes(weights, "cpu", torch.bfloat16), \
        (on_host.growth, nbytes)


def test_host_peak_sees_an_allocation() -> None:
    with HostPeak() as peak:
        block = torch.ones(64 << 20, dtype=torch.uint8)
        del block
    if peak.growth is None:
        pytest.skip("this system does not let a process reset its peak RSS")
    assert (60 << 20) <= peak.growth < (96 << 20)


def test_hf_baselines_without_accelerate_are_skipped(monkeypatch) -> None:
    import transformers.utils

    spec, weights = model_and_weights("llama-tiny")
    monkeypatch.setattr(transformers.utils, "is_accelerate_available", lambda: False)
    with pytest.raises(BaselineUnavailable, match="need accelerate"):
        hf_eager(spec, weights, PROMPT, 2, "cpu")


def test_available_host_bytes_is_plausible() -> None:
    from tilertc.baselines import available_host_bytes

    free = available_host_bytes()
    assert free is None or 1 << 20 < free < 1 << 50


def test_kernel_per_op_attention_length_beyond_position_is_masked() -> None:
    """A graph captured for a bucket of context lengths reads more cache rows than are written;
    the rows past the position must not change the result."""
    spec, weights = model_and_weights("llama-tiny")
    model = KernelPerOpModel(spec, weights, MAX_SEQ, "cpu", torch.float32, ctx_bucket=16)
    with torch.no_grad():
        model.prefill(torch.tensor(PROMPT))
        for layer in model.layers:  # garbage in the unwritten rows
            layer.k_cache[:, len(PROMPT) + 1:] = 1e3
            layer.v_cache[:, len(PROMPT) + 1:] = 1e3
        token, pos = torch.tensor([7]), torch.tensor([len(PROMPT)])
        exact = model.step(token, pos, len(PROMPT) + 1)
        bucketed = model.step(token, pos, model.graph_ctx_len(len(PROMPT) + 1))
    assert model.graph_ctx_len(len(PROMPT) + 1) == 16
    torch.testing.assert_close(bucketed, exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_per_op_allocates_what_it_is_said_to(dtype: torch.dtype) -> None:
    """`allocated_bytes` (the memory check before a kernel-per-op run) is what the model's
    tensors take beyond the weights they share: in float32 the stacks and cache alone, in bf16
    a converted copy of every float32 weight too."""
    spec, weights = model_and_weights("qwen3-tiny")
    model = KernelPerOpModel(spec, weights, MAX_SEQ, "cpu", dtype)
    shared = {w.data_ptr() for w in weights.values()}
    fields = [*vars(model).values(), *(v for layer in model.layers for v in vars(layer).values())]
    tensors = {t.data_ptr(): t for t in fields
               if isinstance(t, torch.Tensor) and t.data_ptr() not in shared}
    positional = {model.cos.data_ptr(), model.sin.data_ptr(), model.key_positions.data_ptr()}
    own = sum(t.nbytes for p, t in tensors.items() if p not in positional)
    assert allocated_bytes(spec, weights, MAX_SEQ, "cpu", dtype) == own


def test_kernel_per_op_is_skipped_where_it_would_not_fit(monkeypatch) -> None:
    """Beside a kernel's packed copy of a 32B bf16 model the stacks do not fit in an H200's
    memory: the baseline is skipped with the figures, not run into an out-of-memory error."""
    import tilertc.baselines as baselines

    spec, weights = model_and_weights("llama-tiny")
    need = allocated_bytes(spec, weights, len(PROMPT) + 3 + 2 + 1, "cpu", torch.bfloat16)
    monkeypatch.setattr(baselines, "free_bytes", lambda device: need - 1)
    with pytest.raises(BaselineUnavailable, match="needs ~.* of cpu memory"):
        kernel_per_op(spec, weights, PROMPT, 2, "cpu")
    monkeypatch.setattr(baselines, "free_bytes", lambda device: need)
    assert len(kernel_per_op(spec, weights, PROMPT, 2, "cpu").tokens) == len(PROMPT) + 2


def test_kernel_per_op_rejects_other_families() -> None:
    spec, weights = model_and_weights("llama-tiny")
    with pytest.raises(BaselineUnavailable, match="kernel-per-op"):
        kernel_per_op(dataclasses.replace(spec, model_type="qwen3_moe"), weights, PROMPT, 2,
                      "cpu")


@pytest.mark.parametrize("baseline", [hf_eager, kernel_per_op])
def test_baselines_refuse_fp8_weights(baseline) -> None:
    from tilertc.model_specs.hf import with_weight_dtype

    spec, weights = model_and_weights("llama-tiny")
    with pytest.raises(BaselineUnavailable, match="FP8"):
        baseline(with_weight_dtype(spec, "fp8"), weights, PROMPT, 2, "cpu")


@pytest.mark.parametrize(("name", "step_model"), [("llama-tiny", HFStepModel),
                                                  ("qwen3-tiny", KernelPerOpModel),
                                                  ("deepseek-v3-tiny", HFStepModel)])
def test_the_dequantized_model_decodes_what_the_fp8_model_does(name: str, step_model: type) -> None:
    """Beside an FP8 kernel the baselines run the model its weights dequantize to (its config
    without quantization_config, each weight times its block scales): in float32 it picks the
    interpreter's tokens of the FP8 model, with its logits."""
    from tilertc.model_specs.hf import with_weight_dtype

    spec = with_weight_dtype(load_spec(name), "fp8")
    weights = random_weights(build_graph(spec, MAX_SEQ), seed=0, std=0.1)
    assert any(w.dtype == torch.float8_e4m3fn for w in weights.values())
    want_tokens, want_logits = reference_decode(spec, weights)
    plain, dequantized = dequantized_model(spec, weights, torch.float32)
    assert not plain.weight_format.is_fp8 and plain.hidden_size == spec.hidden_size
    assert not any(k.endswith("_scale_inv") for k in dequantized)
    assert all(w.dtype != torch.float8_e4m3fn for w in dequantized.values())
    assert_decodes(step_model(plain, dequantized, MAX_SEQ, "cpu", torch.float32), want_tokens,
                   want_logits)
    assert dequantized_model(plain, dequantized) == (plain, dequantized)  # bf16: as it is


@pytest.mark.parametrize("baseline", [hf_eager, kernel_per_op])
def test_decode_baselines_report_reference_tokens(baseline) -> None:
    spec, weights = model_and_weights("qwen3-tiny")
    want_tokens, _ = reference_decode(spec, weights)
    result = baseline(spec, weights, PROMPT, n_tokens=STEPS - 2, device="cpu",
                      dtype=torch.float32, warmup=2)
    assert list(result.tokens) == want_tokens
    assert 0 < result.ms_per_token_median <= result.ms_per_token_p90
    assert result.bytes_per_token == weight_bytes_per_token(spec, torch.float32)


def test_weight_bytes_per_token_counts_the_experts_a_token_reads() -> None:
    """A MoE step reads top_k of each MoE layer's routed experts: the baselines' read rate
    counts those, as `tilertc inspect` does, not every expert."""
    from tilertc.inspect import inspect_model
    from tilertc.ir.target import get_target

    for name in ("qwen3-tiny", "qwen3-moe-tiny"):
        spec = load_spec(name)
        totals = inspect_model(spec, get_target("h200"), max_seq_len=1).totals
        assert weight_bytes_per_token(spec) == totals["weight_bytes_per_token"]
        assert weight_bytes_per_token(spec, torch.float32) == 2 * weight_bytes_per_token(spec)
    assert totals["weight_bytes_per_token"] < totals["weight_bytes_stored"]


def test_result_statistics() -> None:
    r = BaselineResult.from_seconds("x", [0.002] * 9 + [0.012], bytes_per_token=1000)
    assert r.ms_per_token_median == pytest.approx(2.0)
    assert r.ms_per_token_p90 == pytest.approx(3.0)
    assert r.tokens_per_s == pytest.approx(500.0)
    assert r.bytes_per_s == pytest.approx(5e5)


def test_bandwidth_ceiling_scales_to_the_token() -> None:
    r = bandwidth_ceiling(bytes_per_token=1 << 20, device="cpu", matrix_bytes=1 << 20,
                          reads_per_sample=2, samples=3)
    assert r.bytes_per_token == 1 << 20
    assert r.bytes_per_s > 0
    assert r.ms_per_token_median > 0


def test_graph_baseline_needs_cuda() -> None:
    spec, weights = model_and_weights("llama-tiny")
    with pytest.raises(BaselineUnavailable, match="CUDA"):
        hf_cuda_graph(spec, weights, PROMPT, 2, device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny"])
def test_hf_cuda_graph_matches_hf_eager_on_gpu(name: str) -> None:
    """(MoE models: eager with transformers' default expert kernels, the graph with its batched
    ones.)"""
    spec, weights = model_and_weights(name)
    eager = hf_eager(spec, weights, PROMPT, STEPS, "cuda", torch.float32)
    graphed = hf_cuda_graph(spec, weights, PROMPT, STEPS, "cuda", torch.float32)
    assert graphed.tokens == eager.tokens


@pytest.mark.gpu
def test_hf_model_on_gpu_holds_no_host_copy() -> None:
    """transformers' model of ~800 MB of MoE weights, built on the GPU, raises the process's
    peak RSS by a small fraction of the weights, and its parameters are the ones it makes of
    the same weights on the host."""
    load_hf_model(*model_and_weights("qwen3-moe-tiny"), "cuda", torch.bfloat16)  # CUDA is up
    spec, weights = mid_moe(1024)
    nbytes = sum(w.nbytes for w in weights.values())
    with HostPeak() as peak:
        model = load_hf_model(spec, weights, "cuda", torch.bfloat16)
    on_host = dict(load_hf_model(spec, weights, "cpu", torch.bfloat16).named_parameters())
    for name, p in model.named_parameters():
        assert p.device.type == "cuda" and torch.equal(p.cpu(), on_host[name]), name
    if peak.growth is None:
        pytest.skip("this system does not let a process reset its peak RSS")
    assert peak.growth < nbytes / 10, (peak.growth, nbytes)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny"])
def test_kernel_per_op_cuda_graph_matches_reference_on_gpu(name: str) -> None:
    spec, weights = model_and_weights(name)
    want_tokens, _ = reference_decode(spec, weights)
    result = kernel_per_op(spec, weights, PROMPT, STEPS - 2, "cuda", torch.float32, warmup=2)
    assert result.name == "kernel-per-op-cuda-graph"
    assert list(result.tokens) == want_tokens


@pytest.mark.gpu
def test_bandwidth_ceiling_on_gpu_is_plausible() -> None:
    """HBM reads on an H100/H200 run at terabytes per second; far less means a broken timer."""
    r = bandwidth_ceiling(bytes_per_token=1 << 30, device="cuda")
    assert 1e12 < r.bytes_per_s < 1e13
