"""DeepSpeed ZeRO 1/2/3, with optional optimizer and parameter CPU offload.

The DeepSpeed config is derived from tuneforge's (batch size, accumulation, clipping,
precision, `zero_stage`, `offload`). A user JSON (`deepspeed_config`) is merged into it for
everything else (bucket sizes, stage-3 thresholds, ...); a value that contradicts tuneforge's
config is an error naming both values, and an "auto" value takes tuneforge's value. The
resolved config is written to OUTPUT_DIR/deepspeed_config.json.

How the engine fits the Trainer's loop:
- The optimizer is the Trainer's own (`make_optimizer`, a torch AdamW), handed to
  `deepspeed.initialize`; ZeRO steps that same object, so the torch LR scheduler the Trainer
  builds on it drives the learning rate. With CPU offload it stays a torch optimizer
  (`zero_force_ds_cpu_optimizer: false`): DeepSpeedCPUAdam is faster but needs a C++ JIT build
  of several minutes on first use.
- Gradient accumulation: the Trainer's loss is already normalised by the global item count
  (and scaled by dp_size, which ZeRO's gradient averaging undoes), so `backward` calls
  `engine.backward(loss, scale_wrt_gas=False)` (no extra 1/gas) and marks the accumulation
  boundary itself with `set_gradient_accumulation_boundary(sync)` (in `micro_step`) instead of DeepSpeed's
  micro-step counter: gradients are reduced on the last micro-batch, and the one `step()` per
  optimizer step is a real step. The result equals one process on the global batch.
- Process group: the Trainer's gloo (CPU) / NCCL (CUDA) group, handed to DeepSpeed; on CPU
  DeepSpeed needs neither oneCCL nor Intel's extension.
- Precision: `EnginePrecision` (no autocast; DeepSpeed keeps the model in bf16/fp16 and scales
  fp16 losses itself).
- Checkpoints: DeepSpeed's own format (the `deepspeed` layout of backends/layouts.py:
  `checkpoint-STEP/deepspeed/`, each rank writes its ZeRO shard); resume with the same number of
  processes. `tuneforge export` consolidates them offline (zero_to_fp32). The HF export gathers the
  fp32 master weights (never ZeRO-3's empty placeholders).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import Field

from tuneforge.backends.base import Backend, MakeOptimizer, NonFiniteStep
from tuneforge.backends.precision import EnginePrecision
from tuneforge.errors import ConfigError
from tuneforge.options import BackendOptions
from tuneforge.weights import parameter_names

RESOLVED_CONFIG = "deepspeed_config.json"

# DeepSpeed keys that tuneforge's config decides: path -> (tuneforge name, flag to change it)
OWNED = {
    ("train_micro_batch_size_per_gpu",): ("batch_size", "--batch-size"),
    ("gradient_accumulation_steps",): ("grad_accum", "--grad-accum"),
    ("train_batch_size",): ("batch_size x grad_accum x processes", "--batch-size, --grad-accum or --nproc"),
    ("gradient_clipping",): ("optim.max_grad_norm", "--max-grad-norm"),
    ("bf16", "enabled"): ("precision", "--precision"),
    ("fp16", "enabled"): ("precision", "--precision"),
    ("zero_optimization", "stage"): ("zero_stage", "--zero-stage"),
    ("zero_optimization", "offload_optimizer", "device"): ("offload", "--offload"),
    ("zero_optimization", "offload_param", "device"): ("offload", "--offload"),
}
# sections tuneforge builds itself (Trainer.make_optimizer, optim.scheduler)
NOT_MERGED = {"optimizer": "--lr, --weight-decay (optim.*)", "scheduler": "--scheduler, --warmup-steps (optim.*)"}


def _shown(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (bool, type(None))) else str(value)


def _refuse_non_finite(name: str) -> Any:
    # Python's json reads NaN and Infinity, which strict JSON (and every setting DeepSpeed has) does not allow
    raise ValueError(f"{name} is not a JSON number; every DeepSpeed setting must be finite")


def read_user_config(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"deepspeed config {path!r} does not exist; pass a JSON file with --deepspeed-config")
    try:
        data = json.loads(p.read_text(encoding="utf-8"), parse_constant=_refuse_non_finite)
    except ValueError as err:
        raise ConfigError(f"deepspeed config {path!r} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"deepspeed config {path!r} must hold a JSON object of DeepSpeed settings")
    return data


class DeepSpeedOptions(BackendOptions):
    zero_stage: int = Field(
        2, ge=0, le=3, description="ZeRO stage: 1 optimizer state, 2 + gradients, 3 + parameters sharded"
    )
    offload: Literal["none", "optimizer", "params", "both"] = Field(
        "none", description="move optimizer state and/or parameters (ZeRO-3) to CPU memory"
    )
    deepspeed_config: str | None = Field(
        None,
        description="a DeepSpeed JSON merged into the derived config (bucket sizes, stage-3 thresholds, ...); "
        "a value contradicting tuneforge's config is an error",
    )


def derived_config(config, options: DeepSpeedOptions, precision: str | None, world_size: int | None) -> dict:
    """The DeepSpeed settings tuneforge's config implies. `None` = not known yet (left out)."""
    offload = options.offload
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": config.batch_size,
        "gradient_accumulation_steps": config.grad_accum,
        "gradient_clipping": config.optim.max_grad_norm or 0.0,
        "zero_optimization": {
            "stage": options.zero_stage,
            "offload_optimizer": {"device": "cpu" if offload in ("optimizer", "both") else "none"},
            "offload_param": {"device": "cpu" if offload in ("params", "both") else "none"},
        },
        # the Trainer's torch optimizer is kept with offload (see the module docstring)
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,  # a make_optimizer override may return any torch optimizer
    }
    if world_size is not None:
        ds["train_batch_size"] = config.batch_size * config.grad_accum * world_size
    if precision is not None:
        ds["bf16"] = {"enabled": precision == "bf16"}
        ds["fp16"] = {"enabled": precision == "fp16"}
    return ds


def _tuneforge_value(name: str, config, options: DeepSpeedOptions, derived: Any) -> Any:
    """What the user set on tuneforge's side, for the conflict message."""
    if name == "optim.max_grad_norm":
        return config.optim.max_grad_norm
    if name in DeepSpeedOptions.model_fields:
        return getattr(options, name)
    return getattr(config, name, derived)  # e.g. train_batch_size: only the product exists


def merge_user_config(derived: dict, user: dict, config, options: DeepSpeedOptions, source: str) -> dict:
    """`derived` with the user's settings merged in; conflicts with tuneforge's config are errors."""
    for key, flags in NOT_MERGED.items():
        if key in user:
            raise ConfigError(
                f"deepspeed config {source!r} sets {key!r}, which tuneforge builds itself; remove it from the JSON "
                f"and use {flags}"
            )

    def merge(base: dict, over: dict, prefix: tuple) -> dict:
        out = dict(base)
        for key, value in over.items():
            path = prefix + (key,)
            dotted = ".".join(path)
            if isinstance(value, dict):
                if key in base and not isinstance(base[key], dict):
                    raise ConfigError(f"deepspeed config {dotted} must be a value, not an object; fix {source!r}")
                out[key] = merge(base.get(key, {}), value, path)
            elif path in OWNED:
                if key not in base:  # not known yet (checked again once the process group is up)
                    out[key] = value
                elif value != "auto" and value != base[key]:
                    name, flag = OWNED[path]
                    mine = _tuneforge_value(name, config, options, base[key])
                    raise ConfigError(
                        f"deepspeed config {dotted}={_shown(value)} conflicts with {name}={_shown(mine)}; "
                        f"remove it from the JSON or change {flag}"
                    )
                # "auto" (or an equal value): tuneforge's value stays
            elif isinstance(base.get(key), dict):
                raise ConfigError(f"deepspeed config {dotted} must be an object; fix {source!r}")
            elif value == "auto":
                raise ConfigError(
                    f'deepspeed config {dotted}="auto" has no tuneforge value to take; '
                    f"give a number or remove it from {source!r}"
                )
            else:
                out[key] = value
        return out

    return merge(derived, user, ())


def build_deepspeed_config(config, options: DeepSpeedOptions, precision: str | None, world_size: int | None) -> dict:
    ds = derived_config(config, options, precision, world_size)
    if options.deepspeed_config:
        user = read_user_config(options.deepspeed_config)
        ds = merge_user_config(ds, user, config, options, options.deepspeed_config)
    return ds


class DeepSpeedBackend(Backend):
    name = "deepspeed"
    distributed = True
    sharded = True  # each rank writes its ZeRO shard
    supported_precisions = ("fp32", "bf16", "fp16")
    checkpoint_layout = "deepspeed"  # checkpoint-STEP/deepspeed/: DeepSpeed's own ZeRO shards
    precision_type = EnginePrecision  # no autocast, no torch grad scaler: the engine's own
    supports_quantized_base = False  # ZeRO would partition the packed 4-bit weights
    Options = DeepSpeedOptions

    @classmethod
    def usable(cls) -> str:
        try:
            import deepspeed  # noqa: F401
        except Exception as err:  # ImportError, or DeepSpeed failing to find an accelerator
            return (
                f"unusable: deepspeed does not import ({type(err).__name__}: "
                f"{str(err).splitlines()[0][:100] if str(err) else ''}); pip install deepspeed"
            )
        return super().usable()

    def holds_whole_model(self) -> bool:
        return self.options.zero_stage < 3  # ZeRO 1 and 2 shard the optimizer state and gradients, not the weights

    def refuses_repeated_gradients(self) -> str | None:
        if self.options.zero_stage < 2:
            return None
        return (
            f"ZeRO stage {self.options.zero_stage} reduces each weight's gradient in its hook, once per backward "
            "(--zero-stage 1 accumulates them)"
        )

    def check(self, model_config=None) -> None:
        super().check(model_config)
        cfg, opts = self.config, self.options
        if opts.zero_stage not in (1, 2, 3):
            raise ConfigError(
                f"backend 'deepspeed' needs zero_stage 1, 2 or 3 (got {opts.zero_stage}); "
                "for plain data parallel use --backend ddp"
            )
        if opts.offload in ("params", "both") and opts.zero_stage != 3:
            raise ConfigError(
                f"offload={opts.offload} offloads parameters, which needs ZeRO stage 3 (zero_stage is "
                f"{opts.zero_stage}); pass --zero-stage 3, or --offload optimizer"
            )
        # the world size is known here only when tuneforge itself is about to launch the workers
        about_to_launch = not self.env.launched and (cfg.nproc > 1 or cfg.nnodes > 1) and not cfg.hostfile
        planned_world = cfg.nproc * cfg.nnodes if about_to_launch else None
        precision = cfg.precision if cfg.precision != "auto" else None
        build_deepspeed_config(cfg, opts, precision, planned_world)

    # ---- lifecycle ------------------------------------------------------------------------
    def _init_process_group(self) -> None:
        super()._init_process_group()
        if not self.env.launched:
            # a world of one: deepspeed.initialize asserts that a launcher set LOCAL_RANK (its engine
            # reads os.environ; no argument replaces it), and here this process is the launcher. Only
            # this backend needs it: set anywhere else, it would leak into every run's environment.
            os.environ.setdefault("LOCAL_RANK", "0")

    def setup(self) -> None:
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        super().setup()
        accel = get_accelerator().device_name()
        if accel != self.device.type:
            raise ConfigError(
                f"DeepSpeed chose the {accel!r} accelerator but tuneforge runs on {self.device.type!r}; "
                f"set DS_ACCELERATOR={self.device.type}"
            )
        if self.device.type == "cpu":
            # On CPU, DeepSpeed's comm layer first JIT-compiles a shared-memory all-reduce (minutes of
            # g++ on first use). Only inference_all_reduce uses it; training goes through
            # torch.distributed, so mark it unavailable (DeepSpeed keeps this table editable).
            import deepspeed.ops

            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        # hand DeepSpeed the group made above (gloo on CPU): its CPU default would be oneCCL where installed
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False)

    # ---- model ----------------------------------------------------------------------------
    def wrap(self, model: torch.nn.Module, make_optimizer: MakeOptimizer | None = None):
        import deepspeed

        model.to(self.device)
        optimizer = make_optimizer(model) if make_optimizer else None
        ds_config = build_deepspeed_config(self.config, self.options, self.precision, self.dp_size)
        if self.is_main and optimizer is not None:  # what DeepSpeed was really given, for the record
            out = Path(self.config.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / RESOLVED_CONFIG).write_text(json.dumps(ds_config, indent=2) + "\n")
        if optimizer is None:
            # evaluation only: stages 1/2 shard optimizer state and gradients, of which there are none
            # (DeepSpeed refuses them without an optimizer); stage 3 still shards the parameters
            zero = {k: v for k, v in ds_config["zero_optimization"].items() if k != "offload_optimizer"}
            if zero["stage"] < 3:
                zero = {"stage": 0}
            ds_config = {**ds_config, "zero_optimization": zero}
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        # The Trainer (and its LR scheduler) keeps the torch optimizer: ZeRO steps that same object
        # with the same param_groups, so the scheduler's learning rates are the ones applied.
        return engine, optimizer

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return getattr(model, "module", model)

    def micro_step(self, model, sync: bool):
        # the boundary decides whether ZeRO reduces this micro-batch's gradients and whether the
        # next step() steps
        model.set_gradient_accumulation_boundary(sync)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, model) -> None:
        # the loss is already normalised, so no 1/gradient_accumulation_steps
        model.backward(loss, scale_wrt_gas=False)

    def step(self, model, optimizer, loss: torch.Tensor | None = None) -> torch.Tensor | None:
        """Clip (gradient_clipping), step and zero the gradients; returns the pre-clip norm.

        The engine's gradients live in its partitioned buffers, so the step is always taken and checked after:
        DeepSpeed itself skips a step whose gradient norm is nan/inf (its `skipped_steps`). NonFiniteStep when
        the loss or that norm was nan/inf on any rank, `applied` when the engine stepped anyway. Under fp16 an
        overflowing gradient is its loss scaler's to skip, not a failure."""
        skipped = model.skipped_steps
        model.step()
        norm = model.get_global_grad_norm()
        norm = None if norm is None else torch.as_tensor(norm, dtype=torch.float32, device=self.device)
        bad = self.nonfinite(loss, None if self.precision_plugin.skips_overflow else norm)
        if bad:
            raise NonFiniteStep(bad, applied=model.skipped_steps == skipped)
        return norm

    # ---- state ----------------------------------------------------------------------------
    def full_state_dict(self, model) -> dict[str, torch.Tensor] | None:
        """Full fp32 weights on the main rank (a collective: every rank calls it).

        Trained parameters come from ZeRO's fp32 master copy (exact, also under bf16 and ZeRO-3);
        frozen ones and buffers from the module, gathered where ZeRO-3 partitioned them.
        """
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        module = self.unwrap(model)
        has_optimizer = getattr(model, "optimizer", None) is not None
        full: dict[str, torch.Tensor] = {}
        for param, names in parameter_names(module):  # tied weights: one tensor, several state-dict names
            value = safe_get_full_fp32_param(param) if has_optimizer else None  # collective
            if value is None:  # frozen, or no optimizer (evaluation): the module's own weights
                with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
                    value = param.detach().clone()
            if self.is_main:
                value = value.detach().float().cpu().reshape(getattr(param, "ds_shape", param.shape))
                full.update(dict.fromkeys(names, value))
        if not self.is_main:
            return None
        # buffers are never partitioned; the state dict's order and names are the module's
        return {key: full[key] if key in full else buf.detach().cpu() for key, buf in module.state_dict().items()}


BACKEND = DeepSpeedBackend
