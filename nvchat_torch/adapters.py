"""The old name of :mod:`nvchat_torch.training.adapters`, kept so that existing imports work."""

from .training.adapters import *  # noqa: F401,F403
from .training.adapters import __all__  # noqa: F401
