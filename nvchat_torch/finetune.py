"""``python -m nvchat_torch.finetune``: the fine-tuning command, whose recipe is
:mod:`nvchat_torch.training.finetune` (docs/training.md)."""

from .training.finetune import *  # noqa: F401,F403
from .training.finetune import __all__, main

if __name__ == "__main__":
    raise SystemExit(main())
