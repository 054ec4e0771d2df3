"""The settings of a training job: one typed config, one set of flags.

:class:`TrainConfig` is what ``planner train`` passes to every rank
(:mod:`training.job`); :func:`add_train_arguments` defines its flags once, for
the command line (``app/cli.py``) and for the rank program alike.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields

__all__ = ["CONFIG_ENV", "TrainConfig", "add_train_arguments"]

#: The environment variable ``planner train`` hands the ranks their config in (JSON).
CONFIG_ENV = "PLANNER_TRAIN_CONFIG"


@dataclass(frozen=True)
class TrainConfig:
    """One training job's settings (the flags of ``planner train``)."""

    plan: str  # plan.json
    data: str | None = None  # token file, `planner data` folder, or file.py:function
    data_dtype: str = "uint16"  # token ids' type in a token file: uint16 or uint32
    steps: int = 100  # total training steps (a resumed job stops at the same total)
    optimizer: str = "adamw"  # adamw or sgd
    lr: float = 3e-4  # peak learning rate
    warmup: int = 0  # steps of linear warm-up
    min_lr_ratio: float = 0.1  # the cosine decay's floor, as a fraction of lr
    weight_decay: float = 0.0
    grad_clip: float | None = None  # clip the global gradient 2-norm to this
    log_every: int = 10
    log: str | None = None  # JSON lines, one per logged step
    checkpoint_dir: str | None = None
    save_every: int | None = None  # steps between saves (and one at the end)
    resume: bool = False  # continue from the newest finished save in checkpoint_dir
    init: str | None = None  # start from a save folder, a checkpoint dir or a HF folder
    export: str | None = None  # one consolidated safetensors state dict at the end
    result_json: str | None = None
    eval_data: str | None = None  # held-out token file (or `planner data` folder: its val.bin)
    eval_every: int | None = None  # steps between validations (and one at the end)
    eval_batches: int = 8  # batches of the held-out data each validation averages over
    #: what the job reports: "train" (progress lines, the job's result JSON) or
    #: "run" (``planner run``: the summary, placements and --check, constant LR)
    report: str = "train"
    check: bool = False  # "run": compare step 1 with one process and the plan's placements
    rtol: float | None = None  # "run": the check's tolerance (default: by precision)
    record: str | None = None  # "run": write the plan with the observed placements here
    #: run the per-rank program through torch.compile (True), eager (False), or
    #: as the plan's ``training.compile`` says (None)
    compile: bool | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TrainConfig":
        return cls(**{f.name: getattr(args, f.name, f.default) for f in fields(cls)})

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "TrainConfig":
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of :class:`TrainConfig` on parser ``p``."""
    d = TrainConfig(plan="")
    p.add_argument("plan", help="plan.json (from `planner plan`)")
    p.add_argument("--data", default=None,
                   help="a flat binary file of token ids (nanoGPT's train.bin), a folder "
                   "`planner data` wrote (its train.bin), or FILE.py:FUNCTION returning the "
                   "batch of a step number")
    p.add_argument("--data-dtype", choices=("uint16", "uint32"), default=d.data_dtype,
                   help="token id type of --data (default uint16)")
    p.add_argument("--steps", type=int, default=d.steps, help="total training steps")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default=d.optimizer)
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=d.warmup, help="linear warm-up steps")
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio,
                   help="cosine decay's final learning rate, as a fraction of --lr")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=None,
                   help="clip the global gradient norm to this")
    p.add_argument("--log-every", type=int, default=d.log_every, help="steps between log lines")
    p.add_argument("--log", default=None, help="JSON lines file of the logged steps (appended)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="where distributed checkpoints (DCP) go, one step_* folder per save")
    p.add_argument("--save-every", type=int, default=None, help="steps between saves")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest finished save in --checkpoint-dir, under "
                   "this plan (which may differ from the one it was saved under)")
    p.add_argument("--init", default=None,
                   help="initial weights: a checkpoint (a step_* folder or a checkpoint "
                   "directory) or a Hugging Face folder of safetensors; default: the model's "
                   "own initialisation, or the weights of an hf: model's folder")
    p.add_argument("--export", default=None,
                   help="write the trained weights here as one safetensors file (with "
                   "config.json for hf: models); the folder must be new or empty")
    p.add_argument("--result-json", default=None,
                   help="where rank 0 writes the final loss, steps and each rank's peak memory")
    p.add_argument("--eval-data", default=None,
                   help="held-out token file (or a `planner data` folder: its val.bin) for the "
                   "validation loss: forward only, under the plan; at the end, and every "
                   "--eval-every steps")
    p.add_argument("--eval-every", type=int, default=None,
                   help="steps between validations (and one at the end); without --eval-data, "
                   "--data DIR's val.bin")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches,
                   help=f"batches each validation averages its loss over (default "
                   f"{d.eval_batches}); the same batches every time")
