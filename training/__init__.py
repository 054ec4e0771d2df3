"""The training layer above :mod:`codegen`: the one step loop (:mod:`training.job`,
the rank program of both ``planner run`` and ``planner train``), its launch
(:mod:`training.launch`, :mod:`training.torchrun`), data as a function of the
step number (:mod:`training.data`), the learning-rate schedule
(:mod:`training.lr_schedule`), progress logging (:mod:`training.progress_log`),
checkpoints, the one-process reference (:mod:`training.reference`) and
``planner run``'s ``--check`` hook (:mod:`training.run_check`).

Submodules are imported by name; this package imports none of them itself.
"""
