"""Run a few decode steps of a compiled model under compute-sanitizer:

    compute-sanitizer --tool memcheck --report-api-errors no \
        python tools/sanitize_decode.py llama-tiny
    compute-sanitizer --tool racecheck python tools/sanitize_decode.py llama-tiny [KNOB=N ...]

(`--report-api-errors no`: cuda-bindings looks up every driver entry point at start-up, and
memcheck counts each one this driver lacks as an API error; those are not the kernel's.)
KNOB=N compiles with a schedule knob (`CompileOptions` tuning: compute_warps, page_kb,
page_groups), e.g. `page_kb=9`: 9 KB pages, which every row of llama-tiny-odd divides;
config.KEY=VALUE overrides a config key (JSON value, as `tilertc compile --set`), e.g.
`deepseek-v3-tiny config.first_k_dense_replace=3`: MLA with a dense FFN in every layer
(`deepseek-v3-tiny` as built in: MLA with DeepSeek's MoE after a dense first layer).

Compiles MODEL (small KV capacity), loads random weights, prefills, then runs single steps,
a greedy token loop and a sampled token loop, so that every opcode and the in-kernel loop run
under the tool. The watchdog is generous because the tools slow the kernel by orders of
magnitude. Exits non-zero on any error the runtime sees; the tool reports its own findings.
"""

from __future__ import annotations

import json
import sys
import tempfile

import torch

import tilertc
from tilertc.driver import CompileOptions, compile
from tilertc.engine import Engine


def main(model: str, knobs: list[str]) -> None:
    pairs = [knob.split("=", 1) for knob in knobs]
    config = {k.removeprefix("config."): json.loads(v) for k, v in pairs if k.startswith("config.")}
    spec = tilertc.load_spec(model, overrides=config or None)
    tuning = {k: int(v) for k, v in pairs if not k.startswith("config.")}
    with tempfile.TemporaryDirectory() as tmp:
        art = compile(spec, tmp, CompileOptions(max_seq_len=128, lineinfo=True, **tuning))
        engine = Engine.load(art, random_seed=5, watchdog_s=600.0)
        gen = torch.Generator().manual_seed(3)
        prompt = torch.randint(0, spec.vocab_size, (20,), generator=gen)
        engine.prefill(prompt)
        for tok in prompt[:3].tolist():
            engine.step(tok)
        greedy = list(engine.generate(prompt, max_new_tokens=4))
        sampled = list(engine.generate(prompt, max_new_tokens=4, temperature=0.8, top_k=20,
                                       top_p=0.9, seed=11))
        torch.cuda.synchronize()
        print(f"{model}: greedy {greedy} sampled {sampled}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "llama-tiny", sys.argv[2:])
