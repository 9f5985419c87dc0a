"""Fine-tuning (docs/training.md): ``labels`` turns conversations into NeMo's frame labels,
``objectives`` runs the teacher-forced forwards and NVIDIA's losses, ``adapters`` adds LoRA, and
``finetune`` is the command (``python -m nvchat_torch.finetune``).

``nvchat_torch.training`` keeps the objectives' names, as it had them before it was a package."""

from .objectives import (
                         STTLossConfig,
                         STTOutput,
                         TTSLossConfig,
                         TTSOutput,
                         masking_rate,
                         prompt_ids,
                         quantizer_masks,
                         stt_forward,
                         stt_loss,
                         teacher_forced_codes,
                         tts_forward,
                         tts_loss,
                         user_frames,
)

__all__ = ["STTOutput", "TTSOutput", "STTLossConfig", "TTSLossConfig", "prompt_ids", "user_frames",
           "stt_forward", "tts_forward", "teacher_forced_codes", "stt_loss", "tts_loss", "masking_rate",
           "quantizer_masks"]
