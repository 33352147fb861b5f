"""`SweepOptions`: `tuneforge sweep`'s arguments, each default and bound written once here. The CLI generates the
flags from these fields (tuneforge.flags) and the sweep takes the validated instance. Imports nothing heavy: the
CLI builds its parser from it before torch or optuna is imported."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tuneforge.config import MAX_SEED
from tuneforge.flags import POSITIONAL
from tuneforge.options import PATH

MAX_TRIALS = 1_000_000
MEDIAN_ONLY = ("prune_startup_trials", "prune_warmup_steps")  # the median pruner's settings


class SweepOptions(BaseModel):
    """`tuneforge sweep`'s arguments: every number finite and bounded (a value outside is one line naming its
    flag); --resume and --overwrite exclude each other."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    config: tuple[str, ...] = Field(
        (),
        description="the base config as `tuneforge train` takes it: a YAML file, then key=value overrides "
        "(optim.lr=3e-5); every trial is this config with its sampled values on top (default: none, the task's "
        "defaults)",
        # an override (key=value) never starts with ~: only the config file's path is read as one
        json_schema_extra={**POSITIONAL, **PATH, "flag_kwargs": {"nargs": "*", "metavar": "CONFIG"}},
    )
    space: str = Field(
        description="the search space: a YAML file mapping config keys (optim.lr, epochs, lora_r, ...) to "
        "distributions: {type: float, low: 1e-5, high: 1e-3, log: true}, {type: int, low: 4, high: 32, step: 4}, "
        "or a list of choices",
        json_schema_extra=PATH,
    )
    trials: int = Field(
        20, ge=1, le=MAX_TRIALS, description="trials in the study (a resumed study counts those it has already)"
    )
    output_dir: str | None = Field(
        None,
        description="the sweep folder: the study, trial-NNNN run folders, trials.csv, best.yaml, plots "
        "(default: runs/sweep-CONFIG_NAME)",
        json_schema_extra=PATH,
    )
    overwrite: bool = Field(
        False,
        description="replace what an earlier sweep wrote in the sweep folder (a study in an RDB --storage stays there: "
        "pass another --study-name to start afresh)",
    )
    resume: bool = Field(
        False,
        description="continue the sweep in the sweep folder (after a crash or kill): its interrupted trials resume "
        "from their last checkpoint, then the remaining trials run",
    )
    storage: str | None = Field(
        None,
        description="Optuna storage URL; an RDB such as postgresql://... shared by sweeps on several machines "
        "(each with its own --output-dir) runs one study (default: sqlite:///SWEEP_DIR/study.db)",
    )
    study_name: str | None = Field(None, description="the study's name in --storage (default: the sweep folder's name)")
    metric: str | None = Field(
        None, description="the metric to optimise (default: metric_for_best of the config, else the task's)"
    )
    direction: Literal["maximize", "minimize"] | None = Field(
        None, description="maximize or minimize the metric (default: as the task ranks it; loss: minimize)"
    )
    sampler: Literal["tpe", "random"] = Field("tpe", description="how the next trial's values are chosen")
    pruner: Literal["median", "hyperband", "none"] = Field(
        "median", description="stop trials whose evaluations fall behind those of earlier trials"
    )
    prune_startup_trials: int = Field(
        3, ge=0, le=MAX_TRIALS, description="median: finished trials before any trial is pruned"
    )
    prune_warmup_steps: int = Field(
        0, ge=0, le=10**9, description="median: optimizer steps of a trial before it can be pruned"
    )
    seed: int | None = Field(
        None, ge=0, le=MAX_SEED, description="the sampler's seed (default: the config's seed); trials train with theirs"
    )
    parallel: int = Field(
        1,
        ge=1,
        le=1024,
        description="trials running at once on this machine, each with CPU_CORES/N threads (or OMP_NUM_THREADS "
        "where set); TPE's draws after its start-up trials and the pruner's decisions then depend on which trials "
        "finish first: one at a time is reproducible",
    )
    keep_best: int = Field(
        2,
        ge=0,
        le=MAX_TRIALS,
        description="keep model/ and checkpoints of the best K finished trials only (their metrics and logs stay); "
        "pruned and failed trials keep none",
    )
    plots: bool = Field(True, description="write the sweep's plots (optimisation history, parameters, importances)")
    json_output: bool = Field(
        False, description="last stdout line: the best trial as JSON", json_schema_extra={"flag": "--json"}
    )

    @model_validator(mode="after")
    def _resume_or_overwrite(self):
        if self.resume and self.overwrite:
            raise ValueError("--resume continues the sweep in the folder and --overwrite replaces it; pass one of them")
        return self

    @model_validator(mode="after")
    def _median_settings_need_median(self):
        given = [f"--{name.replace('_', '-')}" for name in MEDIAN_ONLY if name in self.model_fields_set]
        if given and self.pruner != "median":  # Optuna's hyperband and no pruner take neither
            raise ValueError(
                f"{' and '.join(given)} set{'s' if len(given) == 1 else ''} the median pruner, and --pruner "
                f"{self.pruner} is not it, so {'it' if len(given) == 1 else 'they'} would do nothing; drop "
                f"{'it' if len(given) == 1 else 'them'}, or pass --pruner median"
            )
        return self
