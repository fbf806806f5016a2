"""The artifact directory and the checks the runtime makes before anything reaches a GPU.

Each bad input (foreign format or compiler, another target, a damaged cubin, wrong weights, a
prompt beyond the KV capacity) must fail with an error naming the cause. Everything here runs
on a CPU machine; only nvcc is needed, to build the tiny artifact the checks read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import tilertc
from tilertc.artifact import (
    REQUIRED_KEYS,
    ArtifactError,
    ExpectedWeights,
    WeightMismatch,
    check_artifact,
    check_capacity,
    check_device,
    check_weights,
    expected_weights,
    global_functions,
    kernel_entries,
    read_cubin,
    read_manifest,
    weight_table,
)
from tilertc.backends.cuda.codegen import find_nvcc
from tilertc.backends.cuda.encode import FIELDS
from tilertc.driver import CompileOptions, compile
from tilertc.engine import Engine
from tilertc.ir.weights import random_weights
from tilertc.model_specs import builtin_names

MODEL = "llama-tiny"
SEQ = 64

try:
    find_nvcc()
except FileNotFoundError:
    pytest.skip("nvcc is needed to build the artifact under test", allow_module_level=True)


def build(directory: Path, **options: Any) -> Path:
    options = {"max_seq_len": SEQ, **options}
    return compile(tilertc.load_spec(MODEL), directory, CompileOptions(**options))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("artifact"))


@pytest.fixture
def artifact(built: Path, tmp_path: Path) -> Path:
    """A private copy of the built artifact, free to damage."""
    return Path(shutil.copytree(built, tmp_path / "copy"))


def edit_manifest(artifact: Path, change) -> None:
    path = artifact / "manifest.json"
    m = json.loads(path.read_text())
    change(m)
    path.write_text(json.dumps(m))


# -- the directory and its manifest ---------------------------------------------------------
def test_built_artifact_passes_every_check(built: Path) -> None:
    m = check_artifact(built)
    assert m["model"]["name"] == MODEL and m["max_seq_len"] == SEQ
    assert m["options"]["target"] == "h200" and m["options"]["max_seq_len"] == SEQ
    assert m["task_fields"] == list(FIELDS)
    assert m["cost"]["step_ns"] > m["cost"]["roofline_ns"] > 0


def test_manifest_and_task_table_are_documented(built: Path) -> None:
    m = read_manifest(built)
    assert set(m) == set(REQUIRED_KEYS)
    documented = (Path(__file__).parents[1] / "docs" / "artifact.md").read_text()
    for key in [*REQUIRED_KEYS, *FIELDS]:
        assert f"`{key}`" in documented, f"docs/artifact.md does not describe {key!r}"


@pytest.mark.parametrize("key", ["kernel", "buffers", "weights", "sampler_counter", "cost"])
def test_missing_key_is_named(artifact: Path, key: str) -> None:
    edit_manifest(artifact, lambda m: m.pop(key))
    with pytest.raises(ArtifactError, match=key):
        read_manifest(artifact)


def test_missing_nested_key_is_named(artifact: Path) -> None:
    edit_manifest(artifact, lambda m: m["kernel"].pop("cubin_sha256"))
    with pytest.raises(ArtifactError, match=r"kernel\.cubin_sha256"):
        read_manifest(artifact)


def test_other_format_is_refused(artifact: Path) -> None:
    edit_manifest(artifact, lambda m: m.update(format=m["format"] + 1))
    with pytest.raises(ArtifactError, match="artifact format 2 is not 1; recompile"):
        read_manifest(artifact)


def test_other_compiler_version_is_refused(artifact: Path) -> None:
    edit_manifest(artifact, lambda m: m.update(compiler_version="0.0.1"))
    with pytest.raises(ArtifactError, match=r"built by tilertc 0\.0\.1, this is"):
        read_manifest(artifact)


def test_missing_file_is_named(artifact: Path) -> None:
    (artifact / "schedule.npz").unlink()
    with pytest.raises(ArtifactError, match="schedule.npz"):
        read_manifest(artifact)


def test_not_an_artifact(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="no manifest.json"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="unreadable manifest"):
        read_manifest(tmp_path)


def test_hash_is_stable_and_keys_the_options(built: Path, tmp_path: Path) -> None:
    same = read_manifest(build(tmp_path / "same"))
    longer = read_manifest(build(tmp_path / "longer", max_seq_len=2 * SEQ))
    assert same["hash"] == read_manifest(built)["hash"]
    assert longer["hash"] != same["hash"]


# -- the cubin ------------------------------------------------------------------------------
def test_exactly_one_kernel(built: Path) -> None:
    m = read_manifest(built)
    assert kernel_entries(read_cubin(built, m)) == [m["kernel"]["name"]]
    assert global_functions((built / "kernel.cu").read_text()) == 1


def test_global_functions_skips_comments() -> None:
    src = "// __global__ here\n/* and\n__global__ here */\n__global__ void a() {}\n" \
          "extern \"C\" __global__ void b() {}\n"
    assert global_functions(src) == 2


def test_not_an_elf_file() -> None:
    with pytest.raises(ArtifactError, match="ELF"):
        kernel_entries(b"not a cubin")


def test_damaged_cubin_is_refused(artifact: Path) -> None:
    path = artifact / "kernel.cubin"
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    path.write_bytes(bytes(blob))
    with pytest.raises(ArtifactError, match="does not match its manifest"):
        read_cubin(artifact, read_manifest(artifact))
    with pytest.raises(ArtifactError, match="does not match its manifest"):
        check_artifact(artifact)


# -- the device -----------------------------------------------------------------------------
def test_device_of_the_target_is_accepted(built: Path) -> None:
    check_device(read_manifest(built), (9, 0), 132, "NVIDIA H200")


def test_other_architecture_is_refused(built: Path) -> None:
    with pytest.raises(ArtifactError, match=r"for sm_90a \(h200\), but NVIDIA B200 is sm_100"):
        check_device(read_manifest(built), (10, 0), 148, "NVIDIA B200")


def test_too_few_sms_are_refused(built: Path) -> None:
    with pytest.raises(ArtifactError, match="schedules 132 CTAs, NVIDIA H100 PCIe has 114 SMs"):
        check_device(read_manifest(built), (9, 0), 114, "NVIDIA H100 PCIe")


def test_artifact_for_another_target(tmp_path: Path) -> None:
    m = check_artifact(build(tmp_path, target="b200"))
    assert m["target"]["arch"] == "sm_100a" and m["kernel"]["ctas"] == 148
    with pytest.raises(ArtifactError, match="built for sm_100a"):
        check_device(m, (9, 0), 132, "NVIDIA H200")
    check_device(m, (10, 0), 148, "NVIDIA B200")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message on a machine without a GPU")
def test_engine_without_gpu_is_a_clear_error(built: Path) -> None:
    with pytest.raises(ArtifactError, match="no CUDA GPU"):
        Engine.load(built, random_seed=0)


# -- the weights ----------------------------------------------------------------------------
@pytest.fixture
def weights(built: Path) -> tuple[dict[str, torch.Tensor], ExpectedWeights]:
    expected = expected_weights(read_manifest(built))
    return {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in expected.items()}, \
        expected


@pytest.mark.parametrize("name", [n for n in builtin_names() if "tiny" in n])
def test_random_weights_pass_the_weight_checks(name: str) -> None:
    """What Engine.load(random_seed=...) draws is what it then checks for (dtypes included:
    DeepSeek's correction bias is fp32)."""
    graph = tilertc.build_graph(tilertc.load_spec(name), 64)
    check_weights(random_weights(graph, seed=1), weight_table(graph))


def test_expected_weights_are_the_hf_names(weights) -> None:
    sd, expected = weights
    assert "model.embed_tokens.weight" in expected
    assert "model.layers.1.mlp.down_proj.weight" in expected
    check_weights(sd, expected)
    check_weights({**sd, "model.rotary_emb.inv_freq": torch.zeros(8)}, expected)  # extras are fine


def test_missing_weight_is_named(weights) -> None:
    sd, expected = weights
    name = "model.layers.0.self_attn.k_proj.weight"
    del sd[name]
    with pytest.raises(WeightMismatch, match=rf"'{name}' is missing"):
        check_weights(sd, expected)


def test_wrong_shape_is_named(weights) -> None:
    sd, expected = weights
    name = "model.layers.1.mlp.up_proj.weight"
    sd[name] = sd[name][:-1]
    with pytest.raises(WeightMismatch, match=rf"'{name}' has shape \[\d+, \d+\], the artifact"):
        check_weights(sd, expected)


def test_wrong_dtype_is_named(weights) -> None:
    sd, expected = weights
    name = "model.norm.weight"
    sd[name] = sd[name].float()
    with pytest.raises(WeightMismatch, match=rf"'{name}' is torch.float32, the artifact needs"):
        check_weights(sd, expected)


# -- the KV capacity ------------------------------------------------------------------------
def test_prompt_beyond_the_kv_capacity() -> None:
    with pytest.raises(ValueError, match="a prompt of 65 tokens at position 0 exceeds the KV "
                                         "capacity of 64 positions"):
        check_capacity(0, 65, 1, 64)
    with pytest.raises(ValueError, match="a prompt of 10 tokens at position 60 exceeds"):
        check_capacity(60, 10, 1, 64)


def test_new_tokens_beyond_the_kv_capacity() -> None:
    check_capacity(0, 10, 55, 64)  # the last new token is never fed back, so 55 fit
    with pytest.raises(ValueError, match="10 prompt \\+ 56 new tokens exceed .* at most 55 new"):
        check_capacity(0, 10, 56, 64)


def test_packed_weights_follow_the_task_table(tmp_path: Path) -> None:
    """Walk every weight-streaming task of the schedule row by row and find its rows in the
    packed buffer at the task's offset (gate/up interleaved), independently of pack_weights.
    llama-tiny-odd, so that tasks hold several rows and interleaving shows."""
    import numpy as np

    from tilertc.engine import pack_weights

    spec = tilertc.load_spec("llama-tiny-odd")
    built = compile(spec, tmp_path, CompileOptions(max_seq_len=SEQ))
    m = read_manifest(built)
    weights = random_weights(tilertc.build_graph(spec, m["max_seq_len"]), seed=5)
    packed = pack_weights(m["weights"], weights, torch.device("cpu")).view(torch.bfloat16)
    tasks = np.load(built / "schedule.npz")["tasks"]
    f = {name: i for i, name in enumerate(FIELDS)}
    entries = {e["offset"]: e for e in m["weights"]["layout"]}
    streamed = 0
    for t in tasks:
        if t[f["row_bytes"]] == 0:
            continue
        offset = ((int(t[f["w_hi"]]) << 32) | (int(t[f["w_lo"]]) & 0xFFFFFFFF)) * 16
        entry = entries[offset]
        rows = [weights[name][r] for name, r0, r1 in entry["segments"] for r in range(r0, r1)]
        if entry["interleave"]:  # gate row, up row, gate row, ...
            half = len(rows) // 2
            rows = [rows[i // 2 + (i % 2) * half] for i in range(2 * half)]
        got = packed[offset // 2: offset // 2 + sum(r.numel() for r in rows)]
        assert torch.equal(got, torch.cat(rows)), f"task at offset {offset}"
        assert len(rows) * rows[0].numel() * 2 == (t[f["row1"]] - t[f["row0"]]) * t[f["row_bytes"]]
        streamed += 1
    assert streamed == len(entries)


# -- variants for kernel experiments (tools/kernel_variant.py) ----------------------------------
def test_kernel_variant_is_a_checked_artifact_with_the_edited_source(built: Path,
                                                                      tmp_path: Path) -> None:
    import subprocess
    import sys

    tool = Path(__file__).parents[1] / "tools" / "kernel_variant.py"
    out = tmp_path / "variant"
    bounds = "__launch_bounds__((COMPUTE_WARPS + 1) * 32, 1)"  # 2 CTAs per SM: fewer registers
    run = subprocess.run([sys.executable, str(tool), str(built), str(out), "--define",
                          "EXPERIMENT=3", "--replace", bounds, bounds.replace("1)", "2)")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    source = (out / "kernel.cu").read_text()
    assert source.startswith("#define EXPERIMENT 3\n") and bounds.replace("1)", "2)") in source
    assert (out / "kernel.cubin").read_bytes() != (built / "kernel.cubin").read_bytes()
    m = check_artifact(out)  # the rebuilt cubin's hash was recorded
    assert m["model"]["spec_hash"] == check_artifact(built)["model"]["spec_hash"]
    missing = subprocess.run([sys.executable, str(tool), str(built), str(tmp_path / "v2"),
                              "--replace", "no such text", "x"], capture_output=True, text=True)
    assert missing.returncode != 0 and "is not in" in missing.stderr
