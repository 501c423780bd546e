"""Short texts tokenized in the gateway itself: a query skips one Triton hop.

Through the embed ensemble a text travels gateway -> NAME_tokenizer (a Python stub) -> NAME_encoder.
For a query that hop is most of what separates a text from pre-tokenized ids
(perf/results/2026-12-04-43e5651/NOTES.md), while tokenizing the text takes microseconds. Under
bulk text traffic the tokenizer instances are busy too, and a query waits there.

When the gateway can read the repository its Triton server loads (`pergola serve` passes it as
--triton-repository), an embed, rerank or classify request of at most --gateway-tokenize-chars
characters (a rerank request's query and documents together) is tokenized here with the same
code (pergola.text.tokenization.TextTokenizer, pergola.text.rerank.RerankTokenizer,
pergola.text.classify.ClassifyTokenizer), the same files (the served version's hf/ folder) and the
same settings (the encoder's config.pbtxt parameters) as NAME_tokenizer, and its ids go to that
version of NAME_encoder. Larger requests still go through the tokenizer instances in chunks,
spread over the replicas.

A request of at most INLINE_CHARS characters is tokenized on the event loop; a larger one in a
small thread pool. Hugging Face tokenizers' `encode_batch` releases the GIL, so a long text
tokenizing on a thread leaves the loop serving others (`encode` holds it) and several requests
tokenize at once; the hand-off costs as much as tokenizing a short text, so short requests stay
on the loop (perf/results/2026-12-05-eb9bb0f-cpu/NOTES.md). A tokenizer is loaded in a worker
thread the first time its (model, version) is asked for; until then, and after a failed load,
requests take the ensemble's path.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from tokenizers import Tokenizer as HFTokenizer

from pergola.config.engine import EngineConfig
from pergola.config.hf_folder import load_model_spec
from pergola.gateway.catalog import ServedModel
from pergola.text.classify import ClassifyTokenizer
from pergola.text.rerank import RerankTokenizer
from pergola.text.tokenization import TextTokenizer

log = logging.getLogger("pergola.gateway")
Key = tuple[str, str]  # (the model behind a served name, its encoder's version)
Tokenizer = TextTokenizer | RerankTokenizer | ClassifyTokenizer
TASKS = ("embed", "rerank", "classify")
INLINE_CHARS = 1_024  # at most this many characters are tokenized on the event loop (module docstring)
E = TypeVar("E")  # what a tokenizer's encode() returns


class LocalTokenizers:
    """The served models' tokenizers, for requests of at most `max_chars` characters."""

    def __init__(self, repository: str | None, max_chars: int, threads: int | None = None) -> None:
        self.repository = Path(repository).expanduser() if repository else None
        self.max_chars = max_chars
        self._ready: dict[Key, Tokenizer | None] = {}  # None: could not be loaded, or a stale version
        self._loading: dict[Key, asyncio.Task] = {}
        self._threads = ThreadPoolExecutor(max_workers=threads or min(4, os.cpu_count() or 1),
                                           thread_name_prefix="pergola-tokenize")

    async def run(self, chars: int, encode: Callable[[], E]) -> E:
        """encode() of a request of `chars` characters: on the event loop when it is short, else
        on a tokenizing thread (the loop serves other requests meanwhile)."""
        if chars <= INLINE_CHARS:
            return encode()
        return await asyncio.get_running_loop().run_in_executor(self._threads, encode)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    def for_request(self, model: ServedModel, texts: list[str]) -> Tokenizer | None:
        """The tokenizer for `texts` of `model` (a rerank request's query and documents) when they
        are short enough and it is loaded; else None (the ensemble's path). Starts loading it on
        first use."""
        if (self.repository is None or model.version is None or model.task not in TASKS
                or sum(map(len, texts)) > self.max_chars):
            return None
        key = (model.target, model.version)
        if key in self._ready:
            return self._ready[key]
        if key not in self._loading:
            task = asyncio.get_running_loop().create_task(asyncio.to_thread(self._load, model))
            self._loading[key] = task
            task.add_done_callback(lambda t: self._loaded(key, t))
        return None

    def stale(self, model: ServedModel) -> None:
        """`model`'s version is no longer served: its requests take the ensemble until the
        catalog names the new version."""
        self._ready[(model.target, model.version or "")] = None

    def folder(self, model: ServedModel) -> Path | None:
        """The files of `model`'s served version (its encoder's hf/ folder) when this gateway
        reads the repository and they are not known to be gone; else None."""
        key = (model.target, model.version or "")
        if self.repository is None or model.version is None or key in self._ready and self._ready[key] is None:
            return None
        return files(self.repository, model)

    def _load(self, model: ServedModel) -> Tokenizer:
        return load(model, files(self.repository, model))  # type: ignore[arg-type]

    def _loaded(self, key: Key, task: asyncio.Task) -> None:
        del self._loading[key]
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            log.warning("cannot tokenize %s (version %s) in the gateway, its texts go through Triton's "
                        "tokenizer: %s", key[0], key[1], error)
        self._ready.setdefault(key, None if error is not None else task.result())  # (unless stale by now)


def files(repository: Path, model: ServedModel) -> Path:
    """The tokenizer files of `model`'s served version: its encoder's hf/ folder."""
    return repository / f"{model.target}_encoder" / str(model.version) / "hf"


def load(model: ServedModel, folder: Path) -> Tokenizer:
    """`model`'s tokenizer from its encoder's files, built as its NAME_tokenizer builds it."""
    cfg = EngineConfig(**{**model.settings, "model_dir": str(folder)})
    if model.task == "rerank":  # as rerank_tokenizer/model.py builds it
        return RerankTokenizer(cfg.spec(), config=cfg)
    if model.task == "classify":  # as classify_tokenizer/model.py
        return ClassifyTokenizer(cfg.spec(), cfg.text_limits())
    return TextTokenizer(cfg.spec(), model.text_limits())  # as tokenizer/model.py


_LOADED: dict[str, Tokenizer] = {}  # a CPU worker's tokenizers by folder (gateway/offload.py), oldest first
_RAW: dict[str, HFTokenizer] = {}  # ... and its plain Hugging Face tokenizers (vLLM's /tokenize, /decode)
MAX_LOADED = 8


def loaded(model: ServedModel, folder: str) -> Tokenizer:
    """`model`'s tokenizer from `folder`, loaded once per process (in a CPU worker: /tokenize)."""
    if folder not in _LOADED:
        if len(_LOADED) >= MAX_LOADED:
            del _LOADED[next(iter(_LOADED))]
        _LOADED[folder] = load(model, Path(folder))
    return _LOADED[folder]


def raw(folder: str) -> HFTokenizer:
    """The plain Hugging Face tokenizer of the model files in `folder`, loaded once per process (in
    a CPU worker: vLLM's /tokenize form, /decode): no prompt, no pergola limits."""
    if folder not in _RAW:
        if len(_RAW) >= MAX_LOADED:
            del _RAW[next(iter(_RAW))]
        tokenizer = HFTokenizer.from_file(str(load_model_spec(folder).tokenizer_file))
        tokenizer.no_padding()  # (a tokenizer.json may pad or cut: as tokenization.TextTokenizer, neither)
        tokenizer.no_truncation()
        _RAW[folder] = tokenizer
    return _RAW[folder]
