"""`pergola build-repo`: a Triton model repository from Hugging Face model folders.

For a model NAME it writes
    NAME_tokenizer/  config.pbtxt, 1/model.py, 1/hf -> the model folder
    NAME_encoder/    config.pbtxt, 1/model.py, 1/hf -> the model folder
    NAME/            the ensemble (TEXT -> EMBEDDING)
and, for the first embedding model, the ensemble again as `embed` (the first reranker: `rerank`,
QUERY + DOCUMENTS -> SCORE; the first classifier: `classify`, TEXT -> PROBS and LABELS). Configs come from the templates
in ensemble_configs/, adapters from python_models/.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field, fields
from pathlib import Path
from string import Template

from pergola.config.engine import EngineConfig, TritonModelOptions
from pergola.config.hf_folder import load_model_spec
from pergola.outputs.heads import LABELS_PARAMETER, MAX_INPUT_PARAMETER, PROMPTS_PARAMETER, label_names
from pergola.outputs.token_outputs import TOKEN_OUTPUT_TYPES
from pergola.text.rerank import pair_max_length

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # python_models/pergola
PROJECT_ROOT = PACKAGE_DIR.parents[1]
TEMPLATES = PROJECT_ROOT / "ensemble_configs"
ADAPTERS = PROJECT_ROOT / "python_models"
GENERIC_FOLDER_NAMES = {"model", "hf", "weights", "snapshot"}


@dataclass
class ModelEntry:
    name: str
    config: EngineConfig
    triton: TritonModelOptions = field(default_factory=TritonModelOptions)


def model_name_for(folder: str | Path) -> str:
    """A Triton-safe model name from a folder path (`.../all-MiniLM-L6-v2` -> `all-MiniLM-L6-v2`)."""
    path = Path(folder).expanduser().resolve()
    base = path.name if path.name.lower() not in GENERIC_FOLDER_NAMES else path.parent.name
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", base).strip("_.") or "model"


def _quoted(value: str) -> str:
    """A protobuf text-format string literal's body (label names may hold quotes)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _parameters_block(params: dict[str, str]) -> str:
    items = [
        f'parameters {{ key: "{k}" value: {{ string_value: "{_quoted(v)}" }} }}' for k, v in sorted(params.items())
    ]
    return "\n".join(items)


def token_output_blocks(heads: bool) -> dict[str, str]:
    """The embed ensemble's `token_outputs` (output list) and `token_output_map` (encoder step):
    bge-m3's ragged outputs (pergola.outputs.token_outputs), declared and mapped only for a model with the heads."""
    if not heads:
        return {"token_outputs": "", "token_output_map": ""}
    declared = "".join(f',\n  {{ name: "{n}" data_type: TYPE_{t} dims: [ {d} ] }}'
                       for n, (t, d) in TOKEN_OUTPUT_TYPES.items())
    mapped = "".join(f'\n      output_map {{ key: "{n}" value: "{n}" }}' for n in TOKEN_OUTPUT_TYPES)
    return {"token_outputs": declared, "token_output_map": mapped}


def _render(template: str, **values: object) -> str:
    return Template((TEMPLATES / template).read_text()).substitute({k: str(v) for k, v in values.items()})


def _link(link: Path, target: Path) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target, target_is_directory=True)


def _write_version(model_dir: Path, adapter: str, hf_folder: Path, version: int = 1) -> None:
    """NAME/<version>/: the adapter, `hf` -> the model folder, `pergola` -> this engine package.

    The Python stub runs its interpreter isolated (PYTHONPATH is ignored) but puts the version
    folder on sys.path, so the link makes the engine importable whatever venv runs the stub.
    """
    vdir = model_dir / str(version)
    vdir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ADAPTERS / adapter / "model.py", vdir / "model.py")
    _link(vdir / "hf", hf_folder)
    _link(vdir / "pergola", PACKAGE_DIR)


# task -> (tokenizer template, tokenizer adapter, encoder template, ensemble template, alias)
TASKS = {
    "embed": ("tokenizer.pbtxt", "tokenizer", "encoder.pbtxt", "embed_ensemble.pbtxt", "embed"),
    "rerank": ("rerank_tokenizer.pbtxt", "rerank_tokenizer", "rerank_encoder.pbtxt", "rerank_ensemble.pbtxt", "rerank"),
    "classify": ("classify_tokenizer.pbtxt", "classify_tokenizer", "classify_encoder.pbtxt", "classify_ensemble.pbtxt",
                 "classify"),
}


def instance_group(gpu: bool, gpus: list[int] | None = None) -> str:
    """The encoder's instance_group body: one instance on the CPU, or one per GPU: every GPU
    Triton sees (no `gpus` list), or those listed. Each instance's stub takes its own device
    (pergola.triton.adapter.instance_device: `model_instance_device_id`)."""
    if not gpu:
        if gpus:
            raise ValueError("a GPU list needs encoder instances on the GPU (--device gpu)")
        return "kind: KIND_CPU count: 1"
    if gpus is not None and (not gpus or len(set(gpus)) != len(gpus) or min(gpus) < 0):
        raise ValueError(f"GPUs must be distinct device numbers (0, 1, ...), got {gpus}")
    listed = f" gpus: [ {', '.join(str(g) for g in gpus)} ]" if gpus else ""
    return f"kind: KIND_GPU count: 1{listed}"


def write_model(repo: Path, entry: ModelEntry, group: str) -> str:
    """Write NAME_tokenizer, NAME_encoder and the ensemble NAME; returns the model's task."""
    cfg = entry.config
    spec = cfg.spec()  # fails here, with a clear message, rather than at server start
    if spec.task == "rerank" and spec.num_labels != 1:
        raise ValueError(f"{spec.path}: a reranker must have one label (SCORE [n]); it has {spec.num_labels}")
    tok_template, tok_adapter, enc_template, ens_template, _ = TASKS[spec.task]
    params = {k: v for k, v in cfg.to_parameters().items() if k != "model_dir"}
    params.pop("device", None)  # the instance kind decides the device
    if spec.task == "classify":  # the column names of PROBS, for clients that read the config (TEI's /info)
        params[LABELS_PARAMETER] = json.dumps(label_names(spec))
    # the longest input in tokens, for clients that read the config (TEI's /info, max_tokens checks)
    params[MAX_INPUT_PARAMETER] = str(pair_max_length(spec) if spec.task == "rerank" else spec.max_seq_length)
    if spec.task == "embed":  # (Cohere's input_type asks for a query or document prompt only where there is one)
        params[PROMPTS_PARAMETER] = json.dumps(sorted(spec.prompts))
    block = _parameters_block(params)
    name = entry.name
    for part, template, adapter in (("tokenizer", tok_template, tok_adapter), ("encoder", enc_template, "encoder")):
        mdir = repo / f"{name}_{part}"
        mdir.mkdir(parents=True, exist_ok=True)
        triton = entry.triton
        (mdir / "config.pbtxt").write_text(_render(
            template, name=name, parameters=block, instance_group=group,
            tokenizer_instances=triton.tokenizer_instances, max_batch_requests=triton.max_batch_requests,
            max_queue_size=triton.max_queue_size, queue_timeout_us=triton.queue_timeout_ms * 1000,
            queue_timeout_override=str(triton.queue_policy).lower(),
        ))
        _write_version(mdir, adapter, spec.path)
    write_ensemble(repo, name, name, ens_template, bool(spec.token_heads))
    return spec.task


def add_version(repo: str | Path, name: str, folder: str | Path) -> int:
    """Add version N+1 of model NAME (tokenizer and encoder) serving `folder`; returns N+1.

    The adapter is the latest version's; settings (config.pbtxt parameters) stay. With the
    default version policy (latest 1), loading NAME_encoder then NAME_tokenizer through the
    repository API swaps the served version; Triton unloads the old one once the new is ready.
    """
    repo = Path(repo).expanduser().resolve()
    hf = Path(folder).expanduser().resolve()
    load_model_spec(hf)  # a broken folder fails here, not in the server
    versions = []
    for part in ("tokenizer", "encoder"):
        mdir = repo / f"{name}_{part}"
        existing = sorted(int(p.name) for p in mdir.glob("[0-9]*") if p.name.isdigit())
        if not existing:
            raise ValueError(f"{mdir} has no version to start from; build the repository first")
        latest, new = mdir / str(existing[-1]), mdir / str(existing[-1] + 1)
        new.mkdir()
        shutil.copyfile(latest / "model.py", new / "model.py")
        _link(new / "hf", hf)
        _link(new / "pergola", PACKAGE_DIR)
        versions.append(existing[-1] + 1)
    return max(versions)


def write_ensemble(repo: Path, ensemble: str, name: str, template: str, token_heads: bool = False) -> None:
    """The ensemble `ensemble` of model `name`; `token_heads`: with bge-m3's outputs (embed)."""
    edir = repo / ensemble
    (edir / "1").mkdir(parents=True, exist_ok=True)
    (edir / "config.pbtxt").write_text(_render(template, ensemble=ensemble, name=name,
                                               **token_output_blocks(token_heads)))


def build_repository(repo: str | Path, entries: list[ModelEntry], gpu: bool, clean: bool = True,
                     gpus: list[int] | None = None) -> Path:
    """Write the repository for `entries`; the first embedding model is also served as `embed`,
    the first reranker as `rerank`, the first classifier as `classify`. Encoders run on the CPU,
    or one instance on each GPU (`gpus`: those listed; None: every GPU Triton sees)."""
    repo = Path(repo).expanduser().resolve()
    if not entries:
        raise ValueError("no models to build")
    names = [e.name for e in entries]
    aliases = {alias for *_, alias in TASKS.values()}
    if len(set(names)) != len(names) or aliases & set(names):
        raise ValueError(f"model names must be unique and not {sorted(aliases)}: {names}")
    group = instance_group(gpu, gpus)  # before anything is removed: a bad list changes nothing
    if clean and repo.exists():
        shutil.rmtree(repo)
    repo.mkdir(parents=True, exist_ok=True)
    aliased: set[str] = set()
    for entry in entries:
        task = write_model(repo, entry, group)
        *_, ens_template, alias = TASKS[task]
        if alias not in aliased:
            write_ensemble(repo, alias, entry.name, ens_template, bool(entry.config.spec().token_heads))
            aliased.add(alias)
    return repo


def entry_from_folder(folder: str | Path, name: str | None = None, **settings: object) -> ModelEntry:
    """A model of the repository; `settings` are EngineConfig or TritonModelOptions fields."""
    load_model_spec(folder)  # validate early
    triton_names = {f.name for f in fields(TritonModelOptions)}
    unknown = set(settings) - triton_names - {f.name for f in fields(EngineConfig)}
    if unknown:
        raise TypeError(f"unknown settings {sorted(unknown)}")
    cfg = EngineConfig(model_dir=str(Path(folder).expanduser().resolve()),
                       **{k: v for k, v in settings.items() if k not in triton_names})
    triton = TritonModelOptions(**{k: v for k, v in settings.items() if k in triton_names})
    return ModelEntry(name=name or model_name_for(folder), config=cfg, triton=triton)
