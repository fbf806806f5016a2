"""Time the in-kernel token loop of built-in models on the GPU and show where a step's time goes
(development helper; `tilertc bench` is the benchmark)."""

import sys
import time
from collections import defaultdict

import torch

import tilertc
from tilertc.driver import CompileOptions, compile
from tilertc.engine import Engine


def profile_summary(eng: Engine, step: int = 1) -> None:
    prof = eng.profile[step].cpu()  # [tasks, 3]
    t0 = int(prof[:, 0][prof[:, 0] > 0].min())
    ops = defaultdict(list)
    names = [c for c in eng.m["counters"]]
    sched = eng.tasks.cpu()
    for i in range(prof.shape[0]):
        ops[names[int(sched[i, 16])]].append([int(x) - t0 for x in prof[i]])
    rows = []
    for name, st in ops.items():
        begin = min(s[1] for s in st)
        end = max(s[2] for s in st)
        run = sum(s[2] - s[1] for s in st) / len(st)
        rows.append((begin, name, end - begin, run, len(st)))
    rows.sort()
    kinds = defaultdict(float)
    prev_end = 0
    for begin, name, span, _run, _n in rows:
        kind = name.split(".")[-1] if name.startswith("layers.") else name
        kinds[kind] += span
        kinds["gap"] += max(0, begin - prev_end)
        prev_end = max(prev_end, begin + span)
    total = max(r[0] + r[2] for r in rows)
    print(
        f"  step {step}: {total / 1e3:.1f} us; per kind (sum of op spans, us): "
        + ", ".join(f"{k} {v / 1e3:.0f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
    )
    for begin, name, span, run, n in rows[:12]:
        print(f"    {name:32s} start {begin / 1e3:8.1f} span {span / 1e3:6.1f} "
              f"mean task {run / 1e3:6.1f} x{n}")


for arg in sys.argv[1:]:  # NAME or NAME:compute_warps:page_kb[:page_groups]
    name, *knobs = arg.split(":")
    knob_names = ("compute_warps", "page_kb", "page_groups")[: len(knobs)]
    opts = CompileOptions(max_seq_len=2048, **dict(zip(knob_names, map(int, knobs), strict=True)))
    out = compile(tilertc.load_spec(name), f"/tmp/qt_{arg}", opts)
    eng = Engine.load(out, random_seed=1)
    name = arg
    prompt = torch.randint(0, eng.spec.vocab_size, (1024,))
    eng.prefill(prompt[:-1])
    for n in (256,):
        eng.position = 1023
        torch.cuda.synchronize()
        t = time.perf_counter()
        list(eng.generate(prompt[-1:], max_new_tokens=n))
        dt = time.perf_counter() - t
        print(f"{name}: {n} tokens at 1k context: {dt / n * 1e3:.3f} ms/token ({n / dt:.0f} tok/s)")
    eng.enable_profile(4)
    eng.position = 1023
    list(eng.generate(prompt[-1:], max_new_tokens=4))
    profile_summary(eng, 2)
