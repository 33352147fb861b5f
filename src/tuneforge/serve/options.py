"""`ServeOptions`: the server's settings and the `tuneforge serve` arguments that set them. Each default and bound
is written once, here: the CLI generates its flags from these fields (tuneforge.flags) and `create_app` takes
the instance. Imports nothing heavy: the CLI builds its parser from it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tuneforge.flags import POSITIONAL, input_max_length_field
from tuneforge.options import PATH
from tuneforge.processes import usable_cores

API_KEY_VARIABLE = "TUNEFORGE_API_KEY"
MAX_BATCH_SIZE = 32  # the defaults that the engine and the batcher take too (serve/engine.py, serve/batching.py)
MAX_QUEUE = 256

# the wording of each refusal, as the server has always said it
POSITIVE_UP_TO = {
    "low": "{flag} must be positive, got {value}",
    "high": "{flag} must be between {ge} and {le}, got {value}",
}
BETWEEN = "{flag} must be between {ge} and {le}, got {value}"


class ServeOptions(BaseModel):
    """`tuneforge serve`'s arguments: every number finite and bounded (a value outside is one line naming its
    flag); `served_model_name` left out is `model_dir` as given."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    model_dir: str = Field(
        description="a model folder tuneforge exported (OUTPUT_DIR/model, an adapter folder too)",
        json_schema_extra={**POSITIONAL, **PATH},
    )
    host: str = Field(
        "127.0.0.1",
        pattern=r"\S",  # uvicorn listens on every interface for "": an unset variable must not publish the server
        description="address to listen on (default: 127.0.0.1, this machine only)",
        json_schema_extra={"refusal": "{flag} is empty; give an address (0.0.0.0 listens on every interface)"},
    )
    port: int = Field(
        8000, ge=0, le=65535, description="port to listen on (0: any free one)", json_schema_extra={"refusal": BETWEEN}
    )
    max_length: int | None = input_max_length_field(
        "truncate inputs (default: the training max_length); a causal LM's prompt is never cut"
    )
    api_key: str | None = Field(
        None,
        pattern=r"\S",
        description=f"required on every route but /health (Authorization: Bearer KEY); default: ${API_KEY_VARIABLE}",
        json_schema_extra={"refusal": "{flag} (or " + API_KEY_VARIABLE + ") is empty; give a key or leave it unset"},
    )
    served_model_name: str | None = Field(
        None,
        pattern=r"\S",
        description="the model name of the OpenAI routes (default: MODEL_DIR as given)",
        json_schema_extra={"refusal": "{flag} is empty; give a name or leave it out"},
    )
    max_batch_size: int = Field(
        MAX_BATCH_SIZE,
        ge=1,
        le=65536,
        description="classifiers and sentence encoders: most inputs in one batch; generation: most sequences "
        "decoding together (1: batching off)",
        json_schema_extra={"refusal": POSITIVE_UP_TO},
    )
    # 0, as Triton's dynamic batcher defaults: no one waits, yet what queued during a forward shares the next one;
    # under 32 clients on 2 cores /v1/embeddings served 12-20% more than with a 10 ms wait in 5 runs of 6, /predict
    # the same (benchmarks/README.md, "`/v1/embeddings` under load")
    max_wait_ms: float = Field(
        0.0,
        ge=0,
        le=60_000,  # a classifier request waits at most a minute for others
        description="classifiers and sentence encoders: longest a request waits for others to join (0: none, "
        "but what queued during a forward shares the next one)",
        json_schema_extra={"refusal": "{flag} must be between {ge} and {le}, got {value:g}"},
    )
    max_queue: int = Field(
        MAX_QUEUE,
        ge=1,
        le=1_000_000,
        description="most requests (sequences) waiting; beyond it: 503 with Retry-After",
        json_schema_extra={"refusal": POSITIVE_UP_TO},
    )
    max_request_items: int = Field(1024, ge=1, json_schema_extra={"flag": None})
    max_body_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1,
        le=1 << 31,
        description="larger request bodies get 413",
        json_schema_extra={"refusal": POSITIVE_UP_TO},
    )
    request_timeout_s: float = Field(
        600.0,
        gt=0,
        le=86_400,  # a day
        description="seconds a request may take (then 504)",
        json_schema_extra={
            "flag": "--request-timeout",
            "flag_kwargs": {"metavar": "REQUEST_TIMEOUT"},
            "refusal": {
                "low": "{flag} must be above {gt} seconds, got {value:g}",
                "high": "{flag} must be at most {le} seconds (a day), got {value:g}",
            },
        },
    )
    default_max_tokens: int = Field(
        512,
        ge=1,
        le=1 << 20,
        description="a chat completion's max_tokens when the request gives none and the model's generation config "
        "no max_new_tokens (completions: 16, as OpenAI)",
        json_schema_extra={"refusal": POSITIVE_UP_TO},
    )
    # vLLM's --generation-config (auto by default since 0.7): a Qwen or Llama instruct model samples as its makers
    # recommend, not hotter at OpenAI's temperature 1
    generation_config: Literal["auto", "none"] = Field(
        "auto",
        description="a generative model's defaults for the sampling fields a request leaves out: auto takes "
        "temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as max_tokens) from its "
        "generation_config.json, as vLLM; none: OpenAI's (temperature 1, top_p 1)",
    )
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="a generative model's weights, every other model's linear layers (under autocast) while "
        "serving: auto is bf16 where the hardware does bf16 natively (AMX or AVX512-BF16 CPUs, CUDA since Ampere; "
        "fp16 on older CUDA), else fp32; fp32 for log-probs, vectors or scores equal to an fp32 forward pass",
    )
    threads: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="CPU threads of the model's forward passes (torch's intra-op threads), at most the cores this "
        "process may use; default: for classifiers and sentence encoders (the batched routes) every core but one, "
        "which the HTTP server keeps (OpenMP's waiting threads would take it), for generation every core",
        json_schema_extra={"refusal": POSITIVE_UP_TO},
    )
    pack_weights: bool = Field(
        True,
        description="on a CPU, run each of the model's linear layers whose weight shape computes faster that way "
        "on oneDNN's packed copy of its weight (each shape timed both ways once at start-up, at --max-batch-size "
        "rows)",
    )
    log_format: Literal["text", "json"] = Field(
        "text", description="the access log's lines on stderr: text for people, json (an object a line) for machines"
    )

    @model_validator(mode="after")
    def _threads_within_the_cores(self):
        """--threads above the cores this process may use (its affinity, as training counts them): torch started
        every one, and threads that share a core wait for each other at each forward's barrier. Checked here, where
        the CLI's flags and the Python API's options both enter."""
        cores = usable_cores()
        if self.threads is not None and self.threads > cores:
            raise ValueError(
                f"--threads {self.threads} is above the {cores} cores this process may use; pass --threads {cores} "
                "or less"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _name_the_model(cls, values):
        """No --served-model-name: the OpenAI routes name the model MODEL_DIR as given."""
        if isinstance(values, dict) and values.get("served_model_name") is None:
            values = {**values, "served_model_name": values.get("model_dir")}
        return values
