"""The training layer above :mod:`codegen`: data as a function of the step number
(:mod:`training.data`), the learning-rate schedule (:mod:`training.lr_schedule`),
progress logging (:mod:`training.progress_log`), checkpoints and the job loop.

Submodules are imported by name; this package imports none of them itself.
"""
