"""The TTS half of a system prompt's prefill, run once per model and mode and shared by its sessions.

A prefill feeds the TTS PAD text, so its trajectory does not depend on the prompt's words. A
:class:`SpeechTrack` is that trajectory, and a session copies its prompt's position from it.
:class:`SpeechTracks` is the model's bounded, locked registry of them.
Design: docs/engine.md, "How it works"; memory and timings: docs/performance.md, "The prefill track".
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from ..models.gemma import TTSCache
from ..models.layers import grown_capacity
from ..models.tts import SpeechDecoder, TTSPrompt

__all__ = ["SpeechTrack", "SpeechTracks", "TrackPosition", "TRACK_BYTES"]

# Default bound of a model's tracks: at full size a position holds 504 KiB (28 layers' keys and values
# of both guidance rows, float32), so this keeps a track of about 2,000 prompt tokens, its buffers' room
# to grow while it is extended included (docs/performance.md, "The prefill track").
TRACK_BYTES = 1 << 30


@dataclass
class TrackPosition:
    """What a sequential prefill leaves after ``steps`` TTS steps (timeline index ``steps + 1``): the cache
    (its buffers the capacities the sequential growth gives), the previous codes ``[1, 1, Q]`` and, when
    sampling, the generator's state. Copies, the taker's own."""

    cache: TTSCache
    previous_code: torch.Tensor
    generator_state: torch.Tensor | None
    steps: int


class SpeechTrack:
    """One mode's (and, sampling, one seed's) prefill trajectory. ``cache`` holds the state after the last
    step: while the track is extended, its buffers grown and written as a session's own cache would be;
    at rest (:meth:`compact`), only the positions they hold. What a copy at an earlier position needs
    besides is kept per step (the codes, the generator states, the buffers' capacities: they grow by
    history, :func:`~nvchat_torch.models.layers.grown_capacity`) and, for the sliding layers, the positions
    their rings have overwritten since. Not thread-safe: :class:`SpeechTracks` locks around it."""

    def __init__(self, speech: SpeechDecoder, prompt: TTSPrompt, seed: int | None) -> None:
        self.speech = speech
        self.deterministic = seed is None
        device = prompt.codes.device
        # Seeded before the warmup, as a session's timeline; the warmup itself draws nothing.
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(0 if seed is None else seed)
        self.pad = torch.full((1,), speech.pad_token_id, dtype=torch.long, device=device)
        self.cache, code = speech.start(prompt)
        self.start = self.cache.offset  # the warmup's positions
        self.codes = [code]  # the previous codes after each number of steps
        self.generator_states = [] if self.deterministic else [self.generator.get_state()]
        self.capacities = [self.cache.capacities()]
        self.sliding = [layer for layer, window in enumerate(self.cache.windows) if window is not None]
        self.window = speech.tts_model.backbone.window if self.sliding else None  # every sliding layer's
        # Sliding layers: the positions their rings overwrote, in order from `overwritten_from`.
        self.overwritten_from = max(self.start - (self.window or 0), 0)
        self.overwritten: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.overwritten_count = 0
        self.compacted = False
        self.retired = False  # dropped from the registry: no more steps, copies still served

    @property
    def steps(self) -> int:
        return len(self.codes) - 1

    @property
    def nbytes(self) -> int:
        kept = sum(k.nbytes + v.nbytes for k, v in self.overwritten.values())
        states = sum(s.nbytes for s in self.generator_states)
        return self.cache.nbytes + kept + sum(c.nbytes for c in self.codes) + states

    def step_bytes(self) -> int:
        """The bytes the next step adds: the buffers back at their capacity if compacted and grown as
        :meth:`TTSCache.reserve` will grow them, an overwritten ring slot's room, its codes and generator
        state."""
        cache, end = self.cache, self.cache.offset + 1
        added = self.codes[-1].nbytes + (self.generator_states[-1].nbytes if self.generator_states else 0)
        capacities = dict(zip((True, False), self.capacities[-1]))  # by "is a global layer"
        for layer, window in enumerate(cache.windows):
            keys = cache.keys[layer]
            capacity, needed = capacities[window is None], end if window is None else min(end, window)
            size = grown_capacity(capacity, needed, cache.limit if window is None else window) \
                if needed > capacity else capacity
            added += 2 * (size - keys.shape[2]) * keys[:, :, :1].nbytes
            if window is not None and cache.offset >= window:  # a ring slot to keep
                kept = self.overwritten.get(layer)
                if kept is None or self.overwritten_count == kept[0].shape[2]:
                    added += 2 * max(self.overwritten_count, 1) * keys[:, :, :1].nbytes
        return added

    def extend(self) -> None:
        """One more PAD step, as :meth:`~nvchat_torch.runtime.timeline.Timeline.speech` runs it, first keeping the
        ring slots it overwrites."""
        if self.compacted:  # the buffers at their capacity again, as the step grows and reads them
            self.cache, self.compacted = self.position(self.steps).cache, False
        cache = self.cache
        if self.window is not None and cache.offset >= self.window:
            slot = cache.offset % self.window
            for layer in self.sliding:
                self._keep(layer, cache.keys[layer][:, :, slot:slot + 1], cache.values[layer][:, :, slot:slot + 1])
            self.overwritten_count += 1
        code = self.speech.step(self.codes[-1], self.pad, cache, self.generator, self.deterministic)
        self.codes.append(code)
        if not self.deterministic:
            self.generator_states.append(self.generator.get_state())
        self.capacities.append(cache.capacities())

    def compact(self) -> None:
        """Trim the buffers to the positions they hold: at rest the track needs no room to grow (at full
        size a 256-slot block is 126 MiB), and :meth:`position` copies into buffers of their own."""
        cache = self.cache
        for layer, window in enumerate(cache.windows):
            held = cache.offset if window is None else min(cache.offset, window)
            for buffers in (cache.keys, cache.values):
                if buffers[layer].shape[2] > held:
                    buffers[layer] = buffers[layer][:, :, :held].clone()
        self.compacted = True

    def _keep(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append one overwritten position of a sliding layer, growing its buffers by doubling."""
        kept = self.overwritten.get(layer)
        n = self.overwritten_count
        if kept is None or n == kept[0].shape[2]:
            size = max(2 * n, 1)
            grown = tuple(t.new_zeros(*t.shape[:2], size, t.shape[3]) for t in (keys, values))
            if kept is not None:
                for new, old in zip(grown, kept):
                    new[:, :, :n] = old
            kept = self.overwritten[layer] = (grown[0], grown[1])
        kept[0][:, :, n:n + 1] = keys
        kept[1][:, :, n:n + 1] = values

    def position(self, steps: int) -> TrackPosition:
        """A copy of the state after ``steps`` (<= :attr:`steps`) steps: each buffer zeros at the capacity
        it had then, holding the positions a session's own steps would have written there."""
        cache, offset = self.cache, self.start + steps
        capacity = dict(zip((True, False), self.capacities[steps]))  # by "is a global layer"
        copies: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for layer, window in enumerate(cache.windows):
            for kind, (buffers, out) in enumerate(zip((cache.keys, cache.values), copies)):
                held = buffers[layer]
                copy = held.new_zeros(*held.shape[:2], capacity[window is None], held.shape[3])
                if window is None:
                    copy[:, :, :offset] = held[:, :, :offset]
                else:
                    self._fill_ring(copy, held, layer, kind, offset, window)
                out.append(copy)
        state = None if self.deterministic else self.generator_states[steps].clone()
        return TrackPosition(TTSCache(copies[0], copies[1], list(cache.windows), offset, cache.limit),
                             self.codes[steps].clone(), state, steps)

    def _fill_ring(self, ring: torch.Tensor, held: torch.Tensor, layer: int, kind: int, offset: int,
                   window: int) -> None:
        """A sliding layer's ring (keys: ``kind`` 0, values: 1) as it stood at ``offset``: slot ``p % window``
        holds position ``p`` for the last ``window`` positions before it, taken from the track's ring
        (``held``) where it still holds them, from the kept overwritten positions where a later step
        overwrote them."""
        end = self.cache.offset
        if end <= window:  # nothing overwritten yet: slot = position
            ring[:, :, :offset] = held[:, :, :offset]
            return
        positions = torch.arange(max(offset - window, 0), offset, device=held.device)
        slots = positions % window
        current = positions >= end - window  # still in the track's ring
        ring[:, :, slots[current]] = held[:, :, slots[current]]
        old = positions[~current]
        if old.numel():
            ring[:, :, slots[~current]] = self.overwritten[layer][kind][:, :, old - self.overwritten_from]


class SpeechTracks:
    """A model's prefill tracks by key (the mode, the seed when sampling, the TTS's dtype and device), at
    most ``max_bytes`` of them (0: none; sessions then run every TTS step of their prefill), least
    recently used dropped first. A track that would pass the bound is not extended: its sessions go on
    with their own steps from its end, which is exact too. ``steps_run`` counts the tracks' steps."""

    def __init__(self, speech: SpeechDecoder, prompt: Callable[[], TTSPrompt], max_bytes: int = TRACK_BYTES) -> None:
        self.speech = speech
        self.prompt = prompt
        self.steps_run = 0
        self._tracks: OrderedDict[tuple, SpeechTrack] = OrderedDict()
        self._unfit: int | None = None  # the largest bound a track's start did not fit
        self._lock = threading.Lock()
        self.max_bytes = max_bytes

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:
        """A new bound; the least recently used tracks over it are dropped now."""
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"max_bytes must be a non-negative int, got {value!r}")
        with self._lock:
            self._max_bytes = value
            self._room(0, None)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(track.nbytes for track in self._tracks.values())

    def __len__(self) -> int:
        return len(self._tracks)

    def key(self, seed: int, deterministic: bool) -> tuple:
        """What determines a track: the mode and, sampling, the seed (a deterministic prefill draws
        nothing), and the TTS's activation dtype and device."""
        speech = self.speech
        return (bool(deterministic), None if deterministic else int(seed), str(speech.tts_model.activation_dtype),
                str(speech.codec_silence_tokens.device))

    def steps_held(self, seed: int, deterministic: bool) -> int | None:
        """How many prefill steps the track of this mode (and seed) holds; None: no track."""
        with self._lock:
            track = self._tracks.get(self.key(seed, deterministic))
            return None if track is None else track.steps

    def clear(self) -> None:
        with self._lock:
            for track in self._tracks.values():
                track.retired = True
            self._tracks.clear()

    def start(self, seed: int, deterministic: bool) -> tuple[TTSCache, torch.Tensor]:
        """The speaker warmup's cache and first previous codes, a session's own: copied from the track's
        start (the track made now if the bound allows), else the warmup run for the caller. The tracks
        compute under ``inference_mode``; the copies are made in the caller's mode, as its own would be."""
        if self.max_bytes:
            with self._lock:
                with torch.inference_mode():
                    track = self._track(self.key(seed, deterministic))
                if track is not None:
                    position = track.position(0)
                    return position.cache, position.previous_code
        return self.speech.start(self.prompt())

    def prefix(self, seed: int, deterministic: bool, steps: int) -> Generator[bool, None, TrackPosition | None]:
        """The pieces of taking the state after ``steps`` PAD steps: one step of the shared track per piece
        while it is shorter and the bound allows (each yields True), then the copy at ``steps`` or at the
        track's end, whichever is first, returned (the caller's next piece). None: no track (the bound is
        0 or too small for one), the caller runs every step itself."""
        track = yield from self.extend(seed, deterministic, steps)
        if track is None:
            return None
        with self._lock:
            return track.position(min(steps, track.steps))

    def extend(self, seed: int, deterministic: bool, steps: int) -> Generator[bool, None, SpeechTrack | None]:
        """The pieces of extending the track of this mode (and seed) to ``steps`` steps, one step per piece
        (each yields True) while the bound allows; returns the track, at rest (None: no track). A server
        runs them in its idle time, so its first caller finds the track made."""
        if not self.max_bytes:
            return None
        key = self.key(seed, deterministic)
        with torch.inference_mode(), self._lock:
            track = self._track(key)
        if track is None:
            return None
        while True:  # no context is held across a yield: the caller's thread and grad mode are its own
            with self._lock:
                if track.steps >= steps or track.retired or not self._room(track.step_bytes(), track):
                    with torch.inference_mode():
                        track.compact()  # its growth room goes before a copy is made
                    return track
                with torch.inference_mode():
                    track.extend()
                self.steps_run += 1
            yield True

    def _track(self, key: tuple) -> SpeechTrack | None:
        """The track of ``key``, made and kept when there is none and it fits the bound. Under the lock."""
        track = self._tracks.get(key)
        if track is not None:
            self._tracks.move_to_end(key)
            return track
        if self._unfit is not None and self.max_bytes <= self._unfit:
            return None  # a track's start did not fit this bound: not made again for nothing
        track = SpeechTrack(self.speech, self.prompt(), key[1])
        track.compact()
        if not self._room(track.nbytes, None):
            self._unfit = self.max_bytes
            return None
        self._tracks[key] = track
        return track

    def _room(self, added: int, keep: SpeechTrack | None) -> bool:
        """Whether ``added`` more bytes fit, once the least recently used tracks but ``keep`` are dropped
        as needed. Under the lock."""
        if added > self._max_bytes:
            return False
        held = sum(track.nbytes for track in self._tracks.values())
        for key in list(self._tracks):
            if held + added <= self.max_bytes:
                break
            track = self._tracks[key]
            if track is not keep:
                held -= track.nbytes
                track.retired = True
                del self._tracks[key]
        return held + added <= self.max_bytes
