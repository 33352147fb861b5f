"""One process on one device: cpu, cuda or mps, detected."""

from tuneforge.backends.base import Backend


class SingleBackend(Backend):
    name = "single"

    def check(self, model_config=None) -> None:
        from tuneforge.backends import distributed_hint
        from tuneforge.errors import ConfigError

        if self.config.nproc > 1 or self.config.nnodes > 1:
            raise ConfigError(f"backend 'single' runs one process; for --nproc > 1 use {distributed_hint()}")


BACKEND = SingleBackend
