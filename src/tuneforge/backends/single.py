"""One process on one device: cpu, cuda or mps, detected."""

from tuneforge.backends.base import Backend


class SingleBackend(Backend):
    name = "single"

    def validate(self) -> None:
        from tuneforge.errors import ConfigError

        if self.config.nproc > 1 or self.config.nnodes > 1:
            raise ConfigError(
                "backend 'single' runs one process; for --nproc > 1 use --backend ddp (or fsdp, deepspeed, tp)"
            )


BACKEND = SingleBackend
