"""`BackendOptions`: the base of each backend's own settings (pydantic only, so config.py can import it
without torch or the backend registry)."""

from pydantic import BaseModel, ConfigDict


class BackendOptions(BaseModel):
    """A backend's own settings. Subclass it as `Options` in the backend class: each field (with its
    `description`) becomes a config key under `backend_options` (also accepted flat) and a CLI flag."""

    # inf and nan are refused, as in every config section; give each number an upper bound too
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
