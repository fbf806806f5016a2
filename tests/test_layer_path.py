"""tools/layer_path.py: a layer's ops in the order they run, from stamps made up with known
times, the layers folded into their mean and ops outside the layers left out, and an op's tail
split into what its tasks' sizes explain and the rest."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from tilertc.profile import StepProfile

sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
from layer_path import layer_ends, layer_path  # noqa: E402


def test_the_path_from_known_stamps() -> None:
    """Two layers of `qkv` (two tasks) then `attention` (one task), and an `embed` task before
    them; ns (start, deps met, done). Layer 1 runs 10 µs after layer 0, and its attention's
    dependencies are met 2 µs later in the layer than layer 0's. The qkv tasks have 8 and 16
    rows and take 3 µs each."""
    ops = ["embed", "layers.0.qkv", "layers.0.qkv", "layers.0.attention",
           "layers.1.qkv", "layers.1.qkv", "layers.1.attention"]
    layer0 = [[1000, 2000, 5000], [1000, 3000, 6000], [1500, 7000, 9000]]
    layer1 = [[11000 + a, 11000 + b, 11000 + c] for a, b, c in layer0]
    layer1[2][1] += 2000
    stamps = np.array([[[0, 0, 800], *layer0, *layer1]], dtype=np.uint64)
    profile = StepProfile(stamps, ops, np.zeros(len(ops), dtype=np.int64))
    path = layer_path(profile, [0], np.array([1, 8, 16, 1, 8, 16, 1]))
    assert [r.op for r in path] == ["qkv", "attention"]
    qkv, attention = path
    # layer times from the layer's first start (+1000 ns in layer 0)
    assert (qkv.first_start, qkv.first_met, qkv.median_met) == pytest.approx((0.0, 1.0, 1.5))
    assert (qkv.median_done, qkv.last_done, qkv.mean_task) == pytest.approx((4.5, 5.0, 3.0))
    assert (attention.first_start, attention.first_met) == pytest.approx((0.5, 7.0))
    assert (attention.last_done, attention.mean_task) == pytest.approx((8.0, 1.0))
    # tail: last done 0.5 µs after the median; sizes: 16 rows over the median 12, of a 3 µs task
    assert (qkv.tail, qkv.from_sizes) == pytest.approx((0.5, 1.0))
    assert (attention.tail, attention.from_sizes) == pytest.approx((0.0, 0.0))


def test_steps_are_folded_into_their_mean() -> None:
    """The same layer in two steps, its task's dependencies met 1 µs into the layer in the
    first and 3 µs in the second (the second step starting 50 µs later): the path over both
    steps has them met at 2 µs, each step's times taken from that step's layer start."""
    ops = ["layers.0.down"]
    stamps = np.array([[[1000, 2000, 4000]], [[51000, 54000, 56000]]], dtype=np.uint64)
    profile = StepProfile(stamps, ops, np.zeros(len(ops), dtype=np.int64))
    assert layer_path(profile, [0], np.ones(1))[0].first_met == pytest.approx(1.0)
    (down,) = layer_path(profile, [0, 1], np.ones(1))
    assert (down.first_start, down.first_met, down.last_done) == pytest.approx((0.0, 2.0, 4.0))
    assert down.mean_task == pytest.approx(2.0)


def test_layer_ends_are_one_sample_a_layer_and_step() -> None:
    """Two layers in two steps: each sample is its layer's last done less its first start in
    that step (layer 1 of step 1 ends 4 µs after its start, the others 3)."""
    ops = ["embed", "layers.0.qkv", "layers.0.attention", "layers.1.qkv", "layers.1.attention"]
    step0 = [[0, 0, 500], [1000, 1500, 2000], [2000, 3000, 4000],
             [5000, 5500, 6000], [6000, 7000, 8000]]
    step1 = [[a + 50000, b + 50000, c + 50000] for a, b, c in step0]
    step1[4][2] += 1000
    profile = StepProfile(np.array([step0, step1], dtype=np.uint64), ops,
                          np.zeros(len(ops), dtype=np.int64))
    assert layer_ends(profile, [0]) == pytest.approx([3.0, 3.0])
    assert layer_ends(profile, [0, 1]) == pytest.approx([3.0, 3.0, 3.0, 4.0])
