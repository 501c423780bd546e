"""A hard SM split for mixed traffic: queries' steps on a few SMs of their own, bulk steps on the rest.

Why: a query's step beside a bulk step (`query_stream`) waits for SMs, because the bulk kernels hold
every SM until they end (14.8 ms p50 per query under 100 x 512 tokens in process, perf/RESULTS.md
"Mixed traffic"). `query_sm_margin` narrows the bulk matmuls only (PyTorch's SM carveout); the bulk
step's attention and elementwise kernels still take every SM. A CUDA green context is a partition
that every kernel honours: work launched into its streams runs on its SMs only. Splitting the GPU
costs the bulk work those SMs all the time (a static split), so this is an experiment to measure
the query's latency on a few SMs and what the bulk loses, not a default (`query_green_sms`).

Uses NVIDIA's cuda-bindings (the driver's green-context calls), which PyTorch's CUDA 13 wheels do
not require; the error says so when it is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SmSplit:
    """Two streams in green contexts of one device: `query` (highest priority) and `bulk`."""

    query: torch.cuda.Stream
    bulk: torch.cuda.Stream
    query_sms: int  # as granted: the driver rounds a request up to its granularity (8 on Hopper)
    bulk_sms: int  # what is left (SMs of incomplete clusters may be left out)
    total_sms: int  # the device's
    contexts: tuple  # the CUgreenCtx handles, kept for the life of the process

    def carveout(self, query: bool) -> int:
        """SMs outside the queries' (or the bulk's) context: what its kernels' grids leave out."""
        return self.total_sms - (self.query_sms if query else self.bulk_sms)


def split_sms(device: torch.device, query_sms: int) -> SmSplit:
    """Split `device` into a green context of at least `query_sms` SMs and one of the rest."""
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise RuntimeError("query_green_sms needs NVIDIA's cuda-bindings package for the driver's green "
                           "contexts (pip install cuda-bindings, matching the CUDA driver); or set it to 0") from e

    def check(what: str, result: tuple):
        err, *values = result
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"query_green_sms: {what} failed ({driver.cuGetErrorName(err)[1]!r}); green "
                               "contexts need CUDA 12.4+ and a Volta or newer GPU; or set query_green_sms to 0")
        return values[0] if len(values) == 1 else values

    torch.zeros(1, device=device)  # the primary context first: green contexts are carved from it
    dev = check("cuDeviceGet", driver.cuDeviceGet(device.index or 0))
    whole = check("cuDeviceGetDevResource",
                  driver.cuDeviceGetDevResource(dev, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    if query_sms >= whole.sm.smCount:
        raise ValueError(f"query_green_sms is {query_sms} but this GPU has {whole.sm.smCount} SMs; leave the bulk "
                         "work most of them")
    groups, _, rest = check("cuDevSmResourceSplitByCount", driver.cuDevSmResourceSplitByCount(1, whole, 0, query_sms))
    _, highest = torch.cuda.Stream.priority_range()  # (lowest, highest): lower numbers win
    streams, contexts = [], []
    for resource, priority in ((groups[0], highest), (rest, 0)):
        desc = check("cuDevResourceGenerateDesc", driver.cuDevResourceGenerateDesc([resource], 1))
        ctx = check("cuGreenCtxCreate", driver.cuGreenCtxCreate(
            desc, dev, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
        stream = check("cuGreenCtxStreamCreate", driver.cuGreenCtxStreamCreate(
            ctx, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, priority))
        streams.append(torch.cuda.get_stream_from_external(int(stream), device))
        contexts.append(ctx)
    return SmSplit(streams[0], streams[1], int(groups[0].sm.smCount), int(rest.sm.smCount), int(whole.sm.smCount),
                   tuple(contexts))
