"""Where a run stands: the plain record the Trainer updates and a checkpoint saves and restores."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar


@dataclass
class Progress:
    step: int = 0  # optimizer steps taken
    epoch: int = 0  # current epoch
    consumed: int = 0  # examples of this epoch's order already trained on
    order_global_batch: int = 0  # examples per step the epoch order was built with (resume rule)
    order_digest: str | None = None  # the epoch order's digest: a resume mid-epoch must continue that order
    best_metric: float | None = None
    best_step: int | None = None
    bad_evals: int = 0  # evaluations without improvement (early stopping)
    stop: bool = False
    last_eval: dict = field(default_factory=dict)
    last_eval_step: int | None = None  # last_eval's step (the run's end evaluates the exported weights if not)
    train_loss: float | None = None
    best_eval: dict | None = None  # the metrics of the best evaluation (load_best_model_at_end)
    log_loss: float = 0.0  # this rank's loss sum since the last log line
    log_count: float = 0.0  # this rank's item count since the last log line
    skipped_steps: int = 0  # steps skipped for a nan/inf loss or gradient (skip_nonfinite allows them)
    metrics_records: int | None = None  # records in metrics.jsonl at the last save (a resume cuts it back to them)
    # the job's experiment-tracker runs, {tracker: run id} (tuneforge/tracking/): a resume continues them; a
    # checkpoint of before them has none
    tracker_runs: dict[str, str] = field(default_factory=dict)
    # content fingerprints of the training inputs (data/fingerprint.py): a resume onto changed data is refused
    data_fingerprints: dict[str, str] = field(default_factory=dict)

    PER_RANK: ClassVar[tuple[str, ...]] = ("log_loss", "log_count")  # saved per rank, not in trainer_state.json

    def to_dict(self) -> dict:
        return asdict(self)

    def shared_dict(self) -> dict:
        """The fields every rank has in common (trainer_state.json)."""
        return {k: v for k, v in asdict(self).items() if k not in self.PER_RANK}

    @classmethod
    def from_dict(cls, values: dict) -> Progress:
        known = {f.name for f in fields(cls)}
        progress = cls(**{k: v for k, v in values.items() if k in known})
        if "last_eval_step" not in values and progress.last_eval:  # a checkpoint written before the field:
            progress.last_eval_step = progress.step  # its last evaluation is taken as of the checkpoint's step
        return progress
