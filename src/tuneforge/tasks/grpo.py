"""Online RL with verifiable rewards (`--task grpo`): Group Relative Policy Optimization (Shao et al., 2024) and
its variants (DAPO, Dr. GRPO, GSPO), generating with tuneforge's own continuous-batching engine on the live model.

Each optimizer step: the step's prompts (rows of a json/jsonl file: `prompt` as text or messages, or
`--prompt-column`; every other column reaches the reward functions by name) get `num_generations` completions
each, sampled by the engine from the model as it is (no copy, no server); the reward functions score them
(tuneforge/rewards); each completion's advantage is its reward against its group's (tasks/grpo_loss.py); the
clipped objective is trained on the completion tokens. A prompt's whole group is generated and scored on the rank
that holds the prompt, so groups never span ranks; `scale_rewards batch` takes its std over every rank.

Exactness: the loss is summed per micro-batch and divided by its count over the whole step (every micro-batch,
every rank), as the Trainer does for every task; sampling is seeded by (seed, epoch, the prompt's row, the
completion's number), so a resumed run, also on another world size, samples what the interrupted one did.

Logged per logging interval: each reward function's mean and std and the total reward's (TRL's: each step's, over
all ranks, averaged over the interval's steps), completion length (mean, max, share truncated), clip ratios, KL
(beta > 0), the share of groups with equal rewards (no signal), generation and training tokens/s; a few
completions with their rewards go to OUTPUT_DIR/completions.jsonl. Evaluation: greedy completions of the validation
prompts, each reward function's mean (`accuracy` for the built-in accuracy reward).
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import itertools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from pydantic import Field, field_validator, model_validator

from tuneforge.config import EVAL, INPUT, MAX_TOKENS
from tuneforge.data import chat
from tuneforge.data.tokenize import Cut, report_cuts
from tuneforge.errors import ConfigError, DataError, UserError
from tuneforge.files import write_text
from tuneforge.options import TaskOptions, comma_list, one_or_list
from tuneforge.rewards import DEFAULT_FORMAT, RewardSettings, check_reward_spec, load_rewards, quoted_prompt, score
from tuneforge.tasks import grpo_loss
from tuneforge.tasks.base import MetricStream, StepTools, no_cache
from tuneforge.tasks.clm import CausalLMTask

if TYPE_CHECKING:
    import datasets

SAMPLES_FILE = "completions.jsonl"
log = logging.getLogger(__name__)


def _names_of(spec) -> list:
    """A --reward value's specs: built-in names split at commas; a file or model spec whole."""
    bare = isinstance(spec, str) and not any(mark in spec for mark in ":/.")
    return spec.split(",") if bare else [spec]


class GRPOOptions(TaskOptions):
    reward: list[str] = Field(
        default_factory=list,
        description="a reward function (repeat the flag for several): accuracy, format, length, FILE.py:FUNCTION "
        "(TRL's signature) or model:DIR (a --task reward model)",
        json_schema_extra=EVAL,
    )
    reward_weights: list[float] | None = Field(
        None,
        description="each --reward's weight in the total reward, comma-separated (default: 1 each)",
        json_schema_extra={**EVAL, "flag_kwargs": {"metavar": "WEIGHTS"}},
    )
    num_generations: int = Field(8, ge=2, le=256, description="completions sampled per prompt (the group)")
    max_completion_length: int = Field(
        256, gt=0, le=MAX_TOKENS, description="tokens per completion at most", json_schema_extra=EVAL
    )
    max_prompt_length: int = Field(
        512, gt=0, le=MAX_TOKENS, description="a longer prompt keeps its last tokens", json_schema_extra=EVAL
    )
    temperature: float = Field(1.0, gt=0, le=100, description="sampling temperature (the policy's log-probs too)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: the smallest set of tokens above top_p")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="advantages divided by the group's reward std, the whole step's, or not at all"
    )
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = Field(
        "dapo", description="how token losses are averaged (README: GRPO); dapo: over the step's tokens"
    )
    epsilon: float = Field(0.2, gt=0, lt=1, description="the clip range: ratios below 1 - epsilon are clipped")
    epsilon_high: float | None = Field(
        None, gt=0, le=100, description="the upper clip, 1 + epsilon_high (DAPO: 0.28); default: epsilon"
    )
    beta: float = Field(
        0.0, ge=0, le=1e3, description="the weight of the KL to the reference model (0: no reference at all)"
    )
    kl_importance_correction: bool = Field(
        True, description="the KL term weighted by the importance ratio (TRL's use_bias_correction_kl, its default)"
    )
    importance_sampling: Literal["token", "sequence"] = Field(
        "token", description="importance ratio per token, or per sequence (GSPO: the mean log-ratio)"
    )
    num_iterations: int = Field(
        1,
        ge=1,
        le=64,
        description="optimizer steps on each generated batch (mu), the later ones against the "
        "log-probs it was sampled with (clipped)",
    )
    mask_truncated_completions: bool = Field(
        False, description="completions cut at max_completion_length train nothing (DAPO)"
    )
    prompt_column: str = Field(
        "prompt",
        description="the column holding each row's prompt (text, or a list of messages)",
        json_schema_extra=EVAL,
    )
    system_prompt: str | None = Field(
        None,
        description="a system message put before every prompt rendered with the chat template",
        json_schema_extra=EVAL,
    )
    prompt_format: Literal["auto", "chat", "text"] = Field(
        "auto",
        description="chat: prompts rendered with the chat template (text prompts as one user turn); text: as "
        "written; auto: chat when the tokenizer has a template",
        json_schema_extra=EVAL,
    )
    chat_template: str | None = Field(
        None,
        description="a Jinja chat template file (for a tokenizer without one, or to replace its own)",
        json_schema_extra={**EVAL, **INPUT},
    )
    format_pattern: str = Field(
        DEFAULT_FORMAT, description="the regular expression the `format` reward wants matched", json_schema_extra=EVAL
    )
    target_length: int = Field(
        256, gt=0, le=MAX_TOKENS, description="the `length` reward's target, in tokens", json_schema_extra=EVAL
    )
    answer_column: str = Field(
        "answer", description="the column the `accuracy` reward compares with", json_schema_extra=EVAL
    )
    logged_samples: int = Field(
        4, ge=0, le=1024, description="completions written to OUTPUT_DIR/completions.jsonl at each log line"
    )
    # TRL's GRPO defaults, except a learning rate fit for LoRA on small models (TRL: 1e-6, for full fine-tuning)
    run_defaults = {"optim.lr": 1e-5, "batch_size": 2, "logging_steps": 1, "data.group_by_length": False}
    nonfinite_suspects = ("--beta", "--temperature")

    @field_validator("reward_weights", mode="before")
    @classmethod
    def _split(cls, value):
        return comma_list(value)

    @field_validator("reward", mode="before")
    @classmethod
    def _rewards(cls, value):
        """One spec (a YAML scalar) is a list of one; `accuracy,format` two built-ins (a spec with a path or a
        model folder is left whole: a comma may be in its name)."""
        specs = one_or_list(value)
        if not isinstance(specs, (list, tuple)):
            return value
        return [part.strip() for spec in specs for part in _names_of(spec) if part.strip()]

    @model_validator(mode="after")
    def _consistent(self):
        for spec in self.reward:
            check_reward_spec(spec)
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            raise ValueError(
                f"--epsilon-high {self.epsilon_high:g} is below --epsilon {self.epsilon:g}; the upper clip is at "
                "least the lower (DAPO's clip-higher raises it)"
            )
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward):
            raise ValueError(
                f"--reward-weights gives {len(self.reward_weights)} weight(s) for {len(self.reward)} --reward "
                "function(s); give one per function"
            )
        return self

    def idle_options(self) -> dict[str, str]:
        idle = {}
        for name, reward in (("format_pattern", "format"), ("target_length", "length"), ("answer_column", "accuracy")):
            if reward not in self.reward:
                idle[name] = f"is read by the {reward} reward only; add --reward {reward}"
        if self.num_iterations == 1:  # the loss's old log-probs are its own, detached (GRPOTask.compute_loss)
            for name in ("epsilon", "epsilon_high"):
                idle[name] = (
                    "clips the importance ratio, which is 1 with --num-iterations 1 (each generated batch trains one "
                    "step, on the policy that sampled it): nothing is clipped; give --num-iterations 2 or more"
                )
        if self.beta == 0:
            idle["kl_importance_correction"] = "weighs the KL term, and --beta 0 has none; give --beta above 0"
        if self.prompt_format == "text":
            idle["system_prompt"] = (
                "is put in prompts rendered with the chat template, and --prompt-format text renders none; give "
                "--prompt-format chat"
            )
        return idle


def sample_seed(seed: int, epoch: int, row: int, k: int) -> int:
    """The seed of a prompt's k-th completion in an epoch: the same on any rank and world size."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{row}:{k}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def trainer_state(global_step: int, max_steps: int, epoch: int):
    """What TRL passes reward functions as `trainer_state`: transformers' TrainerState, with the optimizer steps
    done, the run's total and the epochs completed (its other fields at their defaults)."""
    from transformers import TrainerState

    return TrainerState(global_step=global_step, max_steps=max_steps, epoch=float(epoch))


def checked(completions: list) -> list:
    """The completions, or one line when the engine failed any (the engine logged why): training on an empty
    completion would teach the model nothing true."""
    failed = sum(c.finish_reason == "error" for c in completions)
    if failed:
        raise ConfigError(
            f"generation failed for {failed} of {len(completions)} completions (the warning above says why); the "
            "model cannot be trained on them"
        )
    return completions


def metric_names(specs: list[str]) -> list[str]:
    """A short name per reward for logs, in the order of `specs`: accuracy, format, length, the function's name,
    `model`; numbered where another reward has it (the built-ins keep theirs), or where its log keys would be
    another's: `reward_NAME_std` is NAME's std, `reward_std` the total's."""
    taken: dict[int, str] = {}
    for index in sorted(range(len(specs)), key=lambda i: ":" in specs[i]):  # the built-ins first
        spec = specs[index]
        name = "model" if spec.startswith("model:") else spec.rsplit(":", 1)[-1] if ":" in spec else spec
        unique, number = name, len(taken)
        while _clashes(unique, list(taken.values())):
            unique, number = f"{name}_{number}", number + 1
        taken[index] = unique
    return [taken[i] for i in range(len(specs))]


def _clashes(name: str, names: list[str]) -> bool:
    return name == "std" or any(name in (other, f"{other}_std") or other == f"{name}_std" for other in names)


def eval_keys(specs: list[str], names: list[str]) -> list[str]:
    """Each reward's key in evaluation records: `accuracy` for the built-in accuracy reward (a metric by its
    usual name), `reward_NAME` for the others (a function of yours named accuracy too)."""
    return ["accuracy" if spec == "accuracy" else f"reward_{name}" for spec, name in zip(specs, names)]


class RewardStream(MetricStream):
    """Evaluation: each reward function's mean over the prompts it applies to and the total reward's, over every
    rank (sums of value and count)."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys  # eval_keys: each reward's
        self.sums = torch.zeros(2 * len(keys) + 2, dtype=torch.float64)

    def update(self, outputs, batch, valid) -> None:
        per_function, total = outputs
        keep = valid.bool().cpu()
        per_function, total = per_function[keep], total[keep]
        seen = ~torch.isnan(per_function)
        row = torch.cat(
            [
                torch.nansum(per_function, 0),
                seen.sum(0).double(),
                torch.nansum(total)[None],
                (~torch.isnan(total)).sum()[None].double(),
            ]
        )
        self.sums += row

    def compute(self, backend) -> dict[str, float]:
        totals = backend.reduce_sum(self.sums.to(backend.device)).cpu()
        f = len(self.keys)
        mean = lambda s, n: float(s / n) if n else float("nan")  # noqa: E731
        out = {"reward": mean(totals[-2], totals[-1])}
        for i, key in enumerate(self.keys):
            out[key] = mean(totals[i], totals[f + i])
        return {**out, "num_prompts": int(totals[-1])}


class GRPOTask(CausalLMTask):
    name = "grpo"
    Options = GRPOOptions
    model_kind = "a causal language model"
    best_metric = "reward"
    greater_is_better = True
    generates_while_training = True
    training_data_flags = "--train-file prompts.jsonl"

    def __init__(self, config) -> None:
        super().__init__(config)
        o = self.options
        if not o.reward:
            raise ConfigError(
                "--task grpo needs at least one reward function: --reward accuracy, --reward format, --reward "
                "length, --reward FILE.py:FUNCTION or --reward model:DIR"
            )
        self.clip = grpo_loss.Clip(
            o.epsilon, o.epsilon_high or o.epsilon, o.beta, o.importance_sampling, o.kl_importance_correction
        )
        self.reward_names = metric_names(o.reward)
        self.weights = torch.tensor(o.reward_weights or [1.0] * len(o.reward), dtype=torch.float64)
        self.rewards = None  # the loaded functions (load_raw: before any model work, a bad file fails early)
        self.adapter = None  # beta > 0 with LoRA: the reference is the model with its adapters off
        self.reference_model = None  # beta > 0 without an adapter: a frozen copy
        self.as_chat = False
        self.window = StepWindow(len(o.reward))
        self.samples: list[dict] = []
        self._samples_started = False
        self._train_started: float | None = None
        self._keeps_logits: bool | None = None
        self._pad_id = 0  # the tokenizer's pad token (tokenize sets it)
        self._rollout: Rollout | None = None  # num_iterations > 1: the generated batch the next steps reuse
        self._warned_unscorable = False
        self._check_reuse(config)

    @property
    def pads_batches(self) -> bool:
        return True

    @property
    def updates_per_batch(self) -> int:
        return self.options.num_iterations

    def _check_reuse(self, config) -> None:
        """With num_iterations mu, a checkpoint must fall after a generated batch's last update: a resume cannot
        rebuild the log-probs of a batch sampled by weights it no longer has."""
        mu = self.options.num_iterations
        if mu == 1:
            return
        for flag, value in (("--save-steps", config.save_steps), ("--max-steps", config.max_steps)):
            uses = flag == "--max-steps" or config.save_strategy == "steps"
            if uses and value and value % mu:
                raise ConfigError(
                    f"{flag} {value} is not a multiple of --num-iterations {mu}: each generated batch trains {mu} "
                    f"steps, and a checkpoint between them could not be resumed exactly; use a multiple of {mu}"
                )

    def load_tokenizer(self):
        tokenizer = super().load_tokenizer()
        if self.options.chat_template:
            chat.set_chat_template(tokenizer, self.options.chat_template, self.model_path())
        fmt = self.options.prompt_format
        self.as_chat = fmt == "chat" or (fmt == "auto" and bool(getattr(tokenizer, "chat_template", None)))
        if self.as_chat and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"--prompt-format chat: the tokenizer of {self.model_path()!r} has no chat template; pass "
                "--chat-template FILE or --prompt-format text"
            )
        return tokenizer

    def resolve_block_size(self) -> int:
        """The longest sequence trained on: max_prompt_length + max_completion_length, within the context."""
        from tuneforge.artifacts import context_length

        o = self.options
        want, limit = o.max_prompt_length + o.max_completion_length, context_length(self._model_config())
        if limit and want > limit:
            raise ConfigError(
                f"--max-prompt-length {o.max_prompt_length} + --max-completion-length {o.max_completion_length} = "
                f"{want} tokens is above the model's context of {limit}; lower either"
            )
        self.block_size = want
        return want

    # ---- raw data --------------------------------------------------------------------------
    def load_raw(self) -> datasets.DatasetDict:
        import datasets

        self._load_rewards()
        splits = self.read_given_files(
            "prompts: pass --train-file prompts.jsonl (rows with `prompt`: text or messages, plus the columns your "
            "rewards read) and --validation-file",
            lambda path, split: self._read(path),
        )
        return datasets.DatasetDict(self.hold_out_if_needed(splits, "prompt"))

    def _load_rewards(self) -> None:
        o = self.options
        settings = RewardSettings(
            format_pattern=o.format_pattern, target_length=o.target_length, answer_column=o.answer_column
        )
        self.rewards = load_rewards(o.reward, settings)

    def _read(self, path: str) -> datasets.Dataset:
        rows = chat.read_rows(path, "prompt data", "--task grpo")
        return self._as_dataset(rows, repr(str(path)))

    def prepare_raw(self, splits: dict) -> datasets.DatasetDict:
        import datasets

        if self.rewards is None:
            self._load_rewards()
        out = {}
        for split, ds in splits.items():
            if ds is not None:
                out[split] = self._as_dataset(ds.to_list(), f"the {split} dataset")
        return datasets.DatasetDict(out)

    def _as_dataset(self, rows: list[dict], where: str) -> datasets.Dataset:
        """Rows as (prompt JSON, the other columns' JSON, row number); each row checked: a prompt, and every
        column a reward function needs."""
        import datasets

        key, needed = self.options.prompt_column, sorted({c for f in self.rewards for c in f.columns})
        if not rows:
            raise DataError(f"{where} holds no rows")
        prompts, columns = [], []
        for n, row in enumerate(rows, 1):
            field = key if key in row else "messages" if key == "prompt" and "messages" in row else None
            if field is None or row[field] in (None, "", []):
                raise DataError(
                    f"{where}, row {n}: no prompt in column {key!r} (it has: {', '.join(row) or 'no fields'}); "
                    "give each row a `prompt` (text or messages) or name the column with --prompt-column"
                )
            missing = [c for c in needed if c not in row]
            if missing:
                user = next(f.name for f in self.rewards if missing[0] in f.columns)
                hint = (
                    "--answer-column names the accuracy reward's"
                    if user == "accuracy"
                    else "a parameter without a default"
                )
                raise DataError(f"{where}, row {n}: no column {missing[0]!r}, which reward {user!r} reads ({hint})")
            prompt = row[field]
            if not isinstance(prompt, (str, list)):
                raise DataError(
                    f"{where}, row {n}: column {field!r} holds a {type(prompt).__name__}; a prompt is text or a list "
                    "of messages"
                )
            if not isinstance(prompt, str):
                prompt = chat.to_conversation(
                    {"messages": prompt}, "messages", f"{where}, row {n}", need_assistant=False
                )
            prompts.append(json.dumps(prompt))
            columns.append(json.dumps({k: v for k, v in row.items() if k != field}, default=str))
        return datasets.Dataset.from_dict({"prompt": prompts, "columns": columns, "row": list(range(1, len(rows) + 1))})

    # ---- features --------------------------------------------------------------------------
    def _render(self, tokenizer, prompt) -> list[int]:
        """A prompt's token ids: rendered with the chat template (with the generation prompt) where prompts are
        chat, else the text as written."""
        system = self.options.system_prompt
        if self.as_chat:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            if system and (not messages or messages[0].get("role") != "system"):
                messages = [{"role": "system", "content": system}, *messages]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return tokenizer(text, add_special_tokens=False)["input_ids"]
        if not isinstance(prompt, str):
            raise DataError(
                "a prompt is a list of messages and --prompt-format is text; use --prompt-format chat (or auto)"
            )
        return tokenizer(prompt)["input_ids"]

    def _rendered(self, tokenizer, prompt: str, row: int, split: str) -> list[int]:
        """`_render` of a row's JSON prompt; a chat template that fails on it (its raise_exception, or an error in
        its own code) names the template and the row."""
        try:
            return self._render(tokenizer, json.loads(prompt))
        except UserError:  # _render's own refusals name their fix already
            raise
        except Exception as err:
            where = repr(self.files[split]) if self.files.get(split) else f"the {split} data"
            raise chat.template_error(err, chat.template_name(self.config), row, where) from None

    def _check_text_prompts(self, raw) -> None:
        """ConfigError naming the first row whose prompt is a list of messages when prompts are rendered as text,
        and why they are (the flag, or a tokenizer without a template), before any split is tokenized."""
        if self.as_chat:
            return
        for split, ds in raw.items():
            row = next((n for n, p in zip(ds["row"], ds["prompt"]) if p.startswith("[")), None)  # JSON: a list
            if row is None:
                continue
            where = repr(self.files[split]) if self.files.get(split) else f"the {split} data"
            why, fix = "--prompt-format text", "use --prompt-format chat (or auto)"
            if self.options.prompt_format != "text":
                why = f"the tokenizer of {self.model_path()!r} has no chat template to render it"
                fix = "pass --chat-template FILE (a Jinja template, e.g. ChatML)"
            raise ConfigError(f"row {row} of {where}: the prompt is a list of messages, but {why}; {fix}")

    def tokenize(self, raw, tokenizer, log=print):
        import datasets

        self.resolve_block_size()
        self._check_text_prompts(raw)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._pad_id = pad if pad is not None else 0
        limit = self.options.max_prompt_length

        def encoder(split: str):
            def fn(batch):
                rows = zip(batch["prompt"], batch["row"])
                whole = [self._rendered(tokenizer, prompt, row, split) for prompt, row in rows]
                ids = [x[-limit:] for x in whole]  # (TRL's: a prompt keeps its last tokens)
                cut = [len(x) > limit for x in whole]  # counted in the log line, then dropped
                return {**batch, "prompt_ids": ids, "length": [len(x) for x in ids], "prompt_cut": cut}

            return fn

        settings = {
            "task": "grpo",
            "template": getattr(tokenizer, "chat_template", None) if self.as_chat else None,
            "system": self.options.system_prompt,
            "max_prompt_length": limit,
            "cut_flags": True,
        }
        cuts = [Cut("prompt_cut", "prompts", "max_prompt_length", limit, "--max-prompt-length", kept="last")]
        out = {}
        for split, ds in raw.items():
            fn = encoder(split)
            feats = self.tokenize_split(split, ds, ["prompt", "columns", "row"], fn, tokenizer, settings, log)
            out[split] = report_cuts(split, feats, cuts, log)
            log(f"{split}: {len(out[split])} prompts")
        return datasets.DatasetDict(out)

    def collate(self, rows, tokenizer):
        return {k: rows[k] for k in ("prompt_ids", "prompt", "columns", "row")}

    # ---- one step: generate, score, build the training rows ---------------------------------
    def prepare_step(self, batches: list[dict], tools: StepTools) -> list[dict]:
        key = (tools.epoch, tuple(r for b in batches for r in b["row"]))
        if self._rollout is not None and self._rollout.key == key and self._rollout.uses < self.options.num_iterations:
            self._rollout.uses += 1  # num_iterations: the same completions, against their sampling log-probs
            return self._rollout.batches
        started = time.perf_counter()
        if self._train_started is not None:  # the last step's training ran since its generation ended
            self.window.train_s += started - self._train_started
        out = self._generate_and_score(batches, tools, started)
        if self.options.num_iterations > 1:
            self._rollout = Rollout(key, out, uses=1)
        self._train_started = time.perf_counter()
        return out

    def _generate_and_score(self, batches: list[dict], tools: StepTools, started: float) -> list[dict]:
        g, o = self.options.num_generations, self.options
        prompts = [ids for b in batches for ids in b["prompt_ids"]]
        rows = [r for b in batches for r in b["row"]]
        sampling = {"max_tokens": o.max_completion_length, "temperature": o.temperature, "top_p": o.top_p}
        settings = [{**sampling, "seed": sample_seed(tools.seed, tools.epoch, r, k)} for r in rows for k in range(g)]
        completions = checked(tools.complete([p for p in prompts for _ in range(g)], settings))
        self.window.gen_s += time.perf_counter() - started
        state = trainer_state(tools.step - 1, tools.max_steps, tools.epoch)  # TRL: the steps done before this one
        per_function = self._score(batches, completions, g, state)
        rewards = grpo_loss.total_rewards(per_function, self.weights)
        batch_std = self._batch_std(rewards, tools) if o.scale_rewards == "batch" else None
        advantages, flat = grpo_loss.group_advantages(rewards, g, o.scale_rewards, batch_std)
        self.window.add_rollout(per_function, rewards, flat, completions, g)
        self._keep_samples(tools.step, batches, completions, per_function, rewards, advantages)
        out, k = [], 0
        for b in batches:
            n = len(b["prompt_ids"]) * g
            prompt_ids = [p for p in b["prompt_ids"] for _ in range(g)]
            out.append(self._training_batch(prompt_ids, completions[k : k + n], advantages[k : k + n], tools))
            k += n
        return out

    def _completion_ids(self, completion) -> list[int]:
        """The tokens trained on: the generated ones and the end-of-sequence token that ended them (the model
        learns to stop)."""
        ids = list(completion.token_ids)
        return ids + [completion.stop_token] if completion.stop_token is not None else ids

    def _score(self, batches: list[dict], completions, g: int, state=None) -> torch.Tensor:
        """[completions, functions] rewards (nan: not applicable) of `g` completions per prompt of `batches`; `state`
        is the `trainer_state` the functions get."""
        prompts = [json.loads(p) for b in batches for p in b["prompt"] for _ in range(g)]
        columns_rows = [json.loads(c) for b in batches for c in b["columns"] for _ in range(g)]
        # TRL's rule: a prompt of messages gets its completion as one assistant message, a text prompt as text
        # (also where the chat template renders it)
        as_message = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
        texts = [c.text if isinstance(p, str) else as_message(c.text) for p, c in zip(prompts, completions)]
        names = sorted({k for row in columns_rows for k in row})
        columns = {k: [row.get(k) for row in columns_rows] for k in names}
        columns["completion_ids"] = [self._completion_ids(c) for c in completions]  # with the EOS, as TRL's
        table = score(self.rewards, prompts, texts, columns, state)
        self._warn_unscorable(table, prompts)
        return table

    def _warn_unscorable(self, table: torch.Tensor, prompts: list) -> None:
        """TRL's warning for completions that every reward function returned None for (they train nothing), once a
        run."""
        unscorable = torch.isnan(table).all(dim=1)
        if self._warned_unscorable or not unscorable.any():
            return
        self._warned_unscorable = True
        first = int(unscorable.nonzero()[0])
        log.warning(
            "every reward function returned None for %d of %d completions (the first of prompt %s): they have no "
            "reward and train nothing; make at least one reward apply to each (warned once a run)",
            int(unscorable.sum()),
            len(prompts),
            quoted_prompt(prompts[first]),
        )

    @staticmethod
    def _batch_std(rewards: torch.Tensor, tools: StepTools) -> torch.Tensor:
        """The unbiased std of every completion's reward in the step, over all ranks (nan rewards left out)."""
        valid = rewards[~torch.isnan(rewards)]
        local = torch.stack([valid.sum(), (valid**2).sum(), torch.tensor(float(valid.numel()), dtype=valid.dtype)])
        s, sq, n = tools.reduce_sum(local.to(tools.device)).cpu().tolist()
        if n < 2:
            return torch.tensor(0.0, dtype=torch.float64)
        return torch.tensor(max(0.0, (sq - s * s / n) / (n - 1)), dtype=torch.float64).sqrt()

    def _training_batch(self, prompt_ids, completions, advantages, tools: StepTools) -> dict:
        """Rows of [prompt, left-padded | completion, right-padded] with positions counted from each row's first
        real token, the completion tokens' mask and each row's advantage; with beta > 0, the reference's log-probs."""
        ids = [self._completion_ids(c) for c in completions]
        width_p, width_c = max(map(len, prompt_ids)), max(1, max(map(len, ids)))
        pad = self._pad_id
        rows, attention, tokens, mask = [], [], [], []
        for p, c, comp in zip(prompt_ids, ids, completions):
            rows.append([pad] * (width_p - len(p)) + p + c + [pad] * (width_c - len(c)))
            attention.append([0] * (width_p - len(p)) + [1] * (len(p) + len(c)) + [0] * (width_c - len(c)))
            tokens.append(c + [pad] * (width_c - len(c)))
            keep = not (self.options.mask_truncated_completions and comp.finish_reason == "length")
            mask.append([float(keep)] * len(c) + [0.0] * (width_c - len(c)))
        attention_mask = torch.tensor(attention)
        batch = {
            "input_ids": torch.tensor(rows),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "completion_ids": torch.tensor(tokens),
            "completion_mask": torch.tensor(mask),
            "advantages": advantages.float(),
        }
        batch = {k: v.to(tools.device) for k, v in batch.items()}
        if self.clip.beta != 0.0:
            batch["ref_logps"] = self._reference_logps(tools, batch)
        if self.options.num_iterations > 1:  # the later updates compare with the policy that sampled
            with torch.no_grad(), tools.autocast():
                batch["old_logps"] = self._logps(tools.model, batch)
        return batch

    # ---- the reference (beta > 0) ------------------------------------------------------------
    def set_up_reference(self, model, adapter) -> None:
        if self.clip.beta == 0.0:
            return  # no KL term: no reference at all
        if adapter is not None:
            self.adapter = adapter
        else:
            self.reference_model = copy.deepcopy(model).requires_grad_(False).eval()

    @torch.no_grad()
    def _reference_logps(self, tools: StepTools, batch: dict) -> torch.Tensor:
        with tools.autocast():
            if self.adapter is not None:
                with self.adapter.disabled():
                    return self._logps(tools.model, batch)
            if next(self.reference_model.parameters()).device != tools.device:
                self.reference_model.to(tools.device)
            return self._logps(self.reference_model, batch)

    # ---- the loss ----------------------------------------------------------------------------
    def _logps(self, model, batch) -> torch.Tensor:
        """The completion tokens' log-probabilities under `model` ([R, C])."""
        width = batch["completion_ids"].shape[1]
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")} | no_cache(model)
        if self._keeps_logits is None:
            forward = getattr(model, "module", model).forward
            self._keeps_logits = "logits_to_keep" in inspect.signature(forward).parameters
        if self._keeps_logits:  # only the completion's logits: the [R, length, vocabulary] tensor is the largest
            inputs["logits_to_keep"] = width + 1
        logits = model(**inputs).logits[:, -(width + 1) : -1]
        return grpo_loss.token_logps(logits, batch["completion_ids"], self.options.temperature)

    def forward(self, model, batch):
        return self._logps(model, batch)

    def compute_loss(self, outputs, batch, row_mask=None):
        logps, mask = outputs, batch["completion_mask"]
        old = batch["old_logps"] if "old_logps" in batch else logps.detach()  # on-policy: ratio 1
        terms = grpo_loss.token_losses(logps, old, batch["advantages"], mask, self.clip, batch.get("ref_logps"))
        self.window.add_loss_terms(terms, mask, batch["advantages"], batch["attention_mask"], self.clip)
        o = self.options
        return grpo_loss.loss_sum_and_count(terms.loss, mask, o.loss_type, o.max_completion_length)

    def count(self, batch) -> torch.Tensor:
        return grpo_loss.step_count(
            batch["completion_mask"], self.options.loss_type, self.options.max_completion_length
        )

    # ---- logs and samples --------------------------------------------------------------------
    def train_logs(self, backend, step: int) -> dict:
        if self._train_started is not None:  # the training since the last generation, up to this log line
            now = time.perf_counter()
            self.window.train_s += now - self._train_started
            self._train_started = now
        windows = backend.gather_objects(self.window.settled())
        self.window = StepWindow(len(self.reward_names))
        logs = StepWindow.merged(windows).logs(self.reward_names, self.clip.beta != 0.0)
        if backend.is_main:
            self._write_samples(step)
        self.samples = []
        return logs

    def _keep_samples(self, step, batches, completions, per_function, rewards, advantages) -> None:
        n = self.options.logged_samples
        if not n:
            return
        g = self.options.num_generations
        prompts = [p for b in batches for p in b["prompt"] for _ in range(g)]
        self.samples = [
            {
                "step": step,
                "prompt": json.loads(prompts[i]),
                "completion": completions[i].text,
                "finish_reason": completions[i].finish_reason,
                "rewards": {
                    name: (None if torch.isnan(v) else float(v)) for name, v in zip(self.reward_names, per_function[i])
                },
                "reward": None if torch.isnan(rewards[i]) else float(rewards[i]),
                "advantage": float(advantages[i]),
            }
            for i in range(min(n, len(completions)))
        ]

    def _write_samples(self, step: int) -> None:
        if not self.samples:
            return
        path = Path(self.config.output_dir) / SAMPLES_FILE
        lines = [json.dumps(s) for s in self.samples]
        if not self._samples_started and path.is_file():  # a resumed run: the interrupted one's later lines go
            kept = [line for line in _whole_lines(path) if json.loads(line)["step"] < step]
            write_text(path, "".join(x + "\n" for x in kept), durable=False)  # whole: a kill keeps the lines before
        self._samples_started = True
        with path.open("a") as f:
            f.write("".join(x + "\n" for x in lines))

    # ---- evaluation ---------------------------------------------------------------------------
    def eval_step(self, batch, valid, stream, tools) -> None:
        """Greedy completions of the batch's prompts, scored by every reward function."""
        if tools.complete is None:
            raise ConfigError("--task grpo evaluates with the generation engine; evaluate through the Trainer")
        params = {"max_tokens": self.options.max_completion_length, "temperature": 0.0}
        completions = checked(tools.complete(batch["prompt_ids"], [params] * len(batch["prompt_ids"])))
        per_function = self._score([batch], completions, 1, trainer_state(tools.step, tools.max_steps, tools.epoch))
        stream.update((per_function, grpo_loss.total_rewards(per_function, self.weights)), batch, valid)

    def metric_stream(self):
        return RewardStream(eval_keys(self.options.reward, self.reward_names))

    def export_info(self) -> dict:
        return {"task": self.config.task, "block_size": self.block_size, **self.capabilities()}


@dataclass
class Rollout:
    """A generated and scored batch kept for the next num_iterations - 1 steps: `key` names the step's data
    (epoch, rows), `uses` the steps that trained on it so far."""

    key: tuple
    batches: list[dict]
    uses: int


# clip_count: the clip ratios' denominator, the mask's tokens (per-token ratio) or the rows (GSPO's, as TRL counts)
LOSS_TERMS = ("clip_low", "clip_high", "clip_region", "clip_count", "loss_tokens", "kl", "train_tokens")


class StepWindow:
    """One rank's sums since the last log line (picklable: the ranks' windows are gathered and added)."""

    def __init__(self, functions: int) -> None:
        self.functions = functions
        # each generated step's [completions, functions + 1] rewards (the last column the total; nan: none): TRL
        # logs each step's means and stds, averaged over the window
        self.reward_steps: list[torch.Tensor] = []
        self.values: dict[str, float] = dict.fromkeys(
            ("completions", "tokens", "truncated", "groups", "flat_groups", *LOSS_TERMS), 0.0
        )
        self.loss_terms: torch.Tensor | None = None  # LOSS_TERMS' sums on the training device (`settled` reads them)
        self.longest = 0
        self.gen_s = self.train_s = 0.0

    def add_rollout(self, per_function, rewards, flat, completions, group: int) -> None:
        v = self.values
        self.reward_steps.append(torch.cat([per_function, rewards.unsqueeze(1)], dim=1).double().cpu())
        lengths = [len(c.token_ids) + (c.stop_token is not None) for c in completions]
        v["completions"] += len(lengths)
        v["tokens"] += sum(lengths)
        v["truncated"] += sum(c.finish_reason == "length" for c in completions)
        v["groups"] += len(lengths) // group
        v["flat_groups"] += float(flat.view(-1, group)[:, 0].sum())
        self.longest = max(self.longest, *lengths)

    def add_loss_terms(self, terms, mask, advantages, attention_mask, clip) -> None:
        """A micro-batch's clipped tokens, KL and token counts, added on its device (no host copy per micro-batch)."""
        with torch.no_grad():
            ratio, adv = terms.ratio, advantages.unsqueeze(1)
            low = (ratio < 1 - clip.epsilon) & (adv < 0)
            high = (ratio > 1 + clip.epsilon_high) & (adv > 0)
            # TRL: a sequence-level ratio's clip ratios are shares of the rows (all of them), a token's of the mask
            weight = mask.new_ones(ratio.shape) if clip.importance_sampling == "sequence" else mask
            clipped = [(low * weight).sum(), (high * weight).sum(), ((low | high) * weight).sum(), weight.sum()]
            kl = (terms.kl * mask).sum() if terms.kl is not None else mask.new_zeros(())
            sums = [*clipped, mask.sum(), kl]
            row = torch.stack([*(x.double() for x in sums), attention_mask.sum().double()])
            self.loss_terms = row if self.loss_terms is None else self.loss_terms + row

    def settled(self) -> StepWindow:
        """The window with its device sums read into `values` (one host copy, at a log line)."""
        if self.loss_terms is not None:
            for name, value in zip(LOSS_TERMS, self.loss_terms.tolist()):
                self.values[name] += value
            self.loss_terms = None
        return self

    @classmethod
    def merged(cls, windows: list[StepWindow]) -> StepWindow:
        out = cls(windows[0].functions)
        # the ranks' rewards of one step together (every rank generates at the same steps; none is no crash)
        none = torch.empty(0, out.functions + 1, dtype=torch.float64)
        steps = itertools.zip_longest(*(w.reward_steps for w in windows), fillvalue=none)
        out.reward_steps = [torch.cat(tables) for tables in steps]
        for w in windows:
            for k in out.values:
                out.values[k] += w.values[k]
            out.longest = max(out.longest, w.longest)
            out.gen_s, out.train_s = max(out.gen_s, w.gen_s), max(out.train_s, w.train_s)  # ranks run at once
        return out

    def logs(self, names: list[str], with_kl: bool) -> dict:
        """The window's log values: rewards and completions where a batch was generated in it (num_iterations
        reuses batches), clipping and KL where one was trained on."""
        v, out = self.values, {}
        if v["completions"]:
            for i, key in enumerate([f"reward_{name}" for name in names] + ["reward"]):
                out[key], out[f"{key}_std"] = _step_mean_std(self.reward_steps, i)
            out["completion_length"] = v["tokens"] / v["completions"]
            out["completion_length_max"] = self.longest
            out["truncated"] = v["truncated"] / v["completions"]
            out["flat_groups"] = v["flat_groups"] / max(1.0, v["groups"])
            out["gen_tokens_per_s"] = round(v["tokens"] / self.gen_s, 1) if self.gen_s else None
        if v["clip_count"]:
            count = v["clip_count"]
            out.update(clip_ratio=v["clip_region"] / count, clip_low=v["clip_low"] / count)
            out["clip_high"] = v["clip_high"] / count
        if v["loss_tokens"] and with_kl:
            out["kl"] = v["kl"] / v["loss_tokens"]
        out["train_tokens_per_s"] = round(v["train_tokens"] / self.train_s, 1) if self.train_s else None
        return out


def _step_mean_std(steps: list[torch.Tensor], column: int) -> tuple[float | None, float | None]:
    """TRL's logged mean and std of a reward: each step's mean and unbiased std of the rewards there are (none
    where there is none, or one only for the std), averaged over the steps that have one."""

    def averaged(values: list[float]) -> float | None:
        kept = [x for x in values if x == x]  # (nan: the step had none)
        return sum(kept) / len(kept) if kept else None

    means = [float(torch.nanmean(table[:, column])) for table in steps]
    return averaged(means), averaged([float(grpo_loss.nanstd(table[:, column])) for table in steps])


def _whole_lines(path: Path) -> list[str]:
    """The lines of a JSON-lines file an interrupted run appended to, but its last where a kill tore it."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line]
    if lines:
        try:
            json.loads(lines[-1])
        except ValueError:
            lines.pop()
    return lines
