"""TensorBoard: event files in OUTPUT_DIR/tensorboard (torch's SummaryWriter; `tensorboard --logdir OUTPUT_DIR`),
each metric (`train/loss`, `eval/f1`) a scalar at its step. No params, tags or model (--log-model needs another
tracker); its "run" is that folder (the checkpoint names it): a resume continues the events it holds, and where it
holds none (TensorBoard added on the resume) they start with the job's records up to the checkpoint.

Resume: the writer flushes before each checkpoint, so the event files hold everything up to it; what the interrupted
attempt wrote after it (on disk or not) is hidden by opening the new writer with `purge_step` = the first step
logged after the checkpoint (TensorBoard then drops the earlier files' events at or after that step), and the
re-run logs those steps again. Records of that same step logged before the checkpoint (an epoch's evaluation
comes after the save of its last step) are written again after the purge. Each step is then shown once.
"""

from __future__ import annotations

from pathlib import Path

from tuneforge.tracking.base import Continued, Point, RunDescription, Tracker

FOLDER = "tensorboard"  # in the output dir (paths.RUN_FOLDERS: --overwrite clears it)
EVENTS = "events.out.tfevents.*"


class TensorBoardTracker(Tracker):
    name = "tensorboard"
    package = "tensorboard"
    extra = ""  # a dependency of tuneforge itself

    def __init__(self, run: RunDescription, continued: Continued | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        folder = Path(run.output_dir) / FOLDER
        purge, again = None, ()
        if continued is not None and any(
            folder.glob(EVENTS)
        ):  # the job's folder (from a checkpoint before trackers too)
            if continued.replayed:
                purge = min(p.step for p in continued.replayed)
                again = tuple(p for p in continued.kept if p.step >= purge)
        elif continued is not None:  # new on this resume: the job's records so far
            again = continued.kept
        self.writer = SummaryWriter(str(folder), purge_step=purge)
        self.run_id = FOLDER
        for point in again:
            self.log(point)

    def log(self, point: Point) -> None:
        for key, value in point.metrics.items():
            self.writer.add_scalar(key, value, point.step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, finished: bool) -> None:
        self.writer.close()

    def abandon(self) -> None:
        self.writer.close()


TRACKER = TensorBoardTracker
