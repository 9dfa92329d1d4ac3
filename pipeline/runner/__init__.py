"""The runner: compose -> plan -> build -> train, and everything a run's life needs around it.

:mod:`pipeline.runner.run` drives one run (the plan from :mod:`pipeline.plan`,
the collector from :mod:`components.collector`, the trainer loop in
:mod:`pipeline.runner.loops`); the other modules each own one part of its life:
signals, the run directory and its lock, checkpointed state and resume, the
sweep glue Hydra calls back into, evaluation and budgets.
"""
