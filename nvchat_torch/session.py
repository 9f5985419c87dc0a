"""The streaming session and the offline turn.

A :class:`StreamingSession` is one conversation: its system prompt's prefill (a
:class:`~nvchat_torch.runtime.timeline.Timeline` at batch 1), then each 1280-sample frame as the one row of
a :class:`~nvchat_torch.runtime.frame_step.FrameStep`, the frame path the batched engine's rows take;
and its host side: the detokenizers, the tool channel, the limits and the events (docs/api.md)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import numpy as np
import torch

from .audio_io import as_mono_float32, prepare_input
from .events import (
    ContextLimit,
    FrameTiming,
    StreamingOptions,
    TokenAccumulator,
    VoiceChatEvent,
    VoiceChatProfile,
    VoiceChatResult,
)
from .models.rnnt import TranscriptText
from .runtime.frame_layout import PackedLayout
from .runtime.frame_step import FrameInput, FrameStep
from .runtime.prompt import PromptCache, prompt_ids
from .runtime.step_plan import PLAIN, StepPlan, off_clock_steps
from .runtime.timeline import Timeline
from .tool_pipeline import ToolPipeline
from .tools import ToolChannel
from .turn_taking import TurnTakingConfig, reasons_of

if TYPE_CHECKING:
    from .networks import VoiceChatNetworks

# What push_audio and generate take: mono samples as a float (or int16) array or tensor, or a list
# of numbers (ints are int16 PCM); generate also takes a file path.
AudioInput = Union[np.ndarray, torch.Tensor, Sequence[float], Sequence[int]]

__all__ = ["StreamingSession", "generate_offline"]


class StreamingSession:
    """One full-duplex conversation: push 16 kHz audio, get frame-aligned events back.

    Create it with :meth:`VoiceChatModel.create_streaming_session`. The session owns every cache
    (log-mel, Conformer, RNNT, LLM, TTS, codec), so several sessions can share one model.
    """

    def __init__(self, model: VoiceChatNetworks, options: StreamingOptions, *, prefill: bool = True,
                 own_frames: bool = True, prompt_cache: PromptCache | None = None) -> None:
        """``prefill=False`` defers the system prompt's prefill: :meth:`prefill_step` runs it a piece at a
        time (the engine spreads it over other sessions' frames); the first audio completes it.
        ``own_frames=False``: the frames run as a row of someone else's FrameStep (the batched engine's),
        which takes the prefilled timeline; this session is then its host side only. ``prompt_cache``: a
        prompt prefilled before (same ids, seed, mode, dtype) is copied from it instead, and a new one is
        kept in it (:class:`~nvchat_torch.runtime.prompt.PromptCache`)."""
        self.model = model
        self.options = options
        cfg = self.config = model.config
        self.frame_samples = cfg.input_frame_samples
        # How a frame step's packed row reads back (the step packs by the same layout).
        self.frame_layout = PackedLayout(cfg.audio_config.max_symbols, cfg.tts_config.num_quantizers,
                                         cfg.output_frame_samples)
        self.frame_index = 0  # steps run after the prompt, heard or off the clock
        self.input_frames = 0  # audio frames heard
        self.closed = False
        self._failure: BaseException | None = None  # what closed the session mid-frame
        self.last_ids: tuple[int, int] | None = None  # the latest frame's (text, function) token ids
        self.profile = VoiceChatProfile(frame_duration_ms=cfg.frame_duration * 1000.0)
        self._pending = np.zeros(0, dtype=np.float32)
        # Tool calls parsed from the function channel, and ids forced into either output channel.
        self._tools = ToolChannel(model.tokenizer, options.tools, pad_id=cfg.pad_token_id,
                                  vocab_size=cfg.text_config.vocab_size, device=model.device)
        # NVIDIA's two-phase pipeline for its calls (None: a call and its result stream a token per frame)
        self.pipeline = None if options.tool_hold is None or not self._tools.parsing else ToolPipeline(
            options.tool_hold, self._tools, model.tokenizer, bos_id=cfg.bos_token_id, eos_id=cfg.eos_token_id,
            pad_id=cfg.pad_token_id, frame_duration=cfg.frame_duration, seed=options.seed)
        with torch.inference_mode():
            self._timeline = Timeline(model, options.seed, options.deterministic, options.use_language_cache)
            self._rnnt_state = model.transcriber.new_state()
            # The one row this session's frames run in (joined once the prompt is prefilled).
            self._frame_step = FrameStep(model, perception_cache=options.use_perception_cache,
                                     language_cache=options.use_language_cache) if own_frames else None
            self._slot: int | None = None
            prompt = prompt_ids(model, options.system_prompt, options.tools)
            # The model's own limit: every LLM position (prompt and frames) within max_position_embeddings,
            # and the TTS positions (speaker prompt + the same timeline) within the rotary tables built at load.
            tts = model.tts_model.tts_model
            self.model_max_frames = min(cfg.text_config.max_position_embeddings - len(prompt),
                                        tts.backbone.max_positions - self._timeline.tts_cache.offset - len(prompt) + 1)
            if self.model_max_frames < 1:
                raise ValueError(f"the system prompt ({len(prompt)} tokens) leaves no room in the model's context "
                                 f"of {cfg.text_config.max_position_embeddings} positions")
            self.max_frames = self.model_max_frames
            if options.max_streaming_seconds is not None:
                self.max_frames = min(self.max_frames, int(options.max_streaming_seconds / cfg.frame_duration))
            # Prefill: the prompt rides on the user channel with the output channels off (PAD),
            # advancing the LLM and TTS timeline; no codec, no events, frame_index stays 0.
            self._prefill: Iterator[bool] | None = None
            self._prompt_cache = prompt_cache
            self._prompt_key = None if prompt_cache is None else prompt_cache.key(prompt, options, model)
            if prompt and prompt_cache is not None and prompt_cache.restore(self._prompt_key, self._timeline):
                self._join()
            elif prompt:
                self._prefill = self._timeline.prefill_pieces(
                    self._timeline.embed(torch.tensor([prompt], device=model.device)))
                if prefill:
                    self._finish_prefill()
            else:
                self._join()
        skip = {cfg.pad_token_id, cfg.silence_token_id, cfg.bos_token_id, cfg.eos_token_id}
        self._text = TokenAccumulator(model.tokenizer, skip)
        self._function = TokenAccumulator(model.tokenizer, skip)
        self._transcript = TranscriptText(cfg.rnnt_vocabulary)

    # ---- the deferred prompt prefill
    @property
    def prefilling(self) -> bool:
        """Whether part of the system prompt's prefill is still to run (``prefill=False``)."""
        return self._prefill is not None

    def prefill_step(self) -> bool:
        """Run one piece of the deferred prefill (one LLM call of up to 64 prompt positions, or one TTS
        step); returns True once the prefill is complete."""
        if self._prefill is not None:
            with torch.inference_mode():
                if not next(self._prefill, False):
                    self._prefill = None
                    if self._prompt_cache is not None:  # kept before a frame step takes the caches
                        self._prompt_cache.save(self._prompt_key, self._timeline)
                    self._join()
        return self._prefill is None

    def _join(self) -> None:
        """The prefilled timeline's caches move into this session's row (if it runs its own frames)."""
        if self._frame_step is not None:
            self._slot = self.join_into(self._frame_step)

    def join_into(self, step: FrameStep) -> int:
        """Move the prefilled timeline's caches into a row of ``step`` (this session's own, or an engine's);
        returns the row's slot. From then on the row's positions are the step's (its ``rows``), and this
        session counts its frames (:attr:`frame_index`) for its events."""
        return step.join(self._timeline, self._rnnt_state, self.options.turn_taking)

    def _finish_prefill(self) -> None:
        while not self.prefill_step():
            pass

    # ---- public state
    @property
    def text(self) -> str:
        return self._text.text

    @property
    def function_text(self) -> str:
        return self._function.text

    @property
    def user_transcript(self) -> str:
        return self._transcript.text

    @property
    def frame_step(self) -> FrameStep | None:
        """The one-row frame step this session runs its frames in (None: a row of an engine's step)."""
        return self._frame_step

    @property
    def timeline_index(self) -> int:
        """Timeline positions so far: the prompt's (prefilled) and one per frame."""
        return self._timeline.index + self.frame_index

    @property
    def max_seconds(self) -> float:
        """How long this session may stream: ``max_streaming_seconds``, or the model's own limit."""
        return self.max_frames * self.config.frame_duration

    def cache_bytes(self) -> dict[str, int]:
        """Bytes the two caches that grow with the session hold (LLM, TTS)."""
        if self._slot is not None:
            return self._frame_step.cache_bytes()
        timeline = self._timeline
        language = timeline.language_cache.nbytes if timeline.language_cache is not None else 0
        return {"language": language, "tts": timeline.tts_cache.nbytes if timeline.tts_cache is not None else 0}

    # ---- input
    def push_audio(self, samples: AudioInput, sample_rate: int = 16000) -> list[VoiceChatEvent]:
        """Buffer ``samples`` (mono float32/float64/int16, array or tensor, any length) and run one
        timeline step per complete 1280-sample frame; returns those frames' events.

        Bad input raises ``ValueError`` and changes nothing. Past the session's limit it raises
        :class:`ContextLimit` (with the events of this call's frames that ran). A frame that fails
        closes the session: every later call raises an error naming that failure."""
        self._check_usable("push_audio")
        if self.closed:
            raise RuntimeError("push_audio: the session is closed (flushed or cancelled); create a new one")
        chunk = as_mono_float32(samples, sample_rate, self.config.input_sample_rate)
        self._finish_prefill()
        pending = np.concatenate([self._pending, chunk]) if self._pending.size else chunk
        n_frames = pending.shape[0] // self.frame_samples
        self._pending = pending[n_frames * self.frame_samples:].copy()
        if not n_frames:
            return []
        events: list[VoiceChatEvent] = []
        for frame in pending[:n_frames * self.frame_samples].reshape(n_frames, self.frame_samples):
            try:
                events += self._off_clock_due()
                events += self._step(frame, None if self.pipeline is None else self.pipeline.frame_plan())
                events += self._off_clock_due()
            except ContextLimit as limit:
                limit.events = events  # the frames of this push that did run; the rest is dropped
                raise
        return events

    def _off_clock_due(self) -> list[VoiceChatEvent]:
        """The steps the tool pipeline runs now, off the clock: writing a call, injecting its result."""
        events: list[VoiceChatEvent] = []
        while self.pipeline is not None and (plan := self.pipeline.off_clock()) is not None:
            events += self._step(None, plan)
        return events

    def step_off_clock(self, count: int, *, text: int | None = None, speak: Sequence[int] | None = None,
                       keep_audio: bool = True) -> list[VoiceChatEvent]:
        """Run ``count`` timeline steps now that hear no audio (NVIDIA's silence embedding on the user
        channel, as its tool pipeline runs a call off the clock); returns their events. ``text``: the text
        id every step forces (say PAD; None: the model's own), ``speak``: ids its TTS speaks instead, one per
        step from the first (an acknowledgement), ``keep_audio``: whether their speech comes out as
        ``audio`` events. The steps advance :attr:`frame_index` and the context, not
        :attr:`input_frames`; their events carry ``input_frame=None``. Buffered audio stays buffered.
        A bad argument raises ``ValueError`` and steps past the limit :class:`ContextLimit`, before
        anything runs."""
        self._check_usable("step_off_clock")
        if self.closed:
            raise RuntimeError("step_off_clock: the session is closed (flushed or cancelled); create a new one")
        steps = off_clock_steps(count, text, speak, keep_audio, self.config.text_config.vocab_size)
        self.check_room(self.frame_index + count)
        self._finish_prefill()
        events: list[VoiceChatEvent] = []
        for step in steps:
            events += self._step(None, step)
        return events

    def flush(self, pad_partial: bool = True) -> list[VoiceChatEvent]:
        """End the stream: zero-pad and run the partial frame if asked (not past the session's limit:
        then it is dropped), close, emit ``done``."""
        self._check_usable("flush")
        if self.closed:
            return []
        self._finish_prefill()
        if self.pipeline is not None:
            self.pipeline.end()
        events: list[VoiceChatEvent] = self._off_clock_due()  # a result sent last goes in before the end
        if self._pending.size and pad_partial and self.frame_index < self.max_frames:
            frame = np.zeros(self.frame_samples, dtype=np.float32)
            frame[:self._pending.size] = self._pending
            self._pending = np.zeros(0, dtype=np.float32)
            events += self._step(frame)
        self._close()
        events += self.final_events()
        events.append(VoiceChatEvent(kind="done", frame_index=self.frame_index))
        return events

    def final_events(self, tools: bool = True) -> list[VoiceChatEvent]:
        """What the end of the stream releases (flush, cancel, or the engine's last step): the text held
        back on each channel (an incomplete character, as the full decode shows it), so the deltas add
        up to ``tokenizer.decode`` of the channel, then (``tools``) an unfinished tool call's
        ``tool_call_error``."""
        events = []
        for kind, acc in (("assistant_text_delta", self._text), ("function_delta", self._function)):
            update = acc.finish()
            if update is not None:
                events.append(VoiceChatEvent(kind, self.frame_index, delta=update[0], text=update[1]))
        return events + (self._tools.finish(self.frame_index) if tools else [])

    def cancel(self) -> list[VoiceChatEvent]:
        """Drop pending audio, close, emit ``cancelled``."""
        self._check_usable("cancel")
        if self.closed:
            return []
        self._close()
        return self.final_events(tools=False) + [VoiceChatEvent(kind="cancelled", frame_index=self.frame_index)]

    # ---- tool calls and forced tokens
    def send_tool_result(self, call_id: str, output: Any) -> None:
        """Answer the ``tool_call`` event ``call_id`` with ``output`` (a JSON-serialisable value, or a
        string; a string holding JSON is that JSON). Once every call of its span has a result, the
        ``<TOOL_RESPONSE>[...]</TOOL_RESPONSE>`` tokens replace the function channel's outputs, one
        per frame from the next frame on, with the text channel held at PAD; they come back as
        ``function_delta`` events. Unknown or already-answered ids raise ``ValueError``. With the tool
        pipeline (``tool_hold``) the response goes in off the clock once the phrase being spoken ends,
        and a result for a call whose time ran out raises ``ValueError`` (the timeout result answered it)."""
        if self.pipeline is not None:
            self.pipeline.check_result(call_id)
        self._tools.send_result(call_id, output)
        if self.pipeline is not None:
            self.pipeline.result_sent()

    def force_tokens(self, channel: str, ids: Sequence[int] | torch.Tensor) -> None:
        """Research hook (scripted responses, teacher forcing, evaluation): ``ids`` replace the model's
        ``channel`` ("text" or "function") outputs for the next frames, one per frame, and are fed
        back as the model's own would be. Queued after anything already forced on that channel."""
        self._tools.force(channel, ids)

    @property
    def pending_tool_calls(self) -> list[str]:
        """The ids of ``tool_call`` events still waiting for :meth:`send_tool_result`."""
        return self._tools.awaiting

    def _close(self) -> None:
        self._pending = np.zeros(0, dtype=np.float32)
        if self._slot is not None:  # the row's caches are released
            self._frame_step.leave(self._slot)
            self._slot = None
        self.closed = True

    def _check_usable(self, call: str) -> None:
        if self._failure is not None:
            raise RuntimeError(f"{call}: the session was closed when frame {self.frame_index} failed with "
                               f"{type(self._failure).__name__}: {self._failure}; create a new one") from self._failure

    # ---- the frame loop
    def check_room(self, steps: int) -> None:
        """Raise :class:`ContextLimit` unless ``steps`` steps after the prompt fit the session's limit (every
        step, heard or off the clock, takes one position of the context)."""
        if steps <= self.max_frames:
            return
        ms = self.config.frame_duration * 1000
        if self.max_frames < self.model_max_frames:
            raise ContextLimit(f"the session reached max_streaming_seconds={self.options.max_streaming_seconds} "
                               f"({self.max_frames} steps of {ms:.0f} ms)")
        raise ContextLimit(f"the session reached the model's context: {self.max_frames} steps of {ms:.0f} ms "
                           f"({self.max_seconds / 60:.1f} min) after the system prompt, within "
                           f"max_position_embeddings={self.config.text_config.max_position_embeddings}")

    def _step(self, frame: np.ndarray | None, plan: StepPlan | None = None) -> list[VoiceChatEvent]:
        """One step (``frame`` heard, or none: off the clock) run as ``plan`` says, or ContextLimit before
        it (nothing changes); a failure inside closes the session, as its caches may be partly advanced."""
        self.check_room(self.frame_index + 1)
        try:
            packed, stamps = self._frame_step.run({self._slot: self.frame_input(frame, plan)}, self.options.profile)
            return self.frame_done(packed[self._slot], stamps, plan, heard=frame is not None)
        except BaseException as error:
            self._failure = error
            try:
                self._close()
            except Exception:  # the original failure is what the caller needs to see
                self.closed = True
            raise

    # ---- what a frame step takes from this session and gives back (its own, or an engine's)
    def frame_input(self, samples: np.ndarray | None, plan: StepPlan | None = None) -> FrameInput:
        """This session's row of a frame step: the samples (None: a step off the clock), its generator (none
        when deterministic), the ids its tool channel forces (taken off its queues here), what ``plan``
        forces and speaks and which networks step, and, with turn-taking, what holds it: a tool call in
        progress (from its start-of-call token until its result has been fed in) or a forced text id."""
        generator = None if self.options.deterministic else self._timeline.generator
        plan = plan or PLAIN
        tools = self._tools
        step: dict[str, Any] = dict(text=plan.text, spoken=plan.spoken, thinks=plan.thinks, speaks=plan.speaks)
        if self.options.turn_taking is not None:  # what holds the row, read before the queues are taken
            in_call = tools.in_call or bool(tools.awaiting) or tools.injecting or (self.pipeline is not None and
                                                                                  self.pipeline.active)
            forced = tools.text_forced or plan.text >= 0
            step.update(held=in_call or forced or not plan.thinks, pad_text=in_call and not forced,
                        call_start=tools.start_id if tools.parsing else -1)
        if plan.thinks and tools.forcing:  # force_tokens / a tool result: a step's own text id goes first
            step["forced"] = tools.take_forced(text_too=plan.text < 0)
        return FrameInput(samples, generator, **step)

    def set_turn_taking(self, config: TurnTakingConfig | Mapping[str, Any] | None) -> None:
        """Turn-taking from the next frame on (see ``StreamingOptions.turn_taking``): switched on it starts
        fresh, new values keep its state (whether the agent speaks, the counters), None switches it off."""
        self._check_usable("set_turn_taking")
        self.options = replace(self.options, turn_taking=config)  # checked; options may be shared
        config = self.options.turn_taking
        if self._slot is not None:
            self._frame_step.set_turn_taking(self._slot, config)

    def frame_done(self, packed: np.ndarray, stamps: list[float], plan: StepPlan | None = None,
                   heard: bool = True) -> list[VoiceChatEvent]:
        """The events of this session's row of a step that ran (``packed``: its values, read from the
        device; ``plan``: how it ran; ``heard``: whether it heard a frame of audio); records the step's
        stage times when profiling, and advances the step (and heard frame) counters."""
        if self.options.profile:
            self.profile.frames.append(FrameTiming.from_stamps(self.frame_index, stamps))
        events = self._frame_events(packed, plan or PLAIN, heard)
        self.frame_index += 1
        self.input_frames += heard
        return events

    def _frame_events(self, packed: np.ndarray, plan: StepPlan, heard: bool) -> list[VoiceChatEvent]:
        out = self.frame_layout.unpack(packed)
        i = self.frame_index
        events = []
        update = self._transcript.update(out.transcript_ids.tolist())
        if update is not None:
            events.append(VoiceChatEvent("user_transcript_delta", i, delta=update[0], text=update[1]))
        if out.reason is not None:  # a step with turn-taking: the row's reason code (0 without a policy)
            events += [VoiceChatEvent("turn", i, token_id=out.text_id, reason=reason)
                       for reason in reasons_of(out.reason)]
        # The LLM's ids, PAD and EOS included (servers read turn ends from them); None: it stood still
        self.last_ids = (out.text_id, out.function_id) if plan.thinks else None
        if plan.thinks:
            for kind, acc, token in (("assistant_text_delta", self._text, out.text_id),
                                     ("function_delta", self._function, out.function_id)):
                update = acc.append(token)
                if update is not None:
                    events.append(VoiceChatEvent(kind, i, token_id=token, delta=update[0], text=update[1]))
            events += self._tools.feed(out.function_id, i)
        if self.pipeline is not None:  # a call starts, is written, is waited for: and the phrase begun now
            events += self.pipeline.after(plan, out.function_id, events, i)
        if plan.keep_audio:  # a step whose TTS and codec stood still is 80 ms of silence
            samples = out.samples if plan.speaks else np.zeros_like(out.samples)
            events.append(VoiceChatEvent("audio", i, samples=samples, sample_rate=self.config.output_sample_rate,
                                         audio_codes=out.codes))
        if heard:
            for event in events:
                event.input_frame = self.input_frames
        return events


# --------------------------------------------------------------------------------------
# Offline


def _load_audio(audio: AudioInput | str | Path, sample_rate: int) -> np.ndarray:
    if isinstance(audio, (str, Path)):
        samples, _ = prepare_input(audio, sample_rate)
        return samples
    return as_mono_float32(audio, sample_rate, sample_rate)


def generate_offline(model: VoiceChatNetworks, audio: AudioInput | str | Path, *, system_prompt: str | None, seed: int,
                     deterministic: bool, max_frames: int | None, extra_decoding_seconds: float,
                     use_language_cache: bool, tools: Sequence[dict] | None = None) -> VoiceChatResult:
    """One turn over the whole input, as the reference's ``VoiceChatSession.generate``: the mel and
    encoder run over the whole waveform (N frames of audio give N + 1 encoder frames), the system
    prompt is prepended on the user channel, timeline position 0 runs no TTS (its codes are 0),
    and the codes are decoded in one codec pass. With ``tools`` the prompt is NVIDIA's function-calling
    prompt and the result lists the calls found on the function channel."""
    cfg = model.config
    tool_channel = ToolChannel(model.tokenizer, tools, pad_id=cfg.pad_token_id,
                               vocab_size=cfg.text_config.vocab_size, device=model.device)
    wave = _load_audio(audio, cfg.input_sample_rate)
    if extra_decoding_seconds < 0:
        raise ValueError(f"extra_decoding_seconds must be >= 0, got {extra_decoding_seconds}")
    if extra_decoding_seconds:
        wave = np.concatenate([wave, np.zeros(round(extra_decoding_seconds * cfg.input_sample_rate), np.float32)])
    if max_frames is not None and max_frames < 2:
        raise ValueError(f"max_frames must be at least 2, got {max_frames}")
    device = model.device
    perception = model.stt_model.perception
    with torch.inference_mode():
        mel = perception.log_mel(torch.from_numpy(wave).to(device))
        projected, encoded = perception(mel)
        frames = projected.shape[1] if max_frames is None else min(projected.shape[1], max_frames)
        projected, encoded = projected[:, :frames], encoded[:, :frames]
        timeline = Timeline(model, seed, deterministic, use_language_cache)
        prompt = prompt_ids(model, system_prompt, tools)
        if prompt:
            timeline.prefill(model.stt_model.embed_tokens(torch.tensor([prompt], device=device)).to(projected.dtype))
        ids, codes = [], []
        for t in range(projected.shape[1]):
            first = timeline.index == 0  # timeline position 0 runs no TTS: its codes are 0
            step_ids = timeline.language(projected[:, t:t + 1], generate=True)
            step_codes = timeline.speech(step_ids[:1])
            ids.append(step_ids)
            codes.append(torch.zeros_like(step_codes) if first else step_codes)
        codes = model.tts_model.replace_control_codes(torch.cat(codes, dim=1))  # [1, frames, Q]
        audio_out = model.tts_model.audio_codec.decode(codes.transpose(1, 2))[0, 0]
        transcript_ids = model.transcriber.greedy_decode(encoded)
        ids = torch.stack(ids).cpu().numpy()
        codes_np = codes[0].to(torch.int32).cpu().numpy()
        audio_np = audio_out.float().cpu().numpy()
    skip = {cfg.pad_token_id, cfg.silence_token_id, cfg.bos_token_id, cfg.eos_token_id}
    transcript = TranscriptText(cfg.rnnt_vocabulary)
    transcript.update(transcript_ids)

    def decode(channel: np.ndarray) -> str:
        return model.tokenizer.decode([int(i) for i in channel if int(i) not in skip], skip_special_tokens=False)

    tool_calls = [e for frame, token in enumerate(ids[:, 1].tolist()) for e in tool_channel.feed(int(token), frame)]
    tool_calls += tool_channel.finish(len(ids))
    return VoiceChatResult(text=decode(ids[:, 0]), text_ids=ids[:, 0].astype(np.int64),
                           function_ids=ids[:, 1].astype(np.int64), function_text=decode(ids[:, 1]),
                           user_transcript=transcript.text, audio=audio_np, audio_codes=codes_np,
                           sample_rate=cfg.output_sample_rate, tool_calls=tool_calls)
