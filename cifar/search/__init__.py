"""Hyperparameter search over the pipeline's training settings, on Optuna (no Prefect here).

`space`: the typed search space, its sampler and pruner; `study`: where a study lives and what a trial's
run records there; `pruning`: the Keras callback that reports every epoch and stops a hopeless trial;
`results`: the study as rows, its summary file and its plots.
"""
