"""The stack check's closing report: the images, one row per check, the served answers, a few facts."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime


@dataclass
class Row:
    """One check's line in the table."""

    name: str
    status: str = "not run"
    detail: str = ""
    seconds: float | None = None


@dataclass
class ImageRow:
    image: str
    source: str
    size: str
    seconds: float | None
    note: str = ""


@dataclass
class Answer:
    """The served model's answer for one test image, beside the SavedModel's."""

    index: int
    label: str
    served: str
    saved_model: str
    served_p: float
    saved_model_p: float


@dataclass
class Report:
    engine: str
    names: Sequence[str]  # The rows, in order: every check's name.
    rows: dict[str, Row] = field(init=False)
    images: list[ImageRow] = field(default_factory=list)
    facts: list[tuple[str, str]] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.rows = {name: Row(name) for name in self.names}

    @contextlib.contextmanager
    def check(self, name: str) -> Iterator[Row]:
        """The row of check `name`, timed; ok when the block ends, FAILED with the error's message when it raises."""
        row = self.rows[name]
        started = time.monotonic()
        print(f"[{datetime.now():%H:%M:%S}] {name} ...", flush=True)
        try:
            yield row
        except BaseException as error:
            row.status = "FAILED"
            message = str(error) or type(error).__name__
            row.detail = f"{row.detail}; {message}" if row.detail else message
            raise
        else:
            row.status = "ok"
        finally:
            row.seconds = time.monotonic() - started
            print(f"[{datetime.now():%H:%M:%S}]   {row.status}: {row.detail}", flush=True)

    def counts(self) -> tuple[int, int, int]:
        """Checks passed, failed, not run."""
        statuses = [row.status for row in self.rows.values()]
        return statuses.count("ok"), statuses.count("FAILED"), statuses.count("not run")

    def render(self) -> str:
        lines = [f"make stack-check ({self.engine}): {time.monotonic() - self.started:.0f} s in all", ""]
        if self.images:
            rows = [("image", "built from", "size", "build time", "")]
            for image in self.images:
                seconds = f"{image.seconds:.0f} s" if image.seconds is not None else "-"
                rows.append((image.image, image.source, image.size, seconds, image.note))
            lines += table(rows) + [""]
        rows = [("check", "result", "time", "detail")]
        for row in self.rows.values():
            seconds = f"{row.seconds:.0f} s" if row.seconds is not None else ""
            rows.append((row.name, row.status, seconds, row.detail))
        lines += table(rows)
        if self.answers:
            lines += ["", "Served answers (3 CIFAR-10 test images):"]
            rows = [("test image", "label", "served", "SavedModel", "served p", "SavedModel p")]
            for answer in self.answers:
                rows.append((f"#{answer.index}", answer.label, answer.served, answer.saved_model,
                             f"{answer.served_p:.6f}", f"{answer.saved_model_p:.6f}"))  # fmt: skip
            lines += table(rows)
        if self.facts:
            lines += [""] + [f"{name}: {value}" for name, value in self.facts]
        return "\n".join(lines)


def table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    widths[-1] = 0  # The last column runs on.
    out = []
    for index, row in enumerate(rows):
        out.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        if index == 0:
            out.append("  ".join("-" * max(width, len(cell)) for cell, width in zip(row, widths)))
    return out
