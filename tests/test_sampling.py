"""Seeded sampling (ir/sampling.py) on the CPU: the RNG, the distributions, the filters, and
the model of the kernel's candidate merge against the reference over the full logits.

Statistical checks use fixed seeds, so they are deterministic; their thresholds sit at the
0.9995 quantile, so a correct sampler passes them with that confidence and a biased one of the
sizes that matter (a few percent on a token) fails.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from kernel_source import KernelSource

from tilertc.ir.sampling import (
    K_MAX,
    SamplingParams,
    by_rank,
    candidate_slots,
    gumbel,
    gumbel_scores,
    mix64,
    order_key,
    row_bits,
    sample,
    sample_tokens,
    select_top,
    stream_key,
    tiled_sample,
    uniforms,
)

MASK = 2**64 - 1
GOLDEN = 0x9E3779B97F4A7C15


def chi2_limit(df: int, z: float = 3.29) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.29: 0.9995)."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def softmax64(x: np.ndarray, t: float) -> np.ndarray:
    e = np.exp((x.astype(np.float64) - x.max()) / t)
    return e / e.sum()


def py_mix64(x: int) -> int:
    z = (x + GOLDEN) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def draw(logits: np.ndarray, params: SamplingParams, n: int, start: int = 0) -> np.ndarray:
    """n tokens, one per decode position start..start+n-1."""
    return np.array([sample(logits, params, pos).token for pos in range(start, start + n)])


# -- the RNG -----------------------------------------------------------------------------------

def test_mix64_is_splitmix64() -> None:
    # SplitMix64's published outputs: seed 0, and the first five of seed 1234567
    assert int(mix64(0)) == 0xE220A8397B1DCDAF
    states = [(1234567 + i * GOLDEN) & MASK for i in range(5)]
    assert [int(v) for v in mix64(np.array(states, dtype=np.uint64))] == [
        6457827717110365317, 3203168211198807973, 9817491932198370423,
        4593380528125082431, 16408922859458223821]


def test_mix64_matches_python_integers() -> None:
    xs = np.random.default_rng(0).integers(0, 2**64, 1000, dtype=np.uint64, endpoint=False)
    assert [int(v) for v in mix64(xs)] == [py_mix64(int(x)) for x in xs]


def test_uniforms_are_the_documented_function() -> None:
    seed, pos, rows = 2**63 + 5, 77, np.array([0, 1, 128255])
    key = py_mix64(py_mix64(seed) ^ pos)
    want = [((py_mix64(key ^ r) >> 12) + 0.5) * 2.0**-52 for r in rows.tolist()]
    assert uniforms(seed, pos, rows).tolist() == want
    assert int(stream_key(seed, pos)) == key


def test_uniforms_are_in_the_open_interval_and_exact() -> None:
    u = uniforms(3, 9, np.arange(100_000))
    assert (u > 0).all() and (u < 1).all()
    k = u * 2.0**52 - 0.5
    assert np.array_equal(k, np.floor(k))


def test_uniforms_are_uniform_over_rows_and_positions() -> None:
    n, bins = 200_000, 100
    probs = np.full(bins, 1 / bins)
    over_rows = uniforms(11, 5, np.arange(n))
    over_positions = uniforms(11, np.arange(n), 7)
    for u in (over_rows, over_positions):
        counts = np.bincount((u * bins).astype(int), minlength=bins)
        assert chi2(counts, probs) < chi2_limit(bins - 1)
        d = np.abs(np.sort(u) - (np.arange(n) + 0.5) / n).max()  # Kolmogorov-Smirnov
        assert d < 1.95 / math.sqrt(n)  # the 0.999 critical value


def test_neighbouring_draws_are_independent() -> None:
    u = uniforms(5, 3, np.arange(100_001))
    pairs = (u[:-1] * 10).astype(int) * 10 + (u[1:] * 10).astype(int)
    assert chi2(np.bincount(pairs, minlength=100), np.full(100, 0.01)) < chi2_limit(99)
    v = uniforms(5, np.arange(100_000), 0)  # same row, consecutive positions
    w = uniforms(5, np.arange(100_000), 1)  # the next row
    assert abs(np.corrcoef(v, w)[0, 1]) < 4 / math.sqrt(100_000)


def test_gumbel_noise_has_the_gumbel_moments() -> None:
    g = gumbel(1, 0, np.arange(400_000)).astype(np.float64)
    assert abs(g.mean() - 0.5772156649) < 0.01
    assert abs(g.var() - math.pi**2 / 6) < 0.02
    assert g.max() < 40  # 52-bit uniforms: the tail reaches ~36.7, never inf


# -- the distributions ---------------------------------------------------------------------------

LOGITS = np.array([2.0, 1.5, 1.4, 0.3, 0.0, -0.5, -1.0, -3.0], dtype=np.float32)


def test_temperature_sampling_is_softmax() -> None:
    for temp in (0.7, 1.0, 2.5):
        params = SamplingParams(temperature=temp, seed=123)
        counts = np.bincount(draw(LOGITS, params, 30_000), minlength=LOGITS.size)
        assert chi2(counts, softmax64(LOGITS, temp)) < chi2_limit(LOGITS.size - 1), temp


@pytest.mark.parametrize(("top_k", "top_p", "support"), [(3, 1.0, 3), (0, 0.7, 3), (5, 0.85, 4),
                                                          (1, 1.0, 1)])
def test_filtered_sampling_is_the_renormalized_softmax(top_k: int, top_p: float,
                                                       support: int) -> None:
    # temperature 1.3: probabilities .326 .222 .206 .088 .070 ...: top_p 0.7 keeps three;
    # within the top 5 (renormalized: .358 .243 .225 .097 .077) top_p 0.85 keeps four
    params = SamplingParams(temperature=1.3, top_k=top_k, top_p=top_p, seed=9)
    tokens = draw(LOGITS, params, 20_000)
    assert set(tokens.tolist()) <= set(range(support))
    if support > 1:
        probs = softmax64(LOGITS[:support], 1.3)
        counts = np.bincount(tokens, minlength=support)
        assert chi2(counts, probs) < chi2_limit(support - 1)


def test_greedy_is_the_first_largest_logit() -> None:
    x = np.array([1.0, 3.0, 3.0, -1.0], dtype=np.float32)
    for params in (SamplingParams(), SamplingParams(temperature=0.0, top_k=2, top_p=0.5)):
        assert sample(x, params, 5).token == 1
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample_tokens(logits, torch.arange(6), SamplingParams()),
                       logits.argmax(-1, keepdim=True))


def test_sample_tokens_is_sample_per_position() -> None:
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.9, top_k=20, seed=4)
    pos = torch.tensor([10, 11, 12, 13, 14])
    got = sample_tokens(logits, pos, params)
    assert got.shape == (5, 1) and got.dtype == torch.long
    assert got[:, 0].tolist() == [sample(logits[i], params, 10 + i).token for i in range(5)]


def test_top_k_never_leaves_the_top_k() -> None:
    rng = np.random.default_rng(2)
    for top_k in (1, 2, 7, K_MAX):
        x = rng.normal(0, 3, 1000).astype(np.float32)
        allowed = set(by_rank(x)[:top_k].tolist())
        params = SamplingParams(temperature=5.0, top_k=top_k, seed=top_k)
        assert set(draw(x, params, 300).tolist()) <= allowed


def hf_kept(x: np.ndarray, temp: float, top_k: int, top_p: float) -> set[int]:
    """The tokens transformers' warpers (temperature, top-k, top-p) leave finite."""
    warpers = pytest.importorskip("transformers.generation.logits_process")
    s = torch.from_numpy(x.astype(np.float64))[None]
    s = warpers.TemperatureLogitsWarper(temp)(None, s)
    if top_k:
        s = warpers.TopKLogitsWarper(top_k)(None, s)
    s = warpers.TopPLogitsWarper(top_p)(None, s)
    return set(torch.nonzero(torch.isfinite(s[0]))[:, 0].tolist())


@pytest.mark.parametrize(("temp", "top_k", "top_p"), [(1.0, 0, 0.9), (0.6, 0, 0.5),
                                                      (2.0, 40, 0.95), (1.0, 10, 0.3)])
def test_top_p_is_the_transformers_nucleus(temp: float, top_k: int, top_p: float) -> None:
    rng = np.random.default_rng(int(temp * 10) + top_k)
    x = rng.normal(0, 2.5, 5000).astype(np.float32)
    params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, seed=1)
    nucleus = hf_kept(x, temp, top_k, float(np.float32(top_p)))
    first = sample(x, params, 0, candidates=None)
    assert first.kept == len(nucleus) and set(by_rank(x)[:first.kept].tolist()) == nucleus
    assert set(draw(x, params, 300).tolist()) <= nucleus


def test_a_nucleus_beyond_the_candidates_is_cut() -> None:
    x = np.random.default_rng(3).normal(0, 0.1, 5000).astype(np.float32)  # nearly flat
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=2)
    exact = sample(x, params, 0, candidates=None)
    kernel = sample(x, params, 0)
    assert exact.kept > K_MAX and not exact.cut
    assert kernel.kept == K_MAX and kernel.cut
    assert kernel.token in set(by_rank(x)[:K_MAX].tolist())


def test_seeds_reproduce_and_differ() -> None:
    x = np.random.default_rng(4).normal(0, 1, 500).astype(np.float32)
    for params in (SamplingParams(temperature=1.0, seed=7),
                   SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=7)):
        a, b = draw(x, params, 200), draw(x, params, 200)
        other = draw(x, SamplingParams(temperature=1.0, top_k=params.top_k,
                                       top_p=params.top_p, seed=8), 200)
        assert np.array_equal(a, b)
        assert (a != other).mean() > 0.5
        assert len(set(a.tolist())) > 20  # it samples, it does not pick one token


def test_top_k_one_and_tiny_temperature_are_greedy() -> None:
    x = np.random.default_rng(5).normal(0, 1, 500).astype(np.float32)
    best = int(np.argmax(x))
    assert set(draw(x, SamplingParams(temperature=1.0, top_k=1), 50).tolist()) == {best}
    assert set(draw(x, SamplingParams(temperature=1e-4), 50).tolist()) == {best}


# -- the kernel's algorithm --------------------------------------------------------------------

def test_select_top_is_the_sorted_prefix() -> None:
    rng = np.random.default_rng(6)
    for trial in range(300):
        n = int(rng.integers(1, 400))
        distinct = int(rng.integers(1, 6)) if trial % 2 else n  # half the trials: many ties
        x = rng.choice(rng.normal(0, 3, distinct).astype(np.float32), n)
        if trial % 7 == 0:
            x[rng.integers(0, n)] = -np.inf
        rows = rng.permutation(2000)[:n]
        want = int(rng.integers(1, n + 1))
        got = select_top(order_key(x), rows, want, row_bits(2000))
        best = np.lexsort((rows, -x.astype(np.float64)))[:want]
        assert got.sum() == want and set(np.nonzero(got)[0].tolist()) == set(best.tolist())


def test_order_key_orders_floats() -> None:
    x = np.array([-np.inf, -1e30, -2.0, -1e-40, -0.0, 0.0, 1e-40, 3.0, 1e30, np.inf],
                 dtype=np.float32)
    k = order_key(x)
    assert (np.diff(k.astype(np.int64)) >= 0).all() and (np.diff(k[5:].astype(np.int64)) > 0).all()


PARAMS = [SamplingParams(), SamplingParams(temperature=0.9, seed=7),
          SamplingParams(temperature=0.8, top_k=40, seed=1),
          SamplingParams(temperature=1.0, top_p=0.9, seed=2),
          SamplingParams(temperature=0.5, top_k=64, top_p=0.7, seed=3),
          SamplingParams(temperature=1.7, top_k=1, seed=4),
          SamplingParams(temperature=1.2, top_p=0.99, seed=5),
          SamplingParams(temperature=0.3, top_k=5, top_p=0.5, seed=6)]


@pytest.mark.parametrize(("vocab", "tasks"), [(256, 132), (1000, 132), (9000, 132),
                                              (30_000, 132), (5000, 7), (100, 100)])
def test_candidate_merge_equals_sampling_the_full_logits(vocab: int, tasks: int) -> None:
    rng = np.random.default_rng(vocab + tasks)
    checked = 0
    for trial in range(12):
        scale = (0.3, 2.0, 8.0)[trial % 3]  # flat to peaked
        x = rng.normal(0, scale, vocab).astype(np.float32)
        if trial % 4 == 3:  # duplicated logits: ties at every boundary
            x = rng.choice(x[:40], vocab)
        for params in PARAMS:
            want = sample(x, params, trial)
            got = tiled_sample(x, params, trial, tasks)
            if want.margin > 1e-5:  # else float32 partial sums may move the boundary
                checked += 1
                assert (got.token, got.kept, got.cut) == (want.token, want.kept, want.cut)
    assert checked > 0.8 * 12 * len(PARAMS)


def test_candidate_slots() -> None:
    assert candidate_slots(256, 132) == 2
    assert candidate_slots(1000, 132) == 8
    assert candidate_slots(128_256, 132) == K_MAX


# -- arguments -----------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "match"), [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": 1e-9}, "temperature"), ({"temperature": "1"}, "temperature"),
    ({"top_k": -1}, "top_k"), ({"top_k": K_MAX + 1}, "top_k"), ({"top_k": 2.0}, "top_k"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_p": True}, "top_p"),
    ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"), ({"seed": 1.0}, "seed"),
])
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_modes() -> None:
    assert SamplingParams().greedy and not SamplingParams(top_k=5).filtered
    assert not SamplingParams(temperature=1.0).filtered
    assert SamplingParams(temperature=1.0, top_k=5).filtered
    assert SamplingParams(temperature=1.0, top_p=0.5).filtered


# -- the artifact's side: buffers, task fields, parameters ------------------------------------

@pytest.mark.parametrize("model", ["llama-tiny", "llama-tiny-odd", "llama-3.2-1b"])
def test_task_table_and_constants_wire_the_sampler(model: str) -> None:
    import tilertc
    from tilertc.backends.cuda import codegen
    from tilertc.backends.cuda.encode import FIELDS, encode_task
    from tilertc.passes.pipeline import make_program

    program = make_program(tilertc.load_spec(model), max_seq_len=256)
    consts = codegen.constants(program)
    vocab = program.spec.vocab_size
    lm = [t for t in program.tasks if program.graph.op(t.op).attrs.get("epilogue") == "argmax"]
    slots = candidate_slots(vocab, len(lm))
    assert (consts["SAMPLE_K"], consts["SAMPLE_TASKS"], consts["SAMPLE_SLOTS"]) == (
        K_MAX, len(lm), slots)
    assert consts["SAMPLE_ROW_BITS"] == row_bits(vocab) and 2 ** row_bits(vocab) >= vocab
    part = program.buffers["sample_partials"]
    assert part.numel == len(lm) * (2 + 2 * slots)
    assert max(t.rows[1] - t.rows[0] for t in lm) <= program.config["acc_floats"]
    field = {name: i for i, name in enumerate(FIELDS)}
    for t in lm:
        row = encode_task(program, t)
        assert (row[field["aux3"]], row[field["chunk"]]) == (part.offset, t.index)
    sampler = next(t for t in program.tasks if t.opcode == "argmax")
    assert encode_task(program, sampler)[field["aux"]] == part.offset


def test_sample_words_are_the_kernels_parameters() -> None:
    from tilertc.engine import PARAM_WORDS, SAMPLE_WORDS, sample_words

    words = sample_words(SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=2**64 - 1))
    as_f64 = np.array(words[:2], dtype=np.int64).view(np.float64)
    assert as_f64.tolist() == [float(np.float32(0.7)), float(np.float32(0.9))]
    assert words[2:] == [40, -1]  # the seed's 64 bits, as a signed word
    assert sample_words(SamplingParams())[0] == 0  # temperature 0: greedy
    assert (PARAM_WORDS, SAMPLE_WORDS) == (24, 4)


def test_engine_refuses_bad_sampling_arguments_before_any_work() -> None:
    from tilertc.engine import Engine

    engine = Engine.__new__(Engine)  # no GPU, no artifact: nothing may be touched
    with pytest.raises(ValueError, match="top_k"):
        engine.generate([1, 2, 3], 4, temperature=1.0, top_k=K_MAX + 1)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([1, 2, 3], 4, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        engine.step(1, temperature=-1.0)
    with pytest.raises(ValueError, match="seed"):
        engine.step(1, temperature=1.0, seed=-5)


# -- the kernel's own source, run on the host ----------------------------------------------------

HARNESS = Path(__file__).with_name("host_kernel.cpp")
# (vocab, lm_head tasks, compute warps): every row a candidate; few slots; the selection with
# one row per thread; several rows per thread and many candidates per sampler thread
HOST_CONFIGS = [(256, 132, 2), (1000, 100, 1), (3000, 40, 2), (20_000, 16, 4)]


def kernel_source() -> str:
    """What tests/host_kernel.cpp runs of the device library: the task table and parameters, the
    shared-memory struct, warp_sum and warp_max, the sampling section and the sampler's entry
    points, and the MoE router (compiled when MOE is 1)."""
    k = KernelSource()
    return "\n".join([
        *k.prelude(),
        k.between("// ---- sampling", "// ---- compute: matrix-vector tasks"),
        *(k.definition(f"__device__ void {f}")
          for f in ("cta_best", "write_best", "sample_lm_head", "publish_token")),
        k.definition("__device__ __forceinline__ void best_of_tasks"),
        k.definition("__device__ void run_argmax"),
        k.between("// ---- compute: the MoE router", "// ---- compute warps"),
    ])


def build_host_kernel(out: Path, vocab: int, tasks: int, warps: int,
                      moe: dict[str, object] | None = None) -> Path:
    """The harness for a vocabulary, lm_head task count and warp count; `moe`: the MoE
    router's constants (codegen's MOE_*), to build it with the router."""
    import shutil
    import subprocess

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    (out / "kernel_extract.inc").write_text(kernel_source())
    consts = {"COMPUTE_WARPS": warps, "MISC_FLOATS": 1024, "VOCAB": vocab, "SAMPLE_K": K_MAX,
              "SAMPLE_TASKS": tasks, "SAMPLE_SLOTS": candidate_slots(vocab, tasks),
              "SAMPLE_ROW_BITS": row_bits(vocab), "MOE": int(moe is not None), **(moe or {})}
    exe = out / "host_kernel"
    subprocess.run([cxx, "-O1", "-std=c++17", f"-I{out}", *[f"-D{k}={v}" for k, v in
                                                           consts.items()],
                    "-o", str(exe), str(HARNESS)], check=True, capture_output=True)
    return exe


def run_host_kernel(exe: Path, lines: list[str]) -> list[str]:
    import subprocess

    proc = subprocess.run([str(exe)], input="\n".join(lines) + "\n", capture_output=True,
                          text=True, check=True)
    return proc.stdout.split("\n")[:-1]


def bits(x: np.ndarray) -> str:
    return " ".join(str(int(b)) for b in np.asarray(x, dtype=np.float32).view(np.uint32))


@pytest.fixture(scope="module")
def host_kernel(tmp_path_factory) -> Path:
    return build_host_kernel(tmp_path_factory.mktemp("host_kernel"), 3000, 40, 2)


def test_kernel_rng_and_scores_are_the_models(host_kernel: Path) -> None:
    xs = np.random.default_rng(7).integers(0, 2**64, 200, dtype=np.uint64, endpoint=False)
    assert run_host_kernel(host_kernel, [f"mix {int(x)}" for x in xs]) == [
        str(int(v)) for v in mix64(xs)]
    logits = np.random.default_rng(8).normal(0, 4, 300).astype(np.float32)
    rows = np.arange(300)
    seed, pos, temp = 2**63 + 11, 4097, np.float32(0.7)
    want = gumbel_scores(logits, temp, seed, pos, rows).view(np.uint32)
    got = run_host_kernel(host_kernel, [f"score {seed} {pos} {bits([temp])} {bits([v])} {r}"
                                        for v, r in zip(logits, rows, strict=True)])
    assert [int(g) for g in got] == want.tolist()


def test_kernel_order_key_is_the_models(host_kernel: Path) -> None:
    x = np.concatenate([np.random.default_rng(9).normal(0, 100, 200),
                        [0.0, -0.0, np.inf, -np.inf]]).astype(np.float32)
    got = [line.split() for line in run_host_kernel(host_kernel,
                                                    [f"key {b}" for b in bits(x).split()])]
    assert [int(k) for k, _ in got] == order_key(x).tolist()
    assert [int(b) for _, b in got] == x.view(np.uint32).tolist()  # key_float inverts it


def test_kernel_select_top_is_the_models(host_kernel: Path) -> None:
    rng = np.random.default_rng(10)
    lines, expected = [], []
    for trial in range(60):
        n = int(rng.integers(1, 300))
        distinct = int(rng.integers(1, 5)) if trial % 2 else n
        x = rng.choice(rng.normal(0, 3, distinct).astype(np.float32), n)
        rows = rng.permutation(3000)[:n]
        want = int(rng.integers(1, n + 1))
        keys = order_key(x)
        lines.append(f"select {want} {n} " +
                     " ".join(f"{int(k)} {int(r)}" for k, r in zip(keys, rows, strict=True)))
        mask = select_top(keys, rows, want, row_bits(3000))
        expected.append("".join("1" if m else "0" for m in mask))
    assert run_host_kernel(host_kernel, lines) == expected


@pytest.mark.parametrize(("vocab", "tasks", "warps"), HOST_CONFIGS)
def test_kernel_sampler_draws_the_reference_token(tmp_path: Path, vocab: int, tasks: int,
                                                   warps: int) -> None:
    exe = build_host_kernel(tmp_path, vocab, tasks, warps)
    rng = np.random.default_rng(vocab)
    cases = []
    for trial in range(3):
        x = rng.normal(0, (0.3, 2.0, 6.0)[trial], vocab).astype(np.float32)
        if trial == 2:
            x = rng.choice(x[:50], vocab)  # ties at every boundary
        for params in PARAMS:
            cases.append((x, params, 100 + trial))
    lines = [f"sample {vocab} {tasks} {bits([p.temperature32])} {p.top_k} {bits([p.top_p32])} "
             f"{p.seed} {pos} {bits(x)}" for x, p, pos in cases]
    checked = 0
    for (x, params, pos), line in zip(cases, run_host_kernel(exe, lines), strict=True):
        token, published, cut = (int(v) for v in line.split())
        want = sample(x, params, pos)
        assert published == 1
        if want.margin > 1e-5:
            checked += 1
            assert (token, cut) == (want.token, int(want.cut)), (params, pos)
    assert checked > 0.8 * len(cases)
