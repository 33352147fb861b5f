"""lm-evaluation-harness through `tuneforge serve`: its `local-completions` model (token-id prompts, `echo`,
`logprobs`) scores the harness's own PIQA task (the local copy in ../shared/data) against the real server, and
the scores equal the harness's in-process ones on the same model folder (tuneforge/harness/)."""

from __future__ import annotations

import pytest

from test_serve_generate import app_server, wait_ready

ROWS = 12


def test_piqa_through_the_server_scores_as_in_process(long_llama, shared_data):
    from tuneforge.harness.evaluate import load_lm, run_harness
    from tuneforge.harness.options import HarnessSettings

    settings = HarnessSettings(tasks=["piqa"], data={"piqa": str(shared_data / "piqa")}, limit=ROWS, batch_size=4)
    in_process = run_harness(load_lm(long_llama, batch_size=4), settings)["results"]["piqa"]
    with app_server(long_llama, served_model_name="tiny", max_batch_size=8) as url:
        wait_ready(url)
        served = run_harness(
            "local-completions",
            settings,
            model_args={
                "model": "tiny",
                "base_url": f"{url}/v1/completions",
                "tokenizer": long_llama,
                "tokenizer_backend": "huggingface",
                "num_concurrent": 4,
                "max_retries": 1,
            },
        )["results"]["piqa"]
    assert in_process["acc,none"] not in (0.0, 1.0)  # a score that can move
    for metric in ("acc,none", "acc_norm,none"):
        assert served[metric] == pytest.approx(in_process[metric], abs=1e-9), metric
