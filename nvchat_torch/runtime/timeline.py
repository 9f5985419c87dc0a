"""The LLM and TTS timeline of one conversation at batch 1, as the reference runs it: the system
prompt's prefill (the prompt on the user channel, the output channels at PAD) and the offline turn's
steps. A streaming session's frames then run as a row of a :class:`~nvchat_torch.runtime.frame_step.FrameStep`,
which takes over the prefilled caches."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..diagnostics import return_freed_memory
from ..models.language_heads import fused_input, language_heads
from ..models.layers import REDUCED
from ..models.nemotron_h import SSD_CHUNK

if TYPE_CHECKING:
    from ..networks import VoiceChatNetworks

__all__ = ["Timeline", "TimelineState", "PREFILL_CHUNK"]

# Prompt positions per LLM call of the prefill: one piece of a deferred prefill. A quarter of the SSD
# chunk: on the deep preset it is also the fastest per position with nobody else to wait for (0.60 ms
# a position, against 0.66 for 128, 1.14 for 256 and 1.07 for a 570-token prompt whole: the scan's cost
# grows with the chunk squared; benchmarks.prefill), and a piece longer than an 80 ms tick would
# delay the streaming sessions.
PREFILL_CHUNK = SSD_CHUNK // 4


@dataclass
class TimelineState:
    """What a prefill changes on a :class:`Timeline` (:meth:`Timeline.snapshot`)."""

    language_cache: Any  # a LanguageCache, or None on the no-cache path
    history: list[torch.Tensor]  # the no-cache path's inputs so far
    tts_cache: Any  # a TTSCache
    previous_code: torch.Tensor  # the TTS's last codes
    prev_text: torch.Tensor  # the last text id fed back
    prev_function: torch.Tensor  # the last function id fed back
    index: int  # the timeline position (prompt steps included)
    last_hidden: torch.Tensor | None  # the LLM's last hidden state
    generator_state: torch.Tensor  # the sampling generator's


class Timeline:
    """One conversation's LLM and TTS timeline at batch 1: the system prompt's prefill (which a streaming
    session's row then takes over, see :meth:`FrameStep.join`) and the offline turn's steps."""

    def __init__(self, model: VoiceChatNetworks, seed: int, deterministic: bool, use_language_cache: bool) -> None:
        self.model = model
        self.config = cfg = model.config
        self.device = model.device
        self.deterministic = deterministic
        stt = model.stt_model
        self.embed, self.llm = stt.embed_tokens, stt.llm
        self.heads = model.vocabulary_heads()
        self.language_cache = stt.llm.new_cache() if use_language_cache else None
        self.history: list[torch.Tensor] = []
        self.seed = seed
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        # Seeded before the warmup, as the reference; the warmup itself draws nothing. The warmup is the
        # same for every session: a copy of the model's prefill track's start (speech_track.SpeechTracks).
        self.tts_cache, self.previous_code = model.speech_tracks().start(seed, deterministic)
        self.pad = torch.full((1, 1), cfg.pad_token_id, dtype=torch.long, device=self.device)
        self.prev_text = self.prev_function = self.pad
        self.silence = model.tts_model.silence_codes(torch.long).view(1, 1, -1)
        self.index = 0  # timeline position (prompt steps included)
        self.last_hidden: torch.Tensor | None = None

    def snapshot(self) -> TimelineState:
        """Copies of all a prefill changes: the prompt cache keeps them (:mod:`.prompt`)."""
        return copy.deepcopy(TimelineState(self.language_cache, self.history, self.tts_cache, self.previous_code,
                                           self.prev_text, self.prev_function, self.index, self.last_hidden,
                                           self.generator.get_state()))

    def restore(self, state: TimelineState) -> None:
        """This timeline as ``state`` was (copied, so the state can be restored again)."""
        state = copy.deepcopy(state)
        self.language_cache, self.history, self.tts_cache = state.language_cache, state.history, state.tts_cache
        self.previous_code, self.prev_text, self.prev_function = state.previous_code, state.prev_text, state.prev_function
        self.index, self.last_hidden = state.index, state.last_hidden
        self.generator.set_state(state.generator_state)

    def prefill(self, user: torch.Tensor) -> None:
        """The whole prompt prefill at once (:meth:`prefill_pieces`, run to its end); then the heap its
        temporaries used goes back to the OS (at full size ~0.6 GB that nothing would reuse)."""
        for _ in self.prefill_pieces(user):
            pass
        return_freed_memory()

    def prefill_pieces(self, user: torch.Tensor) -> Iterator[bool]:
        """The system prompt ``[1, n, H]`` on the user channel with the output channels off (PAD), one
        piece of work per ``next``: the LLM over the prompt in calls of ``PREFILL_CHUNK`` positions (its
        inputs do not depend on its outputs, and each call continues the cache: the split changes the
        scan's rounding only, far below what flips an output), then the TTS, whose steps see PAD text
        only (position 0 runs none): on a fresh timeline the state after them is copied from the model's
        prefill track (:mod:`~nvchat_torch.runtime.speech_track`; a piece per step the track still lacks, then the
        copy), exactly what the steps would leave, and any steps past what the track may hold run here one
        by one as the reference runs them. Each ``next`` yields whether more pieces may follow, so a caller
        (the engine's deferred prefill) can spread a long prompt over many frames of other sessions."""
        n = user.shape[1]
        if not n:
            return
        pad = self.pad.expand(1, n)
        fused = fused_input(self.embed, pad, user, pad, self.config.function_channel_weight)
        if self.language_cache is not None and fused.dtype in REDUCED:
            # bf16 prompt embeddings (a bf16 checkpoint): the reference steps its bf16 prefill one token
            # at a time, and a chunked scan would round differently, so step as it does.
            for t in range(n):
                hidden = self.llm(fused[:, t:t + 1], self.language_cache)
                yield True
        elif self.language_cache is not None:
            for start in range(0, n, PREFILL_CHUNK):
                hidden = self.llm(fused[:, start:start + PREFILL_CHUNK], self.language_cache)
                yield True
        else:
            self.history.append(fused)
            hidden = self.llm(torch.cat(self.history, dim=1))
            yield True
        self.last_hidden = hidden[:, -1:]
        self.prev_text = self.prev_function = self.pad
        end = self.index + n
        if self.index == 0:  # the first n - 1 positions' TTS steps (position 0 runs none), from the track
            taken = yield from self.model.speech_tracks().prefix(self.seed, self.deterministic, n - 1)
            if taken is not None:
                self.tts_cache, self.previous_code = taken.cache, taken.previous_code
                if taken.generator_state is not None:
                    self.generator.set_state(taken.generator_state)
                self.index = taken.steps + 1
                yield self.index < end
        while self.index < end:
            self.speech(self.pad.view(1))
            yield self.index < end

    def language(self, user: torch.Tensor, generate: bool) -> torch.Tensor | None:
        """One LLM step on the user channel ``[1, 1, H]``; the ``[2]`` (text, function) ids when ``generate``."""
        fused = fused_input(self.embed, self.prev_text, user, self.prev_function,
                            self.config.function_channel_weight)
        if self.language_cache is not None:
            hidden = self.llm(fused, self.language_cache)
        else:  # diagnostic: recompute the whole history every step
            self.history.append(fused)
            hidden = self.llm(torch.cat(self.history, dim=1))[:, -1:]
        self.last_hidden = hidden  # for diagnostics (nvchat_torch.parity); no host read
        if not generate:
            self.prev_text = self.prev_function = self.pad
            return None
        ids = language_heads(hidden, *self.heads).ids.view(2)
        self.prev_text, self.prev_function = ids[0].view(1, 1), ids[1].view(1, 1)
        return ids

    def speech(self, text_id: torch.Tensor) -> torch.Tensor:
        """One TTS step for this timeline position's text id ``[1]``: codes ``[1, 1, Q]``. Position 0
        runs no TTS and gives the silence codes; EOS resets the previous codes to silence first."""
        if self.index == 0:
            codes = self.silence
        else:
            self.previous_code = self.model.tts_model.step(self.previous_code, text_id, self.tts_cache,
                                                           self.generator, self.deterministic)
            codes = self.previous_code
        self.index += 1
        return codes
