"""Hugging Face checkpoints in a training job: start from a checkpoint folder's
weights, and export the trained model as a folder transformers loads.

* :func:`load_hf_weights` fills a rank's parameters and buffers (DTensors of
  any placements on any mesh, or plain tensors) from a folder that
  ``save_pretrained`` wrote, reading only the block of each tensor the rank
  holds;
* :func:`export_hf` writes one ``model.safetensors`` and the model's config,
  which ``AutoModelForCausalLM.from_pretrained`` loads with no missing keys;
  :func:`export_plain` writes the ``model.safetensors`` of a model that is no
  Hugging Face one, under our own names;
* :func:`check_export_target` refuses an export folder that already holds
  files, before training starts: nothing is ever overwritten.

Loading runs on every rank, each reading its own blocks. Exports are
single-process: the caller's rank 0 calls them with a generator of full
tensors (``DTensor.full_tensor()``, gathered on every rank one at a time), and
at most one of them is held here.

Our names are Hugging Face's with a prefix (``hf.``: :class:`models.hf.CausalLMStep`
holds the model as ``hf``). A tied parameter is held once, under its first
name (:func:`ir.exported_graph.tied_parameters`).

Shards are read with safetensors' ``safe_open(...).get_slice(name)[block]``,
the block found from the rank's mesh coordinate, not through
``torch.distributed.checkpoint.HuggingFaceStorageReader``: ``dcp.load`` is a
collective (every rank of a process group plans together), it names neither a
missing tensor nor a shape mismatch in a line a user can act on, and it reads
a tied weight under its own name only. Reading here is per rank, needs no
process group and is the same on torch 2.11 to 2.14.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import warnings
from collections import Counter
from typing import Any, Iterable, Iterator

import torch

from training.checkpoint import CheckpointError

__all__ = ["CheckpointError", "check_export_target", "export_hf", "export_plain",
           "is_hf_folder", "load_hf_weights"]

#: The single weights file ``save_pretrained`` writes, and the one we export.
WEIGHTS_NAME = "model.safetensors"
#: The index of a sharded checkpoint: ``{"weight_map": {name: file}}``.
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
#: Bytes copied at a time when the exported weights are assembled (16 MiB).
COPY_CHUNK_BYTES = 16 << 20
#: How many names a message lists before it says "..."
LISTED_NAMES = 3

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    **{getattr(torch, name): code for name, code in (
        ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
        ("uint32", "U32"), ("uint64", "U64")) if hasattr(torch, name)},
}


def is_hf_folder(path: str) -> bool:
    """Whether ``path`` is a folder with a ``config.json`` and at least one
    ``*.safetensors`` file (one file, or shards with their index)."""
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, CONFIG_NAME)):
        return False
    return any(name.endswith(".safetensors") for name in os.listdir(path))


# ----------------------------------------------------------------------------- loading


def load_hf_weights(folder: str, state: dict[str, torch.Tensor], *, prefix: str = "hf.") -> None:
    """Fill every tensor of ``state`` in place from the safetensors of the
    checkpoint ``folder``, converting dtypes.

    Args:
        folder: a folder :func:`is_hf_folder` accepts.
        state: our name (``prefix`` + Hugging Face's) -> parameter or persistent
            buffer, allocated with the full model's shape: a DTensor (only its
            local shard is read and written) or a plain tensor on any device.
            Tied parameters once, under either name.
        prefix: what our names add to Hugging Face's.

    Raises:
        CheckpointError: no checkpoint folder, a name without ``prefix``, a
            tensor the checkpoint lacks or holds with another shape.

    Tensors of the checkpoint that ``state`` has no place for (beyond tied
    duplicates) are not read, with one warning.
    """
    if not is_hf_folder(folder):
        raise CheckpointError(f"{folder} is no Hugging Face checkpoint folder (a config.json and "
                              f"*.safetensors, as save_pretrained writes)")
    stored = _stored_files(folder)
    wanted = {fqn: _hf_name(fqn, prefix) for fqn in state}
    missing = [name for name in wanted.values() if name not in stored]
    unread = set(stored) - set(wanted.values())
    groups = _tie_groups(_hf_ties(folder)) if missing or unread else {}
    sources = {fqn: _stored_name(folder, fqn, name, stored, groups) for fqn, name in wanted.items()}
    _warn_unread(folder, unread - {n for name in wanted.values() for n in groups.get(name, ())})
    by_file: dict[str, list[tuple[str, str]]] = {}
    for fqn, name in sources.items():
        by_file.setdefault(stored[name], []).append((fqn, name))
    from safetensors import safe_open

    with torch.no_grad():
        for path, pairs in by_file.items():
            with safe_open(path, framework="pt") as f:
                for fqn, name in pairs:
                    _read_into(f.get_slice(name), state[fqn], fqn, folder)


def _hf_name(fqn: str, prefix: str) -> str:
    """Hugging Face's name of our ``fqn``."""
    if not fqn.startswith(prefix):
        raise CheckpointError(f"{fqn} is no Hugging Face model's tensor (its name lacks the "
                              f"prefix '{prefix}'); Hugging Face checkpoints load into "
                              f"--model hf:... models only")
    return fqn[len(prefix):]


def _stored_files(folder: str) -> dict[str, str]:
    """Every tensor name in the checkpoint ``folder`` -> the path of the
    safetensors file holding it (from the index where there is one, else
    from the files' headers)."""
    from safetensors import safe_open

    index = os.path.join(folder, INDEX_NAME)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map; re-save the checkpoint with "
                                  f"save_pretrained")
        paths = {name: os.path.join(folder, file) for name, file in weight_map.items()}
        lacking = sorted({p for p in paths.values() if not os.path.isfile(p)})
        if lacking:
            raise CheckpointError(f"{index} names {_listed(lacking)}, which {folder} lacks; "
                                  f"copy the whole checkpoint")
        return paths
    paths = {}
    for file in sorted(n for n in os.listdir(folder) if n.endswith(".safetensors")):
        path = os.path.join(folder, file)
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                paths.setdefault(name, path)
    return paths


def _hf_ties(spec: str) -> dict[str, str]:
    """The tied parameters of the Hugging Face model ``spec`` names (a
    checkpoint folder, a config.json or ``type,field=value``), in Hugging
    Face's names: further name -> first name; empty when transformers cannot
    build it."""
    try:
        _, model = _meta_model(spec)
    except CheckpointError:
        return {}
    from ir.exported_graph import tied_parameters

    return tied_parameters(model)


def _tie_groups(ties: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """Every tied name -> the other names of its tensor (``ties``: further name
    -> first name)."""
    members: dict[str, list[str]] = {}
    for further, first in ties.items():
        members.setdefault(first, [first]).append(further)
    return {name: tuple(n for n in group if n != name)
            for group in members.values() for name in group}


def _stored_name(folder: str, fqn: str, name: str, stored: dict[str, str],
                 groups: dict[str, tuple[str, ...]]) -> str:
    """The checkpoint's name for our ``fqn`` (Hugging Face's ``name``): itself,
    or a name tied to it that the checkpoint holds instead."""
    if name in stored:
        return name
    for other in groups.get(name, ()):
        if other in stored:
            return other
    raise CheckpointError(f"checkpoint {folder} has no {name} for the plan's {fqn}: it is a "
                          f"checkpoint of another model; plan with --model hf:{folder}")


def _warn_unread(folder: str, unread: set[str]) -> None:
    """One warning naming the checkpoint's tensors that nothing reads."""
    if unread:
        warnings.warn(f"checkpoint {folder} holds {len(unread)} tensor(s) the model has no "
                      f"place for, not read: {_listed(sorted(unread))}", stacklevel=3)


def _read_into(stored: Any, target: torch.Tensor, fqn: str, folder: str) -> None:
    """Copy into ``target`` (our ``fqn``) the part of the checkpoint's tensor
    (a safetensors slice, ``stored``) it holds on this rank."""
    from torch.distributed.tensor import DTensor

    shape = list(stored.get_shape())
    if shape != list(target.shape):
        raise CheckpointError(f"checkpoint {folder} holds {fqn} as {shape}, the plan's model has "
                              f"{list(target.shape)}: it is a checkpoint of another model; plan "
                              f"with --model hf:{folder}")
    if not isinstance(target, DTensor):
        target.copy_(stored[tuple(slice(None) for _ in shape)])
        return
    from ir.torch_compat import local_tensor

    local = local_tensor(target)
    if local.numel() == 0:
        return  # a rank outside the mesh, or an uneven shard's empty end
    block = _local_block(stored, target, shape)
    if block.shape != local.shape:
        raise CheckpointError(f"{fqn}'s local shard is {list(local.shape)} on this rank, not the "
                              f"{list(block.shape)} its placements {target.placements} give; "
                              f"build it with distribute_tensor")
    local.copy_(block)


def _local_block(stored: Any, target: Any, shape: list[int]) -> torch.Tensor:
    """The block of the stored tensor that DTensor ``target`` (full ``shape``)
    holds on this rank: read alone where every placement is ``Shard`` or
    ``Replicate``; else (a strided shard) the full tensor is read and split
    here, with no communication."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ir.torch_compat import is_strided_shard, local_shape_and_global_offset

    if all(isinstance(p, Replicate) or (isinstance(p, Shard) and not is_strided_shard(p))
           for p in target.placements):
        sizes, offsets = local_shape_and_global_offset(target)
        return stored[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
    full = stored[tuple(slice(None) for _ in shape)]
    return distribute_tensor(full, target.device_mesh, target.placements,
                             src_data_rank=None).to_local()


# ----------------------------------------------------------------------------- export


def check_export_target(folder: str) -> None:
    """Refuse an export ``folder`` that is a file or already holds files (it may
    be missing or empty): nothing is overwritten.

    Raises:
        CheckpointError: one line naming what is there.
    """
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise CheckpointError(f"export folder {folder} is a file; give a new or empty folder")
    held = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    if held:
        raise CheckpointError(f"export folder {folder} already holds {_listed(held)}; give a new "
                              f"or empty folder (nothing is overwritten)")


def export_plain(folder: str, named_full_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Write ``folder``/model.safetensors: every ``(our name, full tensor)``,
    read from the iterable one at a time (so at most one tensor is held).

    Returns:
        The paths written.

    Raises:
        CheckpointError: a folder that holds files (:func:`check_export_target`),
            a name given twice, a DTensor or a dtype safetensors has no code for.
    """
    check_export_target(folder)
    with _Staging(folder) as stage:
        _write_safetensors(stage.path(WEIGHTS_NAME), named_full_tensors)
        return stage.commit()


def export_hf(folder: str, named_full_tensors: Iterable[tuple[str, torch.Tensor]], *,
              config_source: str, prefix: str = "hf.",
              tied: dict[str, str] | None = None) -> list[str]:
    """Write ``folder`` as ``save_pretrained`` would: one model.safetensors
    under Hugging Face's names, config.json (its dtype the one most of the
    floating-point weights have) and generation_config.json where the model
    generates; ``AutoModelForCausalLM.from_pretrained(folder)`` loads it with
    no missing or unexpected keys.

    Args:
        folder: a new or empty folder (:func:`check_export_target`).
        named_full_tensors: ``(our name, full tensor)``, read one at a time
            (so at most one tensor is held); non-persistent buffers are skipped.
        config_source: the model spec after ``hf:`` (a config.json, a folder
            with one, or ``type,field=value,...``; :mod:`models.hf`).
        prefix: what our names add to Hugging Face's.
        tied: our tied parameters, further name -> first name
            (:func:`ir.exported_graph.tied_parameters`); None: those the
            Hugging Face model ties. A tie Hugging Face makes too is written
            once, under the name it keeps; one it does not make, under each name.

    Returns:
        The paths written.

    Raises:
        CheckpointError: a folder that holds files, a config that cannot be
            read, a tensor the model has no place for, one given twice, or
            one the model needs that was not given.
    """
    check_export_target(folder)
    config, model = _meta_model(config_source)
    from ir.exported_graph import tied_parameters

    hf_ties = tied_parameters(model)
    ours = {_hf_name(a, prefix): _hf_name(b, prefix) for a, b in (tied or {}).items()}
    with _Staging(folder) as stage:
        dtypes = _write_safetensors(stage.path(WEIGHTS_NAME), _hf_named(
            named_full_tensors, prefix, model, hf_ties, ours, config_source))
        _check_complete(set(model.state_dict()) - set(hf_ties), dtypes, config_source)
        _save_configs(stage, config, model, config_source, dtypes)
        return stage.commit()


def _hf_named(named: Iterable[tuple[str, torch.Tensor]], prefix: str, model: torch.nn.Module,
              hf_ties: dict[str, str], ours: dict[str, str],
              source: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` under the names Hugging Face's ``model`` saves: an alias it
    ties under the name it keeps (once), one of our ties it does not make
    under every name, non-persistent buffers left out."""
    saved = set(model.state_dict()) - set(hf_ties)
    known = {n for n, _ in model.named_parameters(remove_duplicate=False)} | {
        n for n, _ in model.named_buffers(remove_duplicate=False)}
    written: set[str] = set()
    for fqn, tensor in named:
        given = _hf_name(fqn, prefix)
        name = hf_ties.get(given, given)
        if name not in saved and given in known:
            continue  # a non-persistent buffer
        if name not in saved:
            raise CheckpointError(f"{fqn} is no tensor of the Hugging Face model hf:{source}; "
                                  f"export the model the plan was made for")
        if name in written:
            if name != given or given in ours:
                continue  # a tied name of a tensor already written
            raise CheckpointError(f"{fqn} is given twice; give each tensor once")
        written.add(name)
        yield name, tensor
        for alias in sorted(a for a, first in ours.items() if first == name and a in saved):
            if alias not in written:
                written.add(alias)
                yield alias, tensor
        del tensor  # held no longer than written: the next one may be large


def _check_complete(saved: set[str], dtypes: dict[str, torch.dtype], source: str) -> None:
    """Refuse an export that lacks a tensor Hugging Face's model loads."""
    lacking = sorted(saved - set(dtypes))
    if lacking:
        raise CheckpointError(f"the export lacks {len(lacking)} tensor(s) of hf:{source} "
                              f"({_listed(lacking)}); give every parameter and persistent buffer")


def _save_configs(stage: "_Staging", config: Any, model: torch.nn.Module, source: str,
                  dtypes: dict[str, torch.dtype]) -> None:
    """Stage config.json (architecture and dtype of what was written) and
    generation_config.json (the source's, else one from the config where the
    model generates)."""
    floating = Counter(d for d in dtypes.values() if d.is_floating_point)
    if floating:
        config.dtype = floating.most_common(1)[0][0]
    config.architectures = [type(model).__name__]
    config.save_pretrained(stage.directory)
    generation = _generation_config(source, config, model)
    if generation is not None:
        generation.save_pretrained(stage.directory)


def _generation_config(source: str, config: Any, model: torch.nn.Module) -> Any:
    """The generation config of the model ``source`` names: its folder's file
    where it has one, else one made from ``config`` where the model generates;
    None otherwise."""
    from transformers import GenerationConfig

    directory = source if os.path.isdir(source) else (
        (os.path.dirname(source) or ".") if source.endswith(".json") else None)
    if directory and os.path.isfile(os.path.join(directory, GENERATION_CONFIG_NAME)):
        return GenerationConfig.from_pretrained(directory)
    can_generate = getattr(model, "can_generate", None)
    if callable(can_generate) and can_generate():
        return GenerationConfig.from_model_config(config)
    return None


def _meta_model(spec: str) -> tuple[Any, torch.nn.Module]:
    """``(config, model)`` of the Hugging Face model ``spec`` names, the model
    on the meta device (no memory; for its names and ties)."""
    from models.hf import HFModelError, _config, _transformers

    try:
        auto_config, auto_model = _transformers()
        config = _config(spec, auto_config)
        with torch.device("meta"):
            model = auto_model.from_config(config)
    except HFModelError as err:
        raise CheckpointError(str(err)) from None
    except (ValueError, KeyError) as err:
        raise CheckpointError(f"hf:{spec} is no causal language model transformers can build "
                              f"({_first_line(err)})") from None
    return config, model


# ----------------------------------------------------------------------------- writing


class _Staging:
    """A hidden temporary folder inside the export folder: files are written
    there and renamed into the export folder by :meth:`commit`; on an error
    it is removed, with the export folder where this made it."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.created = not os.path.isdir(folder)
        self.directory = ""

    def __enter__(self) -> "_Staging":
        os.makedirs(self.folder, exist_ok=True)
        self.directory = tempfile.mkdtemp(prefix=".export-", suffix=".partial", dir=self.folder)
        return self

    def path(self, name: str) -> str:
        """Where the staged file ``name`` is written."""
        return os.path.join(self.directory, name)

    def commit(self) -> list[str]:
        """Move every staged file into the export folder; return their paths.

        Raises:
            CheckpointError: a file of that name appeared meanwhile.
        """
        names = sorted(os.listdir(self.directory))
        clashes = [n for n in names if os.path.exists(os.path.join(self.folder, n))]
        if clashes:
            raise CheckpointError(f"export folder {self.folder} gained {_listed(clashes)} while "
                                  f"exporting; give a new or empty folder")
        for name in names:
            os.replace(self.path(name), os.path.join(self.folder, name))
        return [os.path.join(self.folder, n) for n in names]

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        if kind is not None and self.created and not os.listdir(self.folder):
            os.rmdir(self.folder)


def _write_safetensors(path: str,
                       named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.dtype]:
    """Write the safetensors file ``path`` of ``named`` (name, full tensor),
    holding one tensor at a time: the data goes to a scratch file first, then
    the header and the data into ``path``. Returns name -> dtype written."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    dtypes: dict[str, torch.dtype] = {}
    scratch, end = path + ".data", 0
    with open(scratch, "wb") as data:
        for name, tensor in named:
            flat = _cpu_bytes(name, tensor)
            if name in header:
                raise CheckpointError(f"{name} is given twice; give each tensor once")
            data.write(flat.numpy().data)
            header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype],
                            "shape": list(tensor.shape), "data_offsets": [end, end + flat.numel()]}
            dtypes[name] = tensor.dtype
            end += flat.numel()
            del tensor, flat  # held no longer than written: the next one may be large
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as out, open(scratch, "rb") as data:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        shutil.copyfileobj(data, out, COPY_CHUNK_BYTES)
    os.remove(scratch)
    return dtypes


def _cpu_bytes(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s elements as one contiguous CPU uint8 tensor (its bytes)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        raise CheckpointError(f"{name} is a DTensor; pass full tensors (DTensor.full_tensor()) "
                              f"to the export")
    if tensor.dtype not in _SAFETENSORS_DTYPES:
        raise CheckpointError(f"{name} has dtype {tensor.dtype}, which safetensors cannot hold; "
                              f"convert it first")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def _listed(names: list[str]) -> str:
    """The first few of ``names`` for a one-line message."""
    more = ", ..." if len(names) > LISTED_NAMES else ""
    return ", ".join(names[:LISTED_NAMES]) + more


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
