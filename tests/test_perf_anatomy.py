"""perf/anatomy.py's trace arithmetic (CPU): busy time is a union of intervals, and the gaps inside
steps are cut at each step's device-to-host copy."""

from __future__ import annotations

from anatomy import kind_of, step_gaps_us, union_us


def kernel(ts: float, dur: float, name: str = "k") -> dict:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}


def d2h(ts: float, dur: float = 1.0) -> dict:
    return {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": ts, "dur": dur}


def test_union_counts_overlaps_once():
    assert union_us([(0, 10), (5, 12), (20, 25)]) == 17
    assert union_us([(3, 4), (0, 10)]) == 10
    assert union_us([]) == 0


def test_gaps_are_counted_inside_steps_not_between_them():
    # step 1: kernels 0-10, 12-20 (gap 2), copy 21-22 (gap 1); 100 µs of host time; step 2: 122-130, 135-140 (gap 5), copy 140-141
    events = [kernel(0, 10), kernel(12, 8), d2h(21), kernel(122, 8), kernel(135, 5), d2h(140)]
    assert step_gaps_us(events) == 3 + 5


def test_kernel_kinds():
    assert kind_of("void flashinfer::BatchPrefillWithRaggedKVCacheKernel<...>") == "attention"
    assert kind_of("cutlass::device_kernel<flashinfer::FlashAttnFwdSm90<...>>") == "attention"
    assert kind_of("nvjet_sm90_tst_96x64_64x10_1x2_h_bz_TNN") == "matmul"
    assert kind_of("_linear_tma_kernel") == "matmul"  # the persistent TMA matmul (gate_up + SiLU)
    assert kind_of("_rms_norm_kernel") == "norm"
    assert kind_of("_qk_norm_rope_kernel") == "rope"  # the fused q/k-norm + RoPE kernel
