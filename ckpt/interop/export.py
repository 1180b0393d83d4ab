"""Handing a checkpoint to other tools.

* ``safetensors``: the model's weights, unsharded, as inference and evaluation stacks
  load them (Hugging Face's layout: ``model.safetensors``, or numbered shards plus
  ``model.safetensors.index.json`` when larger than ``max_shard_bytes``). DDP's
  ``module.`` and ``torch.compile``'s ``_orig_mod.`` prefixes are dropped; tied weights
  are written under every name they have, so a strict ``load_state_dict`` works. A
  checkpoint that carries a Hugging Face config (the HF callback saves it) also gets its
  ``config.json``: the directory is then what ``from_pretrained`` loads.
* ``dcp``: the whole state as a ``torch.distributed.checkpoint`` directory, for
  ``dcp.load`` (torchtitan, FSDP2 users); DCP stores plain values its own way.

A checkpoint of sharded DTensors (FSDP2, tensor parallel) is exported whole: each tensor
assembled from every saved shard (``restore.reshard.read_whole``). One from before the
layout record (format 1.1) is refused with the reason.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from ..errors import CheckpointError

MODEL_KEYS = ("model", "state_dict")  # ckpt.resumable and the HF callback; Lightning
PREFIXES = ("module.", "_orig_mod.")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's default
HF_CONFIG_KEY = "hf_config"  # the model's config.json as a string (integrations/huggingface.py saves it)


def model_key(values: Mapping[str, Any], key: str | None = None) -> str | None:
    """Which top-level entry holds the model's weights (None: the tensors sit at the top level)."""
    if key is not None:
        if key not in values:
            raise CheckpointError(f"the checkpoint has no {key!r}; it has {sorted(values)}")
        return key
    found = next((k for k in MODEL_KEYS if isinstance(values.get(k), Mapping)), None)
    if found is None and not any(isinstance(v, torch.Tensor) for v in values.values()):
        raise CheckpointError(f"no model weights under {' or '.join(MODEL_KEYS)}; pass --key (one of {sorted(values)})")
    return found


def model_weights(values: Mapping[str, Any], key: str | None = None) -> dict[str, torch.Tensor]:
    """The model's tensors by their state-dict names, whole, contiguous, on the CPU (``values``
    as ``reshard.read_whole`` gives them: sharded tensors assembled); without a model entry,
    every tensor of the checkpoint."""
    key = model_key(values, key)
    weights = values[key] if key is not None else values
    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, t in _tensors(weights):
        for prefix in PREFIXES:
            name = name.removeprefix(prefix)
        if name in out:
            raise CheckpointError(f"two weights named {name!r} once prefixes are dropped")
        t = t.detach().cpu().contiguous()
        if t.untyped_storage().data_ptr() in storages:
            t = t.clone()  # a tied weight: safetensors stores no shared memory
        storages.add(t.untyped_storage().data_ptr())
        out[name] = t
    if not out:
        raise CheckpointError(f"{key or 'the checkpoint'!r} holds no tensors")
    return out


def _tensors(node: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(node, torch.Tensor):
        yield prefix, node
    elif isinstance(node, Mapping):
        for k, v in node.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))


def write_safetensors(weights: Mapping[str, torch.Tensor], out: Path, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                      metadata: Mapping[str, str] | None = None) -> list[Path]:
    """One file, or shards of at most ``max_shard_bytes`` (a bigger tensor alone) and an index."""
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in weights.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    meta = {"format": "pt", **(metadata or {})}
    if len(shards) == 1:
        path = out / "model.safetensors"
        _save_file(shards[0], path, meta)
        return [path]
    paths = [out / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for shard, path in zip(shards, paths):
        _save_file(shard, path, meta)
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())},
             "weight_map": {name: p.name for shard, p in zip(shards, paths) for name in shard}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    return [*paths, out / "model.safetensors.index.json"]


def _save_file(tensors: dict[str, torch.Tensor], path: Path, meta: dict[str, str]) -> None:
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=meta)
    except KeyError as e:  # a dtype safetensors has no name for (complex128)
        names = [n for n, t in tensors.items() if t.dtype == e.args[0]] if e.args else []
        raise CheckpointError(f"safetensors has no {e.args[0] if e.args else 'such'} type, for {', '.join(names[:5])}; "
                              "export --format dcp keeps every dtype") from None


def write_hf_config(values: Mapping[str, Any], out: Path) -> Path | None:
    """``config.json`` from the checkpoint's Hugging Face config, when it carries one."""
    raw = values.get(HF_CONFIG_KEY)
    if raw is None:
        return None
    try:
        config = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        config = None
    if not isinstance(config, dict):
        raise CheckpointError(f"the checkpoint's {HF_CONFIG_KEY!r} is not a JSON object")
    path = out / "config.json"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


def write_dcp(values: Mapping[str, Any], out: Path) -> None:
    """The whole state as a torch.distributed.checkpoint directory, written by this process
    alone (``no_dist``: inside a distributed job too, no other rank takes part)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(dict(values), checkpoint_id=str(out), no_dist=True)


# What an export writes (either format), and so what a later one with --force replaces.
_EXPORT_FILE = re.compile(r"model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json"
                          r"|[^/]*\.distcp|\.metadata")


def write_replacing(out: Path, write: Callable[[Path], list[Path]]) -> list[Path]:
    """Run ``write`` into a fresh directory inside ``out``, then move what it wrote into
    ``out`` and remove an earlier export's other files (left behind, an old
    ``model.safetensors`` beside new shards is what transformers loads). A failure midway
    (a full disk) leaves ``out`` as it was: one CheckpointError, no partial file."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        out.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".export-", dir=out))
    except OSError as e:
        raise CheckpointError(f"cannot export into {out}: {e}") from None
    try:
        written = write(staging)
        for p in written:
            os.replace(p, out / p.name)
        new = {p.name for p in written}
        for old in out.iterdir():
            if old.name not in new and _EXPORT_FILE.fullmatch(old.name) and not old.is_dir():
                old.unlink()
        return [out / name for name in sorted(new)]
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # OSError, safetensors' and DCP's own errors
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise CheckpointError(f"cannot write the export into {out}: {first}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
