"""The old name of :mod:`nvchat_torch.training.labels`, kept so that existing imports work."""

from .training.labels import *  # noqa: F401,F403
from .training.labels import __all__  # noqa: F401
