"""What a client's ``session.update`` may set, in both dialects, checked key by key.

Every key a ``session.update`` carries is either one the dialect's schema has (the OpenAI Realtime GA
session, or mlx-vlm's), or an ``error`` naming it: nothing is dropped silently. GA keys the model
cannot act on (a voice, noise reduction, tracing, ...) are accepted, and ``session.updated`` shows
what is in effect. Both dialects take the ``nvchat`` extension object (:data:`NVCHAT_KEYS`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from ..audio_io import G711_RATE, g711_decode, g711_encode, pcm16_decode, pcm16_encode
from ..events import StreamingOptions
from ..tool_hold import ToolHold
from .ga_schema import PASS_THROUGH, UnknownKey, check, show

__all__ = ["ClientError", "SessionConfig", "NVCHAT_KEYS", "GA_SESSION_KEYS", "MLX_SESSION_KEYS", "INPUT_RATES",
           "OUTPUT_RATES", "AUDIO_FORMATS", "ga_update", "turn_detection_policy", "not_applied", "mlx_update",
           "tool_hold_config", "check_tool_hold",
           "is_mlx_update", "format_json", "decode_audio", "encode_audio"]

INPUT_RATES = (24000, 16000)  # 24 kHz is resampled to the model's 16 kHz; 16 kHz goes in as it is
OUTPUT_RATES = (24000, 22050)  # the model's 22.05 kHz is resampled to 24 kHz, or sent as it is
# GA's audio formats: pcm16 at a rate, and G.711 μ-law / A-law (telephony), which are 8 kHz only and
# are resampled to and from the model's rates like 24 kHz pcm16.
AUDIO_FORMATS = ("audio/pcm", "audio/pcmu", "audio/pcma")

# The nvchat extension: key -> accepted types.
NVCHAT_KEYS: dict[str, tuple[type, ...]] = {"deterministic": (bool,), "seed": (int,),
                                            "max_streaming_seconds": (int, float, type(None)), "stats": (bool,),
                                            "turn_taking": (bool, dict), "listening_audio": (bool,),
                                            "tool_hold": (dict, type(None))}
# Fixed once the conversation runs: a later session.update may carry other values; they are taken
# (no error) but not applied, and session.updated lists them in nvchat.not_applied.
FIXED_AFTER_START = ("instructions", "deterministic", "seed", "max_streaming_seconds", "tools", "tool_hold")
# The GA session object's keys (openai's RealtimeSessionCreateRequest), and ours.
GA_SESSION_KEYS = frozenset({"type", "model", "instructions", "output_modalities", "audio", "tools", "tool_choice",
                             "include", "max_output_tokens", "parallel_tool_calls", "prompt", "reasoning",
                             "tracing", "truncation", "nvchat"})
GA_AUDIO_KEYS = {"input": frozenset({"format", "noise_reduction", "transcription", "turn_detection"}),
                 "output": frozenset({"format", "voice", "speed"})}
GA_FORMAT_KEYS = {"audio/pcm": frozenset({"type", "rate"}), "audio/pcmu": frozenset({"type"}),
                  "audio/pcma": frozenset({"type"})}
# A GA transcription session (openai's RealtimeTranscriptionSessionCreateRequest): its input only.
GA_TRANSCRIPTION_KEYS = frozenset({"type", "audio", "include", "nvchat"})
GA_TRANSCRIPTION_AUDIO_KEYS = frozenset({"input"})
GA_TOOL_KEYS = frozenset({"type", "name", "description", "parameters"})  # a GA function tool
# mlx-vlm's session.update (mlx_vlm/server/realtime.py reads these), and ours.
MLX_SESSION_KEYS = frozenset({"model", "system_prompt", "seed", "max_streaming_seconds", "nvchat"})
_MLX_ONLY = ("system_prompt", "seed", "max_streaming_seconds")


class ClientError(Exception):
    """A problem with what the client sent: answered with an ``error`` event, the connection stays."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


@dataclasses.dataclass
class SessionConfig:
    """A connection's session settings, as its ``session.update`` messages left them."""

    instructions: str | None = None  # the system prompt; None: the model's default
    input_rate: int = 24000  # Hz of the client's audio, one of INPUT_RATES or G711_RATE
    output_rate: int = 24000  # Hz of the audio sent, one of OUTPUT_RATES or G711_RATE
    input_format: str = "audio/pcm"  # one of AUDIO_FORMATS
    output_format: str = "audio/pcm"  # one of AUDIO_FORMATS
    deterministic: bool = False  # StreamingOptions.deterministic
    seed: int = 0  # StreamingOptions.seed
    max_streaming_seconds: float | None = None  # StreamingOptions.max_streaming_seconds
    stats: bool = False  # send an nvchat.stats event every fifth frame
    tools: list = dataclasses.field(default_factory=list)  # the GA function tools offered to the model
    tool_choice: Any = "auto"  # always "auto": the model decides when it calls a tool
    accepted: dict = dataclasses.field(default_factory=dict)  # GA keys taken as given (not acted on)
    turn_taking: Any = None  # a TurnTakingConfig (NVIDIA's policy) or None (the raw model)
    base_turn_taking: Any = None  # the server's policy, which the client's GA turn_detection adjusts
    turn_taking_given: bool = False  # nvchat.turn_taking was sent: it wins over turn_detection
    listening_audio: bool = False  # send the audio of frames where the model only listens
    # NVIDIA's tool pipeline for the session's calls (its stock settings; None: calls stream a token a frame)
    tool_hold: ToolHold | None = dataclasses.field(default_factory=ToolHold)
    messages: list = dataclasses.field(default_factory=list)  # message items created before the start, rendered

    def prompt(self, default: str | None) -> str | None:
        """The system prompt the session starts with: the instructions (or the model's default),
        then the message items created before the start, one line each (items.render_message)."""
        base = default if self.instructions is None else self.instructions
        if not self.messages:
            return self.instructions
        return "\n".join(part for part in (base, *self.messages) if part)

    def options(self, default_prompt: str | None = None) -> StreamingOptions:
        kwargs: dict[str, Any] = {"tools": self.tools} if self.tools else {}
        if self.turn_taking is not None:
            kwargs["turn_taking"] = self.turn_taking
        try:
            return StreamingOptions(system_prompt=self.prompt(default_prompt), seed=self.seed,
                                    deterministic=self.deterministic, tool_hold=self.tool_hold,
                                    max_streaming_seconds=self.max_streaming_seconds, **kwargs)
        except ValueError as e:
            raise ClientError("invalid_value", f"cannot start the session: {e}", "session") from None


def is_mlx_update(session: dict) -> bool:
    """mlx-vlm's form: no GA ``type``, and one of mlx-vlm's own keys."""
    return "type" not in session and any(k in session for k in _MLX_ONLY)


def _check_keys(obj: dict, allowed: frozenset, where: str) -> None:
    for key in obj:
        if key not in allowed:
            raise ClientError("unknown_parameter", f"unknown parameter {where}.{show(key, 40)[1:-1]}; {where} takes "
                              f"{', '.join(sorted(allowed))}", f"{where}.{show(key, 40)[1:-1]}")


def _object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ClientError("invalid_value", f"{where} must be an object, got {show(value)}", where)
    return value


def _format(fmt: Any, allowed: tuple[int, ...], where: str) -> tuple[str, int]:
    """A GA audio format as (type, rate): pcm16 at one of ``allowed``, or G.711 at 8 kHz."""
    fmt = _object(fmt, where)
    kind = fmt.get("type", "audio/pcm")
    if kind not in AUDIO_FORMATS:
        raise ClientError("unsupported_audio_format", f"{where}.type must be one of {', '.join(AUDIO_FORMATS)}, got "
                          f"{show(kind)}", f"{where}.type")
    if kind != "audio/pcm" and "rate" in fmt:  # not in GA's G.711 formats: the law fixes the rate
        raise ClientError("unsupported_audio_format", f"{where}: {kind} is 8 kHz and takes no 'rate'",
                          f"{where}.rate")
    _check_keys(fmt, GA_FORMAT_KEYS[kind], where)
    if kind != "audio/pcm":
        return kind, G711_RATE
    rate = fmt.get("rate", 24000)
    if isinstance(rate, bool) or not isinstance(rate, int) or rate not in allowed:
        raise ClientError("unsupported_audio_format", f"{where}.rate {show(rate)} is not supported; use one of "
                          f"{list(allowed)}", f"{where}.rate")
    return kind, rate


def format_json(kind: str, rate: int) -> dict:
    """A format as GA shows it: pcm16 with its rate; G.711 by its type alone (always 8 kHz)."""
    return {"type": kind, "rate": rate} if kind == "audio/pcm" else {"type": kind}


def decode_audio(data: bytes, kind: str) -> np.ndarray:
    """An append's bytes in the format ``kind`` as float32 samples (pcm16: ``int16 / 32768``; G.711
    decodes to the same 16-bit scale)."""
    if kind == "audio/pcm":
        return pcm16_decode(data)
    return g711_decode(data, kind[len("audio/"):])


def encode_audio(samples: np.ndarray, kind: str) -> bytes:
    """Float samples in the format ``kind`` (pcm16's rounding, then G.711's code for those formats)."""
    if kind == "audio/pcm":
        return pcm16_encode(samples)
    return g711_encode(samples, kind[len("audio/"):])


def turn_taking_config(value: Any, where: str = "session.nvchat.turn_taking") -> Any:
    """``nvchat.turn_taking`` as a policy: ``false`` -> None (the raw model), ``true`` -> NVIDIA's
    values, an object -> NVIDIA's values with those fields changed (checked by the config itself)."""
    if value is False:
        return None
    from ..turn_taking import TurnTakingConfig

    if value is True:
        return TurnTakingConfig()
    _known_keys(_object(value, where), TurnTakingConfig, where)
    try:
        return TurnTakingConfig.from_dict(value)
    except (ValueError, TypeError) as e:
        raise ClientError("invalid_value", f"session.nvchat.{e}", where) from None


def _known_keys(value: dict, fields_of: type, where: str) -> None:
    """An ``unknown_parameter`` naming the first key of ``value`` that is not a field of ``fields_of``."""
    names = sorted(f.name for f in dataclasses.fields(fields_of))
    for key in value:
        if key not in names:
            raise ClientError("unknown_parameter", f"unknown parameter {where}.{show(key, 40)[1:-1]}; {where} takes "
                              f"{', '.join(names)}", f"{where}.{show(key, 40)[1:-1]}")


_TOOL_HOLD_FIELD = re.compile(r"tool_hold\.(\w+(?:\[[^\]]*\])*)")


def tool_hold_config(value: dict, where: str = "session.nvchat.tool_hold") -> ToolHold:
    """``nvchat.tool_hold`` as a :class:`ToolHold`: some of its fields, the rest NVIDIA's stock; a bad
    value is an ``invalid_value`` whose ``param`` names the field (``session.nvchat.tool_hold.timeout_s``,
    ``...generic[0]``), an unknown key an ``unknown_parameter``."""
    _known_keys(value, ToolHold, where)
    try:
        return ToolHold.from_mapping(value)
    except (ValueError, TypeError) as e:
        field = _TOOL_HOLD_FIELD.match(str(e))
        raise ClientError("invalid_value", f"session.nvchat.{e}",
                          f"{where}.{field.group(1)}" if field else where) from None


def check_tool_hold(cfg: SessionConfig, session: dict) -> None:
    """The phrases per tool (``tool_hold.on_hold``) name the session's tools, or ``"default"``: checked
    against the tools in effect after the update, naming what the update changed."""
    if cfg.tool_hold is None or not cfg.tools:
        return
    from ..tool_prompt import validate_tools

    try:
        cfg.tool_hold.check_tools(tool["name"] for tool in validate_tools(cfg.tools))
    except ValueError as e:
        param = "session.nvchat.tool_hold.on_hold" if "tool_hold" in session.get("nvchat", {}) else "session.tools"
        raise ClientError("invalid_value", f"session.nvchat.{e}", param) from None


NEVER = 2 ** 31 - 1  # frames: a policy rule that never acts
# semantic_vad's eagerness as a factor on the end-of-utterance silence (low waits longer, high less)
EAGERNESS = {"low": 2.0, "medium": 1.0, "auto": 1.0, "high": 0.5}
# GA turn_detection fields the policy has no counterpart for (NVIDIA's RNNT replaces the VAD)
DETECTION_NOT_APPLIED = ("threshold", "prefix_padding_ms", "idle_timeout_ms")


def turn_detection_policy(detection: Any, base: Any, frame_ms: float = 80.0) -> Any:
    """The client's GA ``audio.input.turn_detection`` mapped onto the server's policy ``base`` (None:
    the raw model, which stays so). Fields not sent keep ``base``'s values (docs/server.md, "Turns"):
    ``silence_duration_ms`` -> ``eou_frames``; ``eagerness`` scales ``eou_frames``; ``create_response:
    false`` -> no end of utterance or first-turn fallback gives the agent the turn; ``interrupt_response:
    false`` -> no barge-in; null (or pipecat's false) -> manual turns, both."""
    if base is None:
        return None
    if not detection:
        return dataclasses.replace(base, eou_frames=NEVER, first_turn_fallback_frames=NEVER, barge_in_frames=NEVER)
    changes: dict[str, int] = {}
    if detection["type"] == "server_vad" and "silence_duration_ms" in detection:
        changes["eou_frames"] = max(1, round(detection["silence_duration_ms"] / frame_ms))
    if detection["type"] == "semantic_vad":
        changes["eou_frames"] = max(1, round(base.eou_frames * EAGERNESS[detection.get("eagerness", "auto")]))
    if detection.get("create_response") is False:
        changes.update(eou_frames=NEVER, first_turn_fallback_frames=NEVER)
    if detection.get("interrupt_response") is False:
        changes["barge_in_frames"] = NEVER
    return dataclasses.replace(base, **changes)


def turn_taking_json(config: Any) -> Any:
    """The policy in effect as session.updated shows it: false, or its fields."""
    return False if config is None else config.to_dict()


def _nvchat(cfg: SessionConfig, extension: Any, where: str) -> None:
    for key, value in _object(extension, where).items():
        kinds = NVCHAT_KEYS.get(key)
        if kinds is None:
            raise ClientError("unknown_parameter", f"unknown parameter {where}.{show(key, 40)[1:-1]}; {where} takes "
                              f"{', '.join(sorted(NVCHAT_KEYS))}", f"{where}.{show(key, 40)[1:-1]}")
        if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
            raise ClientError("invalid_value", f"{where}.{key} has the wrong type: {show(value)}", f"{where}.{key}")
        if key == "turn_taking":
            cfg.turn_taking = turn_taking_config(value, f"{where}.turn_taking")
            cfg.turn_taking_given = True
            continue
        if key == "tool_hold":
            cfg.tool_hold = None if value is None else tool_hold_config(value, f"{where}.tool_hold")
            continue
        try:
            StreamingOptions.check(key, value)
        except ValueError as e:
            raise ClientError("invalid_value", f"{where}.{e}", f"{where}.{key}") from None
        setattr(cfg, key, value)


def _pass_through(cfg: SessionConfig, path: str, value: Any) -> None:
    """A GA value the model does not act on: checked against the GA schema, kept to show back."""
    try:
        check(value, PASS_THROUGH[path], f"session.{path}")
    except UnknownKey as e:
        raise ClientError("unknown_parameter", str(e), e.path) from None
    except ValueError as e:
        raise ClientError("invalid_value", str(e), f"session.{path}") from None
    cfg.accepted[path] = value


def _ga_tools(value: Any, tools_supported: bool) -> list:
    if not isinstance(value, list):
        raise ClientError("invalid_value", f"session.tools must be a list, got {show(value)}", "session.tools")
    for i, tool in enumerate(value):
        if isinstance(tool, dict):
            _check_keys(tool, GA_TOOL_KEYS, f"session.tools[{i}]")
    if value and not tools_supported:
        raise ClientError("tools_unsupported", "this build of nvchat_torch has no tool calls yet", "session.tools")
    if value:
        from ..tools import validate_tools

        try:
            validate_tools(value)
        except (ValueError, TypeError) as e:
            raise ClientError("invalid_value", f"session.{e}", "session.tools") from None
    return value


def ga_update(config: SessionConfig, session: Any, *, tools_supported: bool) -> SessionConfig:
    """``config`` with a GA ``session.update``'s ``session`` applied (a new object; ``config`` is kept).
    ``null`` is taken only where the GA schema takes it (``turn_detection``, ``tracing``, ...)."""
    session = _object(session, "session")
    kind = session.get("type", "realtime")
    if kind not in ("realtime", "transcription"):
        raise ClientError("invalid_value", f"session.type must be 'realtime' or 'transcription', got {show(kind)}",
                          "session.type")
    _check_keys(session, GA_TRANSCRIPTION_KEYS if kind == "transcription" else GA_SESSION_KEYS, "session")
    if kind == "transcription" and "audio" in session:
        _check_keys(_object(session["audio"], "session.audio"), GA_TRANSCRIPTION_AUDIO_KEYS, "session.audio")
    cfg = dataclasses.replace(config, tools=list(config.tools), accepted=dict(config.accepted))
    # A transcription session is taken, and runs as the conversation it is: the model always listens
    # and speaks, and its transcript of the user is the RNNT's (shown in nvchat.not_applied).
    if kind == "transcription":
        cfg.accepted["type"] = kind
    elif "type" in session:
        cfg.accepted.pop("type", None)
    if "instructions" in session:
        if not isinstance(session["instructions"], str):
            raise ClientError("invalid_value", "session.instructions must be a string", "session.instructions")
        cfg.instructions = session["instructions"]
    if "audio" in session:
        audio = _object(session["audio"], "session.audio")
        _check_keys(audio, frozenset(GA_AUDIO_KEYS), "session.audio")
        for side, allowed in (("input", INPUT_RATES), ("output", OUTPUT_RATES)):
            where = f"session.audio.{side}"
            if side not in audio:
                continue
            part = _object(audio[side], where)
            _check_keys(part, GA_AUDIO_KEYS[side], where)
            if "format" in part:
                fmt, rate = _format(part["format"], allowed, f"{where}.format")
                setattr(cfg, f"{side}_format", fmt)
                setattr(cfg, f"{side}_rate", rate)
            for key in sorted(GA_AUDIO_KEYS[side] - {"format"}):
                if key in part:
                    _pass_through(cfg, f"audio.{side}.{key}", part[key])
    if "nvchat" in session:
        _nvchat(cfg, session["nvchat"], "session.nvchat")
    if "tools" in session:
        cfg.tools = _ga_tools(session["tools"], tools_supported)
    # Valid GA values the model cannot honour (it always speaks; it decides itself when to call a
    # tool): taken, and shown in nvchat.not_applied; session.updated shows what is in effect.
    for key in ("model", "include", "max_output_tokens", "parallel_tool_calls", "prompt", "reasoning", "tracing",
                "truncation", "output_modalities", "tool_choice"):
        if key in session:
            _pass_through(cfg, key, session[key])
    for key, in_effect in (("output_modalities", ["audio"]), ("tool_choice", "auto")):
        if cfg.accepted.get(key, in_effect) == in_effect:
            cfg.accepted.pop(key, None)
    check_tool_hold(cfg, session)
    if "audio.input.turn_detection" in cfg.accepted and not cfg.turn_taking_given:
        cfg.turn_taking = turn_detection_policy(cfg.accepted["audio.input.turn_detection"], cfg.base_turn_taking)
    return cfg


def not_applied(cfg: SessionConfig) -> list[str]:
    """The GA keys given and not acted on, for ``session.updated``'s ``nvchat.not_applied``: the client's
    turn_detection is applied (but for the VAD's own fields) unless ``nvchat.turn_taking`` wins."""
    keys = set(cfg.accepted)
    detection = cfg.accepted.get("audio.input.turn_detection")
    if "audio.input.turn_detection" in keys and not cfg.turn_taking_given and cfg.base_turn_taking is not None:
        keys.discard("audio.input.turn_detection")
        keys |= {f"audio.input.turn_detection.{k}" for k in DETECTION_NOT_APPLIED if k in (detection or {})}
    return sorted(keys)


def mlx_update(config: SessionConfig, session: Any, *, input_rate: int, output_rate: int) -> SessionConfig:
    """``config`` with mlx-vlm's ``session.update`` applied: the model's own rates, and ``nvchat`` as in GA."""
    session = _object(session, "session")
    _check_keys(session, MLX_SESSION_KEYS, "session")
    prompt = session.get("system_prompt")
    seed = session.get("seed", 0)
    limit = session.get("max_streaming_seconds")
    if not isinstance(prompt, (str, type(None))):
        raise ClientError("invalid_value", "session.system_prompt must be a string", "session.system_prompt")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ClientError("invalid_value", f"session.seed must be an int, got {show(seed)}", "session.seed")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))):
        raise ClientError("invalid_value", "session.max_streaming_seconds must be a positive number",
                          "session.max_streaming_seconds")
    for key, value in (("seed", seed), ("max_streaming_seconds", limit)):
        try:
            StreamingOptions.check(key, value)
        except ValueError as e:
            raise ClientError("invalid_value", f"session.{e}", f"session.{key}") from None
    if not isinstance(session.get("model", ""), (str, type(None))):
        raise ClientError("invalid_value", "session.model must be a string", "session.model")
    cfg = dataclasses.replace(config, instructions=prompt, seed=seed, max_streaming_seconds=limit,
                              input_rate=input_rate, output_rate=output_rate, input_format="audio/pcm",
                              output_format="audio/pcm")
    if "nvchat" in session:  # after mlx-vlm's own keys: nvchat.seed wins over seed
        _nvchat(cfg, session["nvchat"], "session.nvchat")
    return cfg
