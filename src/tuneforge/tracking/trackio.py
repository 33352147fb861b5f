"""trackio: one trackio run per job, where trackio's own settings send it: by default its local store (an SQLite
database per project in TRACKIO_DIR, else ~/.cache/huggingface/trackio; `trackio show` draws it), or a Space or
server (TRACKIO_SPACE_ID, TRACKIO_SERVER_URL).

Project: --experiment-name, else "tuneforge"; run name: --run-name, else the output dir's name, with -2, -3, ...
where the project's local store holds a run of that name (trackio resumes the latest run of a name, so the checkpoint
keeps the name, and two jobs must not share one). Config: the resolved config flattened with dots (numbers and
booleans as such, as transformers' TrackioCallback sends them) and the tags (tuneforge.version, .task, .backend,
.device, .world_size), sent by each attempt (a resume that sent none would leave the run with an empty one: trackio
replaces it). Metrics: each record's numeric values at its step. trackio prints its notes on stdout: they go to
stderr (stdout stays for --json), or nowhere under --quiet.

Resume: `trackio.init(name=..., resume="must")` continues the run (the latest of that name in the project). trackio
stores whatever it is sent, a step logged twice included, so the last step of each of the run's metrics is read from
its store, and a value at or below it is not sent again: every step is in the run once. Records from before the
checkpoint that the store lacks (trackio writes from a background thread, so the last moments before a SIGKILL may
not have reached it) are sent when the run opens; where the store holds no run of that name at all (the killed
attempt's first writes never reached it), the run starts under that name and is sent all of them. (Read from the
local store: a run in a Space or on a server is continued, but not checked for steps it has.)

No model (--log-model needs mlflow or wandb); trackio has no run status: the end is `finish` either way.
"""

from __future__ import annotations

import sys

from tuneforge.tracking.base import Continued, Point, RunDescription, Tracker, library_notes, unlogged

DEFAULT_PROJECT = "tuneforge"


class TrackioTracker(Tracker):
    name = "trackio"
    package = "trackio"
    extra = "trackio"
    names_runs = True

    def __init__(self, run: RunDescription, continued: Continued | None) -> None:
        import trackio

        resuming = continued is not None and continued.run_id is not None
        self.quiet = run.quiet
        project = run.experiment or DEFAULT_PROJECT
        name = continued.run_id if resuming else self._free_name(project, run.name)
        config = {**run.params, **run.tags}  # on a resume too: trackio replaces the run's config
        with library_notes(self.quiet):
            try:
                mode = "must" if resuming else "never"
                self.run = trackio.init(project=project, name=name, resume=mode, config=config, embed=False)
            except ValueError as err:  # the killed attempt's run never reached the store (written from a thread)
                if not resuming or "does not exist" not in str(err):
                    raise
                resuming = False
                self.run = trackio.init(project=project, name=name, resume="never", config=config, embed=False)
                if not self.quiet:
                    print(f"note: trackio holds no run {name!r} yet: it starts with the job's records", file=sys.stderr)
        self.run_id = self.run.name
        self.last_steps = self._last_steps() if resuming else {}
        if continued is not None:  # records from before the checkpoint the run lacks
            for point in continued.kept:
                self.log(point)

    def _free_name(self, project: str, name: str) -> str:
        """`name`, or name-2, name-3, ... where the project's local store holds a run of that name: trackio resumes
        the latest run of a name, so a second job named 'run' would be the run a resume of the first continued."""
        from trackio.sqlite_storage import SQLiteStorage

        taken, number = set(SQLiteStorage.get_runs(project)), 1
        while (f"{name}-{number}" if number > 1 else name) in taken:
            number += 1
        free = f"{name}-{number}" if number > 1 else name
        if free != name and not self.quiet:
            print(
                f"note: trackio's project {project!r} holds a run {name!r} already: this one is {free!r}",
                file=sys.stderr,
            )
        return free

    def _last_steps(self) -> dict[str, int]:
        """The last step stored of each of the run's metrics (the local store)."""
        from trackio.sqlite_storage import SQLiteStorage

        last: dict[str, int] = {}
        for row in SQLiteStorage.get_logs(self.run.project, self.run.name, run_id=self.run.id):
            for key in row.keys() - {"step", "timestamp"}:
                last[key] = max(last.get(key, -1), row["step"])
        return last

    def log(self, point: Point) -> None:
        metrics = unlogged(point, self.last_steps)
        if metrics:
            with library_notes(self.quiet):
                self.run.log(metrics, step=point.step)

    def close(self, finished: bool) -> None:
        import trackio

        with library_notes(self.quiet):
            if trackio.context_vars.current_run.get() is self.run:
                trackio.finish()  # also forgets it as the current run (which trackio would finish again at exit)
            else:
                self.run.finish()

    def abandon(self) -> None:
        self.close(finished=False)


TRACKER = TrackioTracker
