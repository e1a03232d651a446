"""Prefect flows composing the tasks: the pipeline, the sweep and scheduled retraining."""
