"""Hyperparameter search over the pipeline's training settings, on Optuna (no Prefect here).

- `cifar.search.space`: the typed search space (`SearchSpace`, presets, files) and the sampler and
  pruner it describes.
- `cifar.search.study`: where a study lives (a journal file or a database), opening it, and what a
  trial's run records there (per-epoch reports, pruning, its outcome).
- `cifar.search.pruning`: the Keras callback that reports every epoch and stops a hopeless trial.
- `cifar.search.results`: the study as rows, its summary file and its plots.
"""
