"""Stage results that the Prefect tasks extend, kept free of TensorFlow so importing them stays cheap."""

from __future__ import annotations

from pydantic import BaseModel


class ExportResult(BaseModel):
    """Where the verified SavedModel version lives and what it scored."""

    export_dir: str
    version: int
    verified_accuracy: float
    epoch: int
    signatures: list[str]
    num_examples: int
    correct: int
