"""The realtime server: ``python -m nvchat_torch.server`` (needs the ``server`` extra).

Importing this package needs nothing beyond the core install; ``create_app`` needs FastAPI.
"""

from .scheduler import FrameScheduler

__all__ = ["create_app", "FrameScheduler"]


def __getattr__(name: str):
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(name)
