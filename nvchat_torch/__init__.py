"""nvchat_torch: a PyTorch port of NVIDIA NemotronLabs VoiceChat 11B (full-duplex speech-to-speech)."""

from .checkpoint import CheckpointError, load_checkpoint
from .config import ConfigError, VoiceChatConfig

__version__ = "0.1.0"

__all__ = ["CheckpointError", "ConfigError", "VoiceChatConfig", "load_checkpoint", "__version__"]
