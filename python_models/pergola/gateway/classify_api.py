"""Sequence classification: vLLM's `POST /classify` (TEI's `POST /predict` is in tei_api.py).

    {"model": "classify", "input": "..." or ["...", ...], "truncate": "END"}
 -> {"id", "object": "list", "created", "model", "data": [{"index", "label", "probs", "num_classes"}],
     "usage": {"prompt_tokens", "total_tokens"}}

`probs` are the model's probabilities over its labels (softmax, or a sigmoid per label for a
multi-label model; `raw_scores: true`, pergola's extra, answers the logits), in the order of the
config's id2label; `label` is the most probable one. `truncate` (NONE, START, END or a boolean)
is pergola's extra, as on /v1/embeddings.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
from starlette.requests import Request

from pergola.gateway.backend import ClassifyRequest, TooLong
from pergola.gateway.openai_api import too_long, truncate_option
from pergola.gateway.state import Gateway
from pergola.gateway.tei_api import text_inputs


async def classify(gw: Gateway, request: Request) -> dict[str, Any]:
    body, model, texts = await text_inputs(gw, request, "classify", "input")
    opts = ClassifyRequest(truncate=truncate_option(body), raw_scores=body.get("raw_scores", bool, False))
    try:
        out = await gw.backend.classify(model, texts, opts=opts)
    except TooLong as e:
        raise too_long(e, "input", 'send "truncate": "END" (or "START") to cut it') from None
    best = np.argmax(out.probs, axis=1)
    tokens = int(out.tokens.sum())
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model.name,
            "data": [{"index": i, "label": out.labels[int(best[i])], "probs": row.tolist(),
                      "num_classes": len(out.labels)} for i, row in enumerate(out.probs)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
