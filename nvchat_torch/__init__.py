"""nvchat_torch: a PyTorch port of NVIDIA NemotronLabs VoiceChat 11B (full-duplex speech-to-speech).

    import nvchat_torch as nv
    model = nv.load_model("weights/NemotronLabs-VoiceChat-11B-4bit")   # or nv.load_tiny_model()
    session = model.create_streaming_session(nv.StreamingOptions(system_prompt="Be concise."))
    events = session.push_audio(samples, 16000) + session.flush()
"""

from .engine import BatchEngine, EngineSession
from .events import ContextLimit, StreamingOptions, VoiceChatEvent, VoiceChatProfile, VoiceChatResult
from .loading.checkpoint import BadWeightsWarning, CheckpointError, load_checkpoint
from .model import VoiceChatModel, load_model
from .models.config import ConfigError, VoiceChatConfig
from .session import StreamingSession
from .tiny import load_tiny_model
from .tool_hold import ToolHold
from .turn_taking import TurnTaking, TurnTakingConfig

__version__ = "0.1.0"

__all__ = [
    "BadWeightsWarning",
    "BatchEngine",
    "EngineSession",
    "CheckpointError",
    "ConfigError",
    "ContextLimit",
    "StreamingOptions",
    "StreamingSession",
    "ToolHold",
    "TurnTaking",
    "TurnTakingConfig",
    "VoiceChatConfig",
    "VoiceChatEvent",
    "VoiceChatModel",
    "VoiceChatProfile",
    "VoiceChatResult",
    "load_checkpoint",
    "load_model",
    "load_tiny_model",
    "__version__",
]
