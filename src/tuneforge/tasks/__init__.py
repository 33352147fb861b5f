"""Task families: classification (GLUE, BBC News, files), causal LM, chat SFT, DPO, sequence-to-sequence,
NER, extractive question answering, multiple choice."""

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
    "seq2seq": "tuneforge.tasks.seq2seq:Seq2SeqTask",
    "ner": "tuneforge.tasks.ner:TokenClassificationTask",
    "qa": "tuneforge.tasks.qa:QuestionAnsweringTask",
    "multiple-choice": "tuneforge.tasks.multiple_choice:MultipleChoiceTask",
}


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
