"""The application layer, above the planner and the code generator: the
``planner`` command (:mod:`app.cli`), the demo (:mod:`app.demo`) and the
automatic plan against every Megatron-LM configuration (:mod:`planner.baselines.compare`)."""
