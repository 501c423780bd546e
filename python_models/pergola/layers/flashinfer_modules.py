"""Which FlashInfer module pergola's flashinfer_fa2 / flashinfer_fa3 backends load, in one place.

The start-up probe asks whether it is built (attention.flashinfer_ready), scripts/flashinfer_aot.py
builds it ahead of time for the GPU bundle and the image, and scripts/build_image.sh checks the
image has it. This file imports only torch (and FlashInfer when called), so the image's build
stage can use it without the rest of pergola.
"""

from __future__ import annotations

from typing import Any

import torch


def prefill_spec(template: str, head_dim: int, dtype: torch.dtype) -> Any:
    """FlashInfer's JIT spec of the ragged-prefill module for `template` (fa2 or fa3): q, k, v and
    the output in `dtype`, int32 indices, no position encoding in the kernel, no window, no logits
    soft cap, no FP16 q.k reduction (ImportError when FlashInfer is not installed)."""
    from flashinfer.jit.attention import gen_batch_prefill_module

    return gen_batch_prefill_module(template, dtype, dtype, dtype, torch.int32, head_dim, head_dim,
                                    0, False, False, False)
