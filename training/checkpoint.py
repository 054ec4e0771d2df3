"""Training checkpoints with ``torch.distributed.checkpoint`` (DCP), and resume.

A checkpoint directory holds one folder per save, ``step_00000010`` (the
number of steps done), written by every rank with ``dcp.save``:

* ``model``: the parameters by the original model's FQNs
  (:meth:`codegen.parallel_model.ParallelModel.state_dict`);
* ``optim``: the optimizer's per-parameter states by FQN, as DTensors of the
  parameters' global shapes (:meth:`ParallelModel.optimizer_state_dict`).

Everything else (the step, the LR schedule, the optimizer's hyper-parameters,
the model's parameter shapes and the plan it was saved under) is in
``meta.json``, which rank 0 writes last, after every rank's ``dcp.save`` has
returned; a folder without it is a save that did not finish (a crash), and
:func:`newest_complete` never takes it for a checkpoint. Because DCP stores
global tensors with their offsets, a checkpoint saved under one plan loads under
another (another mesh, pipeline or ZeRO stage): each rank reads the pieces its
shards need.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

__all__ = ["CheckpointError", "SavedCheckpoint", "check_compatible", "find_checkpoint",
           "load", "newest_complete", "save", "step_folder"]

#: The file whose presence marks a finished save; written last.
META_FILE = "meta.json"
_STEP_FOLDER = re.compile(r"^step_(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (missing, unfinished, of another model,
    a Hugging Face folder that does not fit), or an export that would overwrite
    files: one line that says what to do."""


@dataclass(frozen=True)
class SavedCheckpoint:
    """One finished save: its folder and what ``meta.json`` says of it."""

    path: str
    step: int  # training steps done when it was saved
    meta: dict[str, Any]


def step_folder(root: str, step: int) -> str:
    """The folder of the save after ``step`` steps in checkpoint directory ``root``."""
    return os.path.join(root, f"step_{step:08d}")


def _saves(root: str) -> list[tuple[int, str]]:
    """(step, folder) of every save folder in ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP_FOLDER.match(name)
        if match and os.path.isdir(os.path.join(root, name)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


def _read_meta(folder: str) -> dict[str, Any] | None:
    path = os.path.join(folder, META_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def newest_complete(root: str) -> tuple[SavedCheckpoint | None, list[str]]:
    """The newest finished save in checkpoint directory ``root`` (None if none),
    and the folders of newer saves that did not finish."""
    unfinished: list[str] = []
    for step, folder in reversed(_saves(root)):
        meta = _read_meta(folder)
        if meta is not None:
            return SavedCheckpoint(folder, step, meta), unfinished
        unfinished.append(folder)
    return None, unfinished


def find_checkpoint(path: str) -> SavedCheckpoint:
    """The save ``path`` names: a save folder, or a checkpoint directory (its
    newest finished save).

    Raises:
        CheckpointError: nothing finished there (one line saying what is there).
    """
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist; give a checkpoint directory "
                              f"written by `planner train --checkpoint-dir` or one of its "
                              f"step_* folders")
    meta = _read_meta(path)
    if meta is not None:
        return SavedCheckpoint(path, int(meta["step"]), meta)
    if _STEP_FOLDER.match(os.path.basename(os.path.normpath(path))):
        raise CheckpointError(f"checkpoint {path} is half-written (no {META_FILE}: its save was "
                              f"interrupted); resume from an earlier step_* folder or from the "
                              f"directory above it, which takes the newest finished save")
    found, unfinished = newest_complete(path)
    if found is None:
        what = (f"only unfinished saves ({', '.join(os.path.basename(u) for u in unfinished)}), "
                f"interrupted before their {META_FILE} was written" if unfinished
                else "no step_* save folders")
        raise CheckpointError(f"checkpoint directory {path} holds {what}; start without "
                              f"--resume, or point --init at a finished save")
    return found


def check_compatible(saved: SavedCheckpoint, shapes: dict[str, list[int]]) -> None:
    """Refuse (:class:`CheckpointError`) a save of another model than one with
    parameters ``shapes`` (FQN -> global shape)."""
    theirs = saved.meta.get("parameters", {})
    missing = [f for f in shapes if f not in theirs]
    extra = [f for f in theirs if f not in shapes]
    wrong = [f for f in shapes if f in theirs and list(theirs[f]) != list(shapes[f])]
    if not (missing or extra or wrong):
        return
    if wrong:
        f = wrong[0]
        detail = f"{f} is {theirs[f]} there and {shapes[f]} in this plan's model"
    elif missing:
        detail = f"it has no {missing[0]} ({len(missing)} parameter(s) missing)"
    else:
        detail = f"it holds {extra[0]}, which this plan's model lacks"
    raise CheckpointError(f"checkpoint {saved.path} is of another model "
                          f"({saved.meta.get('model', '?')}): {detail}; resume it under a plan "
                          f"of the same model")


def save(root: str, step: int, model: Any, optimizer: torch.optim.Optimizer,
         extra: dict[str, Any]) -> str:
    """Save after ``step`` steps into ``root`` (every rank calls it); returns the folder.

    ``model`` is a :class:`codegen.parallel_model.ParallelModel`; ``extra`` is
    JSON data kept in ``meta.json`` (the LR schedule's state, the plan, ...).
    """
    folder = step_folder(root, step)
    optim = model.optimizer_state_dict(optimizer)
    state = {"model": model.state_dict(), "optim": optim["state"]}
    shapes = model.parameter_shapes()
    dcp.save(state, checkpoint_id=folder)
    # dcp.save returns on rank 0 once every rank's files and the metadata are written
    dist.barrier()
    if dist.get_rank() == 0:
        meta = {"step": step, "parameters": shapes,
                "param_groups": optim["param_groups"], **extra}
        tmp = os.path.join(folder, META_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1, default=_json_default)
        os.replace(tmp, os.path.join(folder, META_FILE))
    dist.barrier()
    return folder


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"cannot write {type(value).__name__} into {META_FILE}")


def load(saved: SavedCheckpoint, model: Any, optimizer: torch.optim.Optimizer | None) -> None:
    """Load a finished save into ``model`` (a ParallelModel, any plan of the same
    model) and, when given, ``optimizer`` (its state created first, then filled
    in place; its hyper-parameters from the save). Every rank calls it."""
    state: dict[str, Any] = {"model": model.state_dict()}
    if optimizer is not None:
        model.init_optimizer_state(optimizer)
        state["optim"] = model.optimizer_state_dict(optimizer)["state"]
    dcp.load(state, checkpoint_id=saved.path)
    if optimizer is not None:
        model.load_param_groups(optimizer, saved.meta.get("param_groups", []))
