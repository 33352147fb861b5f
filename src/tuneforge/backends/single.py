"""One process on one device: cpu, cuda or mps, detected. (More than one process is refused by
`get_backend`, which knows the backends that run several.)"""

from tuneforge.backends.base import Backend


class SingleBackend(Backend):
    name = "single"


BACKEND = SingleBackend
