"""generation_defaults.py: a model's sampling defaults are held to the bounds of the API the server speaks."""

from __future__ import annotations

import pytest

from tuneforge.generation_defaults import Bounds, checked_defaults
from tuneforge.serve.openai_api import SamplingRequest

API_NAMES = {"max_new_tokens": "max_tokens"}


@pytest.mark.parametrize("name", list(Bounds.model_fields))
def test_each_fields_bounds_are_the_apis(name):
    """A value the file may give is exactly one a request may give (their schemas' bounds and types agree)."""
    ours = Bounds.model_json_schema()["properties"][name]
    theirs = SamplingRequest.model_json_schema()["properties"][API_NAMES.get(name, name)]
    assert {k: v for k, v in ours.items() if k not in ("title", "description")} == {
        k: v for k, v in theirs.items() if k not in ("title", "description")
    }


def test_a_value_out_of_bounds_is_dropped_from_the_config_and_an_int_temperature_read_as_a_float():
    from transformers import GenerationConfig

    config = GenerationConfig(temperature=1, top_p=1.5, top_k=20, do_sample=True)
    defaults = checked_defaults(config)
    assert defaults.values == {"temperature": 1.0, "top_k": 20} and isinstance(config.temperature, float)
    assert config.top_p is None and defaults.notes == (
        "generation_config.json's top_p 1.5 is left out (input should be less than or equal to 1)",
    )
    assert defaults.served() == {"temperature": 1.0, "top_k": 20}
