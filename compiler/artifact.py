"""The artifact directory on the host side: what must hold before anything reaches a GPU.

Every check here runs without a GPU, so that a wrong artifact, a wrong GPU or wrong weights
fail with a message naming the cause (file, key, tensor) instead of a launch that hangs or
decodes garbage. docs/artifact.md describes the format these functions read.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path
from typing import Any

import torch

from tilertc.ir.build import build_graph
from tilertc.ir.graph import Graph
from tilertc.model_specs.hf import spec_from_hf_config
from tilertc.model_specs.spec import ModelSpec

ARTIFACT_FORMAT = 1
FILES = ("manifest.json", "kernel.cubin", "kernel.cu", "schedule.npz")
# Every top-level manifest key the driver writes, and for objects the keys read from them.
REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "format": (), "compiler_version": (), "hash": (), "options": (),
    "target": ("name", "arch", "num_sms"),
    "model": ("name", "spec_hash", "hf_config"),
    "kernel": ("name", "ctas", "threads", "smem_bytes", "constants", "ptxas", "cubin_sha256"),
    "max_seq_len": (), "arenas": ("act", "kv"), "buffers": (),
    "kv_cache": ("layout", "layers"), "rope": ("attrs", "head_dim", "buffer"),
    "embedding": (), "logits": (), "counters": (), "sampler_counter": (),
    "weights": ("packed_bytes", "layout"), "tp": ("tp", "shards"), "task_fields": (),
    "cost": ("step_ns", "roofline_ns"),
    "decisions": (),
}
STO_CUDA_ENTRY = 0x10  # st_other bit that marks a kernel entry point in a CUDA ELF
STT_FUNC = 2
SHT_SYMTAB = 2


class ArtifactError(RuntimeError):
    """An artifact that cannot run here (other target, other compiler, damaged files)."""


class WeightMismatch(ValueError):
    """Weights that do not match the artifact; the message names the tensor."""


def read_manifest(artifact: str | Path) -> dict[str, Any]:
    """The manifest of `artifact`, after checking that this tilertc can run the directory.

    The format and compiler version must be this build's: the task table, the parameter block
    and the packed weight layout change between versions without notice in the manifest.
    """
    from tilertc import __version__

    root = Path(artifact)
    path = root / "manifest.json"
    if not path.is_file():
        raise ArtifactError(f"{artifact}: not a tilertc artifact (no manifest.json)")
    try:
        m = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{path}: unreadable manifest: {e}") from None
    if not isinstance(m, dict):
        raise ArtifactError(f"{path}: the manifest is not a JSON object")
    if m.get("format") != ARTIFACT_FORMAT:
        raise ArtifactError(f"{path}: artifact format {m.get('format')} is not {ARTIFACT_FORMAT}; "
                            "recompile with this tilertc")
    if m.get("compiler_version") != __version__:
        raise ArtifactError(f"{path}: built by tilertc {m.get('compiler_version')}, this is "
                            f"{__version__}; recompile")
    missing = [key for key in REQUIRED_KEYS if key not in m]
    missing += [f"{key}.{s}" for key, sub in REQUIRED_KEYS.items() if isinstance(m.get(key), dict)
                for s in sub if s not in m[key]]
    if missing:
        raise ArtifactError(f"{path}: manifest lacks {', '.join(missing)}")
    absent = [name for name in FILES if not (root / name).is_file()]
    if absent:
        raise ArtifactError(f"{artifact}: artifact lacks {', '.join(absent)}")
    return m


def check_device(m: dict[str, Any], capability: tuple[int, int], num_sms: int,
                 device_name: str = "this GPU") -> None:
    """The cubin must be built for this GPU's architecture, and the GPU must have an SM for
    every CTA: the cooperative launch needs all CTAs resident at once."""
    arch = m["target"]["arch"]
    have = f"sm_{capability[0]}{capability[1]}"
    if arch.rstrip("a") != have:
        raise ArtifactError(f"artifact built for {arch} ({m['target']['name']}), but "
                            f"{device_name} is {have}; recompile with --target for this GPU")
    if num_sms < m["kernel"]["ctas"]:
        raise ArtifactError(f"artifact schedules {m['kernel']['ctas']} CTAs, {device_name} has "
                            f"{num_sms} SMs")


def read_cubin(artifact: str | Path, m: dict[str, Any]) -> bytes:
    """The cubin's bytes, checked against the manifest's SHA-256 (a damaged or swapped cubin
    would otherwise run against a task table it was not built for)."""
    path = Path(artifact) / "kernel.cubin"
    blob = path.read_bytes()
    if hashlib.sha256(blob).hexdigest() != m["kernel"]["cubin_sha256"]:
        raise ArtifactError(f"{path} does not match its manifest (SHA-256 differs); recompile")
    return blob


def kernel_entries(cubin: bytes) -> list[str]:
    """Names of the kernel entry points in a cubin (an ELF64 file), read from its symbol table.

    A stdlib reader, because the CUDA toolkit on CPU-only machines may lack cuobjdump: entry
    points are the function symbols whose st_other carries STO_CUDA_ENTRY.
    """
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise ArtifactError("the cubin is not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)
                for i in range(shnum)]
    names = []
    for _, kind, _, _, off, size, link, _, _, entsize in sections:
        if kind != SHT_SYMTAB:
            continue
        strtab = sections[link][4]
        for j in range(size // entsize):
            name, info, other, _, _, _ = struct.unpack_from("<IBBHQQ", cubin, off + j * entsize)
            if info & 0xF == STT_FUNC and other & STO_CUDA_ENTRY:
                start = strtab + name
                names.append(cubin[start:cubin.index(b"\0", start)].decode())
    return names


def global_functions(source: str) -> int:
    """How many `__global__` functions a CUDA source defines (comments do not count)."""
    code = re.sub(r"//[^\n]*|/\*.*?\*/", "", source, flags=re.S)
    return len(re.findall(r"\b__global__\b", code))


def check_artifact(artifact: str | Path) -> dict[str, Any]:
    """Everything about an artifact that can be checked without a GPU; returns its manifest.

    One kernel is the design's promise (one cooperative launch runs every token), so a second
    entry point in the cubin or a second `__global__` in the source is an error.
    """
    root = Path(artifact)
    m = read_manifest(root)
    entries = kernel_entries(read_cubin(root, m))
    if entries != [m["kernel"]["name"]]:
        raise ArtifactError(f"{root}/kernel.cubin: kernel entries {entries}, expected exactly "
                            f"[{m['kernel']['name']!r}]")
    n_global = global_functions((root / "kernel.cu").read_text())
    if n_global != 1:
        raise ArtifactError(f"{root}/kernel.cu defines {n_global} __global__ functions, not 1")
    return m


def model_spec(m: dict[str, Any]) -> ModelSpec:
    """The spec the artifact was compiled from, rebuilt from the config it keeps."""
    return spec_from_hf_config(m["model"]["hf_config"], m["model"]["name"])


TORCH_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp32": torch.float32}
ExpectedWeights = dict[str, tuple[tuple[int, ...], torch.dtype]]


def weight_table(graph: Graph) -> ExpectedWeights:
    """{Hugging Face name: (shape, dtype)} of every weight a decode-step graph reads (with FP8
    weights: the e4m3 weights and their fp32 `weight_scale_inv`)."""
    return {t.hf_name: (tuple(t.shape), TORCH_DTYPES[t.dtype]) for t in graph.weights()}


def expected_weights(m: dict[str, Any]) -> ExpectedWeights:
    """The weights an artifact needs, by Hugging Face name; computed on the CPU."""
    return weight_table(build_graph(model_spec(m), m["max_seq_len"]))


def check_weights(weights: dict[str, torch.Tensor], expected: ExpectedWeights) -> None:
    """Every expected tensor present, with its shape and dtype; extra tensors are ignored (HF
    checkpoints carry some the decode step does not read)."""
    for name, (shape, dtype) in expected.items():
        if name not in weights:
            raise WeightMismatch(f"weight {name!r} is missing (the artifact needs shape "
                                 f"{list(shape)})")
        w = weights[name]
        if tuple(w.shape) != tuple(shape):
            raise WeightMismatch(f"weight {name!r} has shape {list(w.shape)}, the artifact needs "
                                 f"{list(shape)}")
        if w.dtype != dtype:
            raise WeightMismatch(f"weight {name!r} is {w.dtype}, the artifact needs {dtype}")


def check_capacity(position: int, prompt_len: int, max_new_tokens: int, capacity: int) -> None:
    """Raise ValueError unless a prompt and the tokens generated after it fit the KV cache.

    KV entries are written for every prompt token and for every generated token but the last
    (which is never fed back), starting at `position`.
    """
    if position + prompt_len > capacity:
        raise ValueError(f"a prompt of {prompt_len} tokens at position {position} exceeds the KV "
                         f"capacity of {capacity} positions (compile with a larger --max-seq-len)")
    if position + prompt_len + max_new_tokens - 1 > capacity:
        room = capacity - position - prompt_len + 1
        raise ValueError(f"{prompt_len} prompt + {max_new_tokens} new tokens exceed the KV "
                         f"capacity of {capacity} positions; at most {room} new tokens fit "
                         "(compile with a larger --max-seq-len)")
