"""The task registry: task names, the class of each (imported on demand), the default task, which task the
data files point to, and which tasks own each option.

Task families: classification (GLUE, BBC News, files), causal LM, chat SFT, DPO, sequence-to-sequence,
NER, extractive question answering, multiple choice, sentence embeddings. Each declares its own settings as an
`Options` model (a `TaskOptions`)."""

from __future__ import annotations

import importlib

from tuneforge.errors import ConfigError

# task name (or prefix) -> "module:Class"
TASKS = {
    "bbc-news": "tuneforge.tasks.classification:ClassificationTask",
    "classification": "tuneforge.tasks.classification:ClassificationTask",
    "regression": "tuneforge.tasks.classification:ClassificationTask",
    "glue/": "tuneforge.tasks.classification:ClassificationTask",
    "clm": "tuneforge.tasks.clm:CausalLMTask",
    "sft": "tuneforge.tasks.sft:ChatSFTTask",
    "dpo": "tuneforge.tasks.dpo:DPOTask",
    "grpo": "tuneforge.tasks.grpo:GRPOTask",
    "reward": "tuneforge.tasks.reward:RewardModelTask",
    "seq2seq": "tuneforge.tasks.seq2seq:Seq2SeqTask",
    "ner": "tuneforge.tasks.ner:TokenClassificationTask",
    "qa": "tuneforge.tasks.qa:QuestionAnsweringTask",
    "multiple-choice": "tuneforge.tasks.multiple_choice:MultipleChoiceTask",
    "embedding": "tuneforge.tasks.embedding:EmbeddingTask",
}


DEFAULT_TASK = "bbc-news"  # a run that names no task and no data: the demo


def infer_task(data_file: str | None, options: dict) -> str | None:
    """The task the data files point to when none is given: parallel source files seq2seq, a .txt data file clm,
    another data file classification. `data_file`: the training file (an evaluation's: its validation file).
    `options`: the options keys given (name -> value)."""
    if options.get("source_file"):
        return "seq2seq"
    if data_file:
        name = str(data_file).lower().removesuffix(".gz").removesuffix(".zst")  # (train.txt.gz is text too)
        return "clm" if name.endswith(".txt") else "classification"
    return None


def task_classes() -> dict[str, type]:
    """{name: class} of every registered task (GLUE's tasks as glue/NAME)."""
    shown = [name + "NAME" if name.endswith("/") else name for name in TASKS]
    return {name: task_class(name) for name in shown}


def task_option_owners() -> dict[str, list[str]]:
    """{option name: the tasks whose `Options` have it}, e.g. {"doc_stride": ["qa"]}."""
    owners: dict[str, list[str]] = {}
    for name, cls in task_classes().items():
        for option in cls.Options.model_fields:
            owners.setdefault(option, []).append(name)
    return owners


def task_names() -> list[str]:
    from tuneforge.tasks.glue import GLUE

    return [k for k in TASKS if not k.endswith("/")] + [f"glue/{g}" for g in GLUE]


def task_class(name: str):
    """The Task class of a task name (`glue/mrpc`, `ner`, ...), imported on demand."""
    target = TASKS.get(name) or next((v for k, v in TASKS.items() if k.endswith("/") and name.startswith(k)), None)
    if target is None:
        raise ConfigError(f"unknown task {name!r}; choose one of: {', '.join(task_names())}")
    module, cls = target.split(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name == module:
            raise ConfigError(f"task {name!r} is not available in this build of tuneforge") from None
        raise
    return getattr(mod, cls)


def get_task(config):
    return task_class(config.task)(config)
