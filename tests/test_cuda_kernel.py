"""The persistent kernel against the interpreter, on a GPU.

Teacher-forced: after a prefill, both the kernel and the interpreter (float32, same bf16
weights) are fed the same tokens step by step and their logits compared. Greedy tokens must
agree wherever the reference's top-2 margin is clearly above bf16 noise, and the in-kernel
token loop must produce the same tokens as repeated single steps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tilertc
from tilertc.driver import CompileOptions, compile
from tilertc.engine import Engine
from tilertc.ir.interpreter import Interpreter

pytestmark = pytest.mark.gpu

MODELS = ["llama-tiny", "qwen3-tiny", "llama-tiny-odd", "llama-3.2-1b", "qwen3-0.6b"]
PREFILL, STEPS = 100, 64


@pytest.fixture(scope="module", params=MODELS)
def engine(request, tmp_path_factory) -> Engine:
    spec = tilertc.load_spec(request.param)
    out = compile(spec, tmp_path_factory.mktemp(request.param), CompileOptions(max_seq_len=512))
    return Engine.load(out, random_seed=1234)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_teacher_forced_logits_match_interpreter(engine: Engine) -> None:
    gen = torch.Generator().manual_seed(7)
    vocab = engine.spec.vocab_size
    prompt = torch.randint(0, vocab, (PREFILL,), generator=gen)
    feed = torch.randint(0, vocab, (STEPS,), generator=gen)
    engine.position = 0
    engine.prefill(prompt)
    ref = Interpreter(engine.graph, engine.weights, engine.device)
    ref.run(prompt, torch.arange(PREFILL))
    errs, agree, checked = [], 0, 0
    for i, tok in enumerate(feed.tolist()):
        got_tok, got = engine.step(tok)
        want = ref.run(torch.tensor([tok]), torch.tensor([PREFILL + i]))["logits"][0]
        errs.append(rel_err(got, want))
        top2 = want.topk(2).values
        if float(top2[0] - top2[1]) > 2e-2 * float(want.abs().max()):
            checked += 1
            agree += int(got_tok == int(want.argmax()))
            assert got_tok == int(want.argmax()), f"step {i}: greedy token differs"
        assert got_tok == int(got.argmax()), "the kernel's token is not the argmax of its logits"
    assert max(errs) <= 2e-2, f"max relative error {max(errs):.3g} (median {np.median(errs):.3g})"
    assert checked >= STEPS // 4, "too few steps with a clear top-2 margin to check greedy tokens"


def test_token_loop_equals_single_steps(engine: Engine) -> None:
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, engine.spec.vocab_size, (PREFILL,), generator=gen)
    engine.position = 0
    looped = list(engine.generate(prompt, max_new_tokens=32))
    engine.position = 0
    engine.prefill(prompt[:-1])
    tok, stepped = int(prompt[-1]), []
    for _ in range(32):
        tok, _ = engine.step(tok)
        stepped.append(tok)
    assert looped == stepped


def test_eos_stops_the_loop(engine: Engine) -> None:
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, engine.spec.vocab_size, (16,), generator=gen)
    engine.position = 0
    free = list(engine.generate(prompt, max_new_tokens=8))
    engine.position = 0
    stopped = list(engine.generate(prompt, max_new_tokens=8, eos_token_id=free[2]))
    assert stopped == free[:free.index(free[2]) + 1]


def test_watchdog_turns_a_stall_into_an_error(tmp_path) -> None:
    from tilertc.backends.cuda.encode import FIELDS

    out = compile(tilertc.load_spec("llama-tiny"), tmp_path, CompileOptions(max_seq_len=256))
    eng = Engine.load(out, random_seed=0, watchdog_s=0.5)
    waits = eng.tasks[:, FIELDS.index("wait0")]
    victim = int(torch.nonzero(waits >= 0)[0])
    eng.tasks[victim, FIELDS.index("wait0_n")] = 1000  # a wait no step can ever satisfy
    with pytest.raises(RuntimeError, match="watchdog"):
        eng.step(1)
