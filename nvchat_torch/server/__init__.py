"""The realtime server: ``python -m nvchat_torch.server`` (needs the ``server`` extra)."""

from .app import MAX_MESSAGE_BYTES, RealtimeServer, create_app
from .scheduler import FrameScheduler

__all__ = ["create_app", "RealtimeServer", "FrameScheduler", "MAX_MESSAGE_BYTES"]
