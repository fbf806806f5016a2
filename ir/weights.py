"""Model weights in Hugging Face naming: from a state dict, a safetensors file, or a directory."""

from __future__ import annotations

from pathlib import Path

import torch

from tilertc.ir.fp8 import quantize

WeightSource = dict[str, torch.Tensor] | str | Path


def load_state_dict(source: WeightSource) -> dict[str, torch.Tensor]:
    """{Hugging Face name: tensor} from a dict, a .safetensors file, or a directory of them."""
    if isinstance(source, dict):
        return source
    from safetensors.torch import load_file

    path = Path(source)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path}")
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"weights not found: {path}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def random_weights(
    graph, seed: int = 0, dtype: torch.dtype = torch.bfloat16, std: float = 0.02,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Random weights for every weight tensor of `graph`, by Hugging Face name, on the CPU.

    They are drawn on `device` (a GPU draws a 30B model's in seconds, the CPU in minutes; the
    values then depend on the device's generator as well as on `seed`) and returned on the
    CPU, where checkpoints live.

    Norm weights are drawn around 1 and biases around 0 so that activations stay in range
    through many layers, as in a trained model. FP8 weights are drawn the same way, then
    quantized per block, with their `weight_scale_inv` (powers of two under ue8m0). Weights
    the graph keeps in fp32 (DeepSeek's routing correction bias, fp32 in its checkpoints too)
    stay fp32, so that they pass the engine's weight checks.
    """
    ue8m0 = graph.attrs.get("weight_format", {}).get("scale_fmt") == "ue8m0"
    gen = torch.Generator(device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for t in graph.weights():
        if t.hf_name in out:
            continue
        if len(t.shape) == 1 and "norm" in t.hf_name:
            w = 1.0 + 0.1 * torch.randn(t.shape, generator=gen, device=device)
        else:
            w = std * torch.randn(t.shape, generator=gen, device=device)
        if "scale_inv" in t.attrs:
            scale_name = graph.tensors[t.attrs["scale_inv"]].hf_name
            q, scale = quantize(w, tuple(t.attrs["block"]), ue8m0)  # where drawn: fast on a GPU
            out[t.hf_name], out[scale_name] = q.cpu(), scale.cpu()
        else:
            out[t.hf_name] = w.to(torch.float32 if t.dtype == "fp32" else dtype).cpu()
    return out


def quantize_unscaled(graph, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` with each FP8 weight of `graph` that they hold in bf16, fp16 or fp32, without
    its `weight_scale_inv`, quantized here with its block scales (`ir/fp8.py: quantize`), so
    that a bf16 checkpoint runs as the FP8 model. Anything else is left for the caller's
    checks to judge (an e4m3 weight without its scales is an error, not something to guess)."""
    ue8m0 = graph.attrs.get("weight_format", {}).get("scale_fmt") == "ue8m0"
    out = dict(weights)
    for t in graph.weights():
        if "scale_inv" not in t.attrs:
            continue
        w, scale = weights.get(t.hf_name), graph.tensors[t.attrs["scale_inv"]].hf_name
        if w is not None and w.dtype in (torch.bfloat16, torch.float16, torch.float32) and \
                scale not in weights and tuple(w.shape) == t.shape:
            out[t.hf_name], out[scale] = quantize(w, tuple(t.attrs["block"]), ue8m0)
    return out
