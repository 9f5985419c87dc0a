"""Tool calls: NVIDIA's prompt format, calls parsed from the function channel, results fed back."""

from __future__ import annotations

import hashlib
import json

import jinja2
import numpy as np
import pytest
import torch

import nvchat_torch as nv
from mlx_oracle import synth_audio
from test_session import as_reference_shows
from nvchat_torch.diagnostics import count_host_reads
from nvchat_torch.tiny import build_tokenizer
from nvchat_torch.tools import (
    TOOL_SYSTEM_MESSAGE,
    ToolChannel,
    format_tool_response,
    parse_tool_calls,
    render_system_prompt,
    validate_tools,
)

# NVIDIA's function-calling prompt template, verbatim (NeMo branch nemotron-labs-voicechat,
# examples/speechlm2/function_calling/template.jinja): the fixture the renderer is checked against.
NVIDIA_TEMPLATE = r'''{#-
    Voicechat tool-calling chat template for Nano v2.

    Adapted from the full nano_v2_chat_template.jinja released with Nemotron Nano v2
    (see https://huggingface.co/nvidia/NVIDIA-Nemotron-Nano-9B-v2).
    This template renders only the system prompt (with tool definitions
    injected), since the s2s_voicechat backend receives audio as user
    input and tokenises the system prompt separately.

    Variables:
      - system_message (str): original system prompt text.
      - tools (list|None): OpenAI-format tool definitions.
-#}
{{- system_message -}}
{%- if tools -%}
    {%- if system_message != '' -%}
        {{- '\n\n' -}}
    {%- endif -%}
    {{- 'You can use the following tools to assist the user if required:' -}}
    {{- '\n<AVAILABLE_TOOLS>[' -}}
    {%- for tool in tools -%}
        {%- set _t = (tool.function if tool.function is defined else tool) -%}
        {%- set _d = {} -%}
        {%- for k, v in _t.items() if k != 'type' -%}
            {%- set _ = _d.update({k: v}) -%}
        {%- endfor -%}
        {{- _d | tojson -}}
        {{- ', ' if not loop.last else '' -}}
    {%- endfor -%}
    {{- ']</AVAILABLE_TOOLS>\n\n' -}}

    {{- 'If you decide to call any tool(s), use the following format:\n' -}}
    {{- '<TOOLCALL>[{"name": "tool_name1", "arguments": "tool_args1"}, ' -}}
    {{- '{"name": "tool_name2", "arguments": "tool_args2"}]' -}}
    {{- '</TOOLCALL>\n\n' -}}

    {{- 'The user will execute tool-calls and return responses from tool(s) in this format:\n' -}}
    {{- '<TOOL_RESPONSE>[{"tool_response1"}, {"tool_response2"}]</TOOL_RESPONSE>\n\n' -}}

    {{- 'Based on the tool responses, you can call additional tools if needed, correct tool calls if any errors are found, or just respond to the user.' -}}
{%- endif -%}
'''

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "name": "get_time", "description": "The local time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": []}}
TOOLS = [WEATHER, TIME]
PROMPT = "Be brief."


def nvidia_render(system_message, tools) -> str:
    """What NVIDIA's offline function-calling script renders (a plain jinja2 Environment)."""
    return jinja2.Environment().from_string(NVIDIA_TEMPLATE).render(system_message=system_message, tools=tools)


TOOL_LISTS = {
    "nested-and-flat": TOOLS,
    "non-ascii": [{"type": "function", "function": {
        "name": "wetter", "description": "Das Wetter in München, Zürich oder 東京 (°C) \U0001F324",
        "parameters": {"type": "object", "properties": {"stadt": {"type": "string", "description": "Straße"}}}}}],
    "json-escapes": [{"type": "function", "name": "quote", "description": 'Say "hi" <b>&</b> it\'s\\ a\ttab\nline',
                      "parameters": {"type": "object", "properties": {"q<>&'": {"type": "string", "enum": ["a\"b"]}},
                                     "required": ["q<>&'"]}}],
    "unsorted-keys-extra-fields": [{"function": {"parameters": {"type": "object", "required": [], "properties": {}},
                                                 "strict": True, "name": "z_tool", "type": "function"}},
                                   {"name": "a_tool", "type": "function", "description": "", "parameters": {}}],
    "five": [{"type": "function", "name": f"tool_{i}", "description": f"Tool number {i}",
              "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}} for i in range(5)],
}


@pytest.mark.parametrize("message", [PROMPT, "", TOOL_SYSTEM_MESSAGE, "  line one\nline two  "],
                         ids=["short", "empty", "default", "whitespace"])
@pytest.mark.parametrize("tools", list(TOOL_LISTS.values()), ids=list(TOOL_LISTS))
def test_render_matches_nvidias_template(tools, message):
    assert render_system_prompt(message, tools) == nvidia_render(message, tools)


def test_render_without_tools_and_the_default_message():
    assert render_system_prompt(PROMPT, None) == render_system_prompt(PROMPT, []) == nvidia_render(PROMPT, []) == PROMPT
    assert render_system_prompt(None, None) == ""
    assert render_system_prompt(None, TOOLS) == nvidia_render(TOOL_SYSTEM_MESSAGE, TOOLS)
    # NVIDIA's DEFAULT_SYSTEM_MESSAGE of examples/speechlm2/offline_voicechat_fc_infer.py (2144 characters)
    assert len(TOOL_SYSTEM_MESSAGE) == 2144
    assert hashlib.sha256(TOOL_SYSTEM_MESSAGE.encode()).hexdigest() == \
        "58423497288d39651e6ec677481a8a63dd11c8b100a28265df5d6e08ca00c103"


@pytest.mark.parametrize("tools,match", [
    ([TIME] * 3 + [WEATHER] * 3, "at most 5"),
    ({"name": "x"}, "list of tool dicts"),
    (["get_weather"], r"tools\[0\] must be a dict"),
    ([{"type": "function", "description": "no name"}], r"tools\[0\] needs a non-empty string 'name'"),
    ([{"type": "function", "function": "get_weather"}], r"tools\[0\].function must be a dict"),
    ([{"type": "web_search"}], "only function tools"),
    ([TIME, {"type": "function", "name": "get_time"}], "given twice"),
    ([{"type": "function", "name": "x", "parameters": [1]}], "parameters must be a dict"),
    ([{"type": "function", "name": "x", "description": 3}], "description must be a string"),
    ([{"type": "function", "name": "x", "parameters": {"default": object()}}], "not JSON-serialisable"),
])
def test_bad_tools_are_rejected_with_a_clear_error(tools, match):
    with pytest.raises(ValueError, match=match):
        validate_tools(tools)
    with pytest.raises(ValueError, match=match):
        nv.StreamingOptions(tools=tools)


def test_parse_tool_calls():
    assert parse_tool_calls('<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>') == \
        [("get_weather", {"city": "Paris"})]
    assert parse_tool_calls('{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}') == [("get_time", {"zone": "UTC"})]
    assert parse_tool_calls('<TOOLCALL>[{"name": "a"}, {"name": "b", "arguments": ""}]</TOOLCALL>') == \
        [("a", {}), ("b", {})]
    for text, match in [('<TOOLCALL>[{"name": "a", "arguments": {"x": 1}]</TOOLCALL>', "not valid JSON"),
                        ("<TOOLCALL></TOOLCALL>", "no JSON"),
                        ("<TOOLCALL>[]</TOOLCALL>", "empty"),
                        ('<TOOLCALL>["a"]</TOOLCALL>', "not a JSON object"),
                        ('<TOOLCALL>[{"arguments": {}}]</TOOLCALL>', "no string 'name'"),
                        ('<TOOLCALL>[{"name": "a", "arguments": "{x"}]</TOOLCALL>', "arguments string is not valid"),
                        ('<TOOLCALL>[{"name": "a", "arguments": [1]}]</TOOLCALL>', "must be a JSON object")]:
        with pytest.raises(ValueError, match=match):
            parse_tool_calls(text)


def test_tool_response_is_serialised_as_nvidias_offline_script():
    # NVIDIA's example response file (function_calling/random_number_response.json) gives this text
    assert format_tool_response([{"result": 20}]) == '<TOOL_RESPONSE>[{"result": 20}]</TOOL_RESPONSE>'
    assert format_tool_response([{"b": 1, "a": [1.5, None, True]}, "sunny"]) == \
        '<TOOL_RESPONSE>[{"b": 1, "a": [1.5, null, true]}, "sunny"]</TOOL_RESPONSE>'
    # a string holding JSON is that JSON, re-serialised with json.dumps' defaults; non-ASCII is escaped
    assert format_tool_response(['{"temp":21,"sky":"clear"}', "Zürich"]) == \
        '<TOOL_RESPONSE>[{"temp": 21, "sky": "clear"}, "Z\\u00fcrich"]</TOOL_RESPONSE>'
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        format_tool_response([{1, 2}])


# --------------------------------------------------------------------------------------
# The parser on its own (the tokenizer with the tool-call markers, no model)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import PreTrainedTokenizerFast

    from nvchat_torch.tiny import SPECIAL_TOKENS_MAP

    return PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(300, specials=23), **SPECIAL_TOKENS_MAP)


def feed_text(channel: ToolChannel, tokenizer, text: str, pads_every: int = 0) -> list:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if pads_every:  # PAD inside a span is dropped
        ids = [t for i, t in enumerate(ids) for t in ((t, 12) if i % pads_every == 0 else (t,))]
    return [e for frame, token in enumerate(ids) for e in channel.feed(token, frame)]


def test_parser_on_the_function_channel(tokenizer):
    channel = ToolChannel(tokenizer, TOOLS, pad_id=12, vocab_size=320, device=torch.device("cpu"))
    events = feed_text(channel, tokenizer, 'noise <SPECIAL_20><TOOLCALL>[{"name": "get_weather", "arguments": '
                                           '{"city": "Z\\u00fcrich"}}]</TOOLCALL><SPECIAL_21> <SPECIAL_22>', pads_every=3)
    assert [(e.kind, e.name, e.arguments, e.call_id) for e in events] == \
        [("tool_call", "get_weather", {"city": "Zürich"}, "call_1")]
    assert events[0].text == '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Z\\u00fcrich"}}]</TOOLCALL>'
    events = feed_text(channel, tokenizer, '<SPECIAL_20><TOOLCALL>[{"name": "get_time", "arguments": "{}"}, '
                                           '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}]'
                                           '</TOOLCALL><SPECIAL_21>')
    assert [(e.kind, e.name, e.arguments, e.call_id) for e in events] == \
        [("tool_call", "get_time", {}, "call_2"), ("tool_call", "get_weather", {"city": "Oslo"}, "call_3")]
    events = feed_text(channel, tokenizer, '<SPECIAL_20><TOOLCALL>[{"name": "send_email"}, {"name": "get_time"}]'
                                           '</TOOLCALL><SPECIAL_21>')
    assert [(e.kind, e.name, e.call_id) for e in events] == [("tool_call_error", "send_email", None),
                                                             ("tool_call", "get_time", "call_4")]
    assert "not among the tools offered" in events[0].reason
    events = feed_text(channel, tokenizer, '<SPECIAL_20><TOOLCALL>[{"name": "get_time"</TOOLCALL><SPECIAL_21>')
    assert [e.kind for e in events] == ["tool_call_error"] and "not valid JSON" in events[0].reason
    assert events[0].text == '<TOOLCALL>[{"name": "get_time"</TOOLCALL>'
    events = feed_text(channel, tokenizer, '<SPECIAL_20><TOOLCALL>[{"na<SPECIAL_20><TOOLCALL>[{"name": "get_time"}]'
                                           '</TOOLCALL><SPECIAL_21><SPECIAL_21>')
    assert [e.kind for e in events] == ["tool_call_error", "tool_call"]
    assert "before this one closed" in events[0].reason
    assert ToolChannel(tokenizer, None, pad_id=12, vocab_size=320, device=torch.device("cpu")).feed(20, 0) == []


def test_tools_need_the_call_markers_in_the_tokenizer():
    model = nv.load_tiny_model(device="cpu")  # its tokenizer stops at <SPECIAL_20>
    with pytest.raises(ValueError, match="<SPECIAL_21>"):
        model.create_streaming_session(nv.StreamingOptions(tools=TOOLS))
    model.create_streaming_session(nv.StreamingOptions())  # still usable


# --------------------------------------------------------------------------------------
# In a session (a tiny checkpoint written by MLX, its tokenizer with <SPECIAL_20..22>)


@pytest.fixture(scope="module")
def tool_ckpt(make_checkpoint):
    return make_checkpoint(seed=0, specials=23)


@pytest.fixture(scope="module")
def model(tool_ckpt):
    return nv.load_model(tool_ckpt, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def wave():
    return synth_audio(8.0)


class Driver:
    """Pushes the test signal one frame at a time and keeps every event."""

    def __init__(self, model, wave, **options):
        options.setdefault("tool_hold", None)  # a call and its result a token per frame (test_tool_pipeline: the pipeline)
        self.session = model.create_streaming_session(nv.StreamingOptions(deterministic=True, **options))
        self.wave = wave
        self.events = []

    def frames(self, n: int) -> list:
        out = []
        for _ in range(n):
            i = self.session.frame_index % (len(self.wave) // 1280)  # the signal loops
            out += self.session.push_audio(self.wave[i * 1280:(i + 1) * 1280], 16000)
        self.events += out
        return out


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def channel(events, kind, frames=None) -> list[tuple[int, int]]:
    return [(e.frame_index, e.token_id) for e in events if e.kind == kind and (frames is None or e.frame_index in frames)]


def test_forced_call_then_result_injection(model, wave):
    tok = model.tokenizer
    drive = Driver(model, wave, system_prompt=PROMPT, tools=TOOLS)
    unanswered = Driver(model, wave, system_prompt=PROMPT, tools=TOOLS)
    call = ids(tok, '<SPECIAL_20><TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
                    '</TOOLCALL><SPECIAL_21>')
    for d in (drive, unanswered):
        d.frames(3)
        d.session.force_tokens("function", call)
    start = drive.session.frame_index
    events = drive.frames(len(call))
    # the forced ids are the function channel's outputs, one per frame
    assert channel(events, "function_delta") == list(zip(range(start, start + len(call)), call))
    calls = [e for e in events if e.kind in ("tool_call", "tool_call_error")]
    assert [(e.kind, e.frame_index, e.name, e.arguments) for e in calls] == \
        [("tool_call", start + len(call) - 1, "get_weather", {"city": "Paris"})]
    assert calls[0].text == '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>'
    call_id = calls[0].call_id
    assert isinstance(call_id, str) and drive.session.pending_tool_calls == [call_id]

    drive.session.send_tool_result(call_id, {"temperature_c": 21, "sky": "clear"})
    assert drive.session.pending_tool_calls == []
    response = ids(tok, '<TOOL_RESPONSE>[{"temperature_c": 21, "sky": "clear"}]</TOOL_RESPONSE>')
    inject = range(drive.session.frame_index, drive.session.frame_index + len(response))
    prev_function = []
    for _ in response:
        drive.frames(1)
        frames = drive.session._frame_step  # the next frame's function input, on the device
        prev_function.append(int(frames._ids.tensor[drive.session._slot, 1]))
    after = drive.frames(3)
    # exactly the tokenised <TOOL_RESPONSE> text, one token per frame, fed back as the next input
    assert channel(drive.events, "function_delta", inject) == list(zip(inject, response))
    assert prev_function == response
    # the text channel is held at PAD meanwhile (the same session, the call unanswered, speaks then)
    unanswered.frames(inject.stop)
    assert channel(unanswered.events, "assistant_text_delta", inject)
    assert channel(drive.events, "assistant_text_delta", inject) == []
    # then the model drives both channels again, and audio keeps coming
    assert not drive.session._tools.forcing and [e.kind for e in after].count("audio") == 3
    with pytest.raises(ValueError, match="already been answered"):
        drive.session.send_tool_result(call_id, "again")
    with pytest.raises(ValueError, match="unknown call_id"):
        drive.session.send_tool_result("call_999", "x")
    assert [e.kind for e in drive.frames(1)].count("audio") == 1


def test_two_calls_in_a_span_get_one_response_once_both_are_answered(model, wave):
    tok = model.tokenizer
    drive = Driver(model, wave, tools=TOOLS, system_prompt="")
    drive.frames(2)
    drive.session.force_tokens("function", ids(
        tok, '<SPECIAL_20><TOOLCALL>[{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}, '
             '{"name": "get_weather", "arguments": {"city": "Oslo"}}]</TOOLCALL><SPECIAL_21>'))
    while drive.session._tools.forcing:
        drive.frames(1)
    calls = [e for e in drive.events if e.kind == "tool_call"]
    assert [(e.name, e.arguments) for e in calls] == [("get_time", {"zone": "CET"}), ("get_weather", {"city": "Oslo"})]
    assert calls[0].call_id != calls[1].call_id
    assert sorted(drive.session.pending_tool_calls) == sorted(e.call_id for e in calls)
    drive.session.send_tool_result(calls[1].call_id, "Rain, 9 degrees")  # answered out of order
    assert not drive.session._tools.forcing  # nothing is injected until the span has all its results
    drive.frames(2)
    drive.session.send_tool_result(calls[0].call_id, '{"time": "14:05"}')
    response = ids(tok, '<TOOL_RESPONSE>[{"time": "14:05"}, "Rain, 9 degrees"]</TOOL_RESPONSE>')
    inject = range(drive.session.frame_index, drive.session.frame_index + len(response))
    drive.frames(len(response))
    assert channel(drive.events, "function_delta", inject) == list(zip(inject, response))


def test_malformed_and_unknown_calls_give_errors_and_the_session_goes_on(model, wave):
    tok = model.tokenizer
    drive = Driver(model, wave, tools=TOOLS, system_prompt="")
    drive.frames(1)
    spans = ['<SPECIAL_20><TOOLCALL>[{"name": "get_weather", "arguments": {"city": </TOOLCALL><SPECIAL_21>',
             '<SPECIAL_20><TOOLCALL>[{"name": "book_flight", "arguments": {"to": "Rome"}}]</TOOLCALL><SPECIAL_21>',
             '<SPECIAL_20><TOOLCALL>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</TOOLCALL><SPECIAL_21>']
    for span in spans:
        drive.session.force_tokens("function", ids(tok, span))
    while drive.session._tools.forcing:
        drive.frames(1)
    tool_events = [e for e in drive.events if e.kind.startswith("tool_call")]
    assert [(e.kind, e.name) for e in tool_events] == [("tool_call_error", None), ("tool_call_error", "book_flight"),
                                                       ("tool_call", "get_time")]
    assert "not valid JSON" in tool_events[0].reason and tool_events[0].call_id is None
    assert tool_events[0].text == '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": </TOOLCALL>'
    assert "book_flight" in tool_events[1].reason and "get_weather" in tool_events[1].reason
    assert tool_events[2].arguments == {"zone": "UTC"}
    assert [e.kind for e in drive.frames(2)].count("audio") == 2


def test_force_tokens_on_the_text_channel_and_bad_requests(model, wave):
    tok = model.tokenizer
    drive = Driver(model, wave)  # no tools: forcing works, nothing is parsed
    drive.frames(2)
    words = ids(tok, " hello voice chat")
    with pytest.raises(ValueError, match="channel must be"):
        drive.session.force_tokens("audio", words)
    with pytest.raises(ValueError, match=r"token ids must be ints in \[0, 320\)"):
        drive.session.force_tokens("text", [5, 320])
    with pytest.raises(ValueError, match="list of token ids"):
        drive.session.force_tokens("text", "hello")
    drive.session.force_tokens("text", torch.tensor(words))
    drive.session.force_tokens("function", [20, 50])  # parsed only when tools are offered
    start = drive.session.frame_index
    events = drive.frames(len(words) + 1)
    assert channel(events, "assistant_text_delta", range(start, start + len(words))) == \
        list(zip(range(start, start + len(words)), words))
    assert channel(events, "function_delta", range(start, start + 2)) == [(start, 20), (start + 1, 50)]
    assert not [e for e in events if e.kind.startswith("tool_call")]
    assert " hello voice chat" in drive.session.text


def test_a_forced_frame_still_reads_the_host_once(model, wave):
    drive = Driver(model, wave, tools=TOOLS, system_prompt="")
    drive.frames(2)
    with count_host_reads() as plain:
        drive.frames(1)
    drive.session.force_tokens("function", [20, 30, 31])
    drive.session.force_tokens("text", [40])
    reads = []
    for _ in range(3):
        with count_host_reads() as forced:
            drive.frames(1)
        reads.append(sum(forced.values()))
    assert reads == [sum(plain.values())] * 3 and sum(plain.values()) <= 2, (plain, reads)


def run_reference(ref, wave, prompt) -> list:
    sess = ref.session.create_streaming_session(system_prompt=prompt, seed=0)
    events = [e for i in range(0, len(wave), 1280) for e in sess.push_audio(wave[i:i + 1280])] + sess.flush()
    return events


def test_a_session_with_tools_and_no_calls_streams_like_the_reference(model, tool_ckpt, reference, wave):
    """Given the rendered prompt, the reference streams what a session with tools streams. (The
    reference prefills the prompt one full timeline step per token, so the prompt is kept short.)"""
    short = wave[:int(2.5 * 16000)]
    tools = [{"type": "function", "name": "get_time", "parameters": {}}]
    ref_events = run_reference(reference(tool_ckpt), short, render_system_prompt("", tools))
    session = model.create_streaming_session(nv.StreamingOptions(system_prompt="", tools=tools, deterministic=True))
    events = [e for i in range(0, len(short), 1280) for e in session.push_audio(short[i:i + 1280], 16000)]
    events += session.flush()
    assert not [e for e in events if e.kind.startswith("tool_call")]
    call_start = model.tokenizer.convert_tokens_to_ids("<SPECIAL_20>")
    assert call_start not in [e.token_id for e in events if e.kind == "function_delta"]  # no call was started

    assert as_reference_shows(events) == as_reference_shows(ref_events)
    np.testing.assert_array_equal(np.stack([e.audio_codes for e in events if e.kind == "audio"]),
                                  np.stack([np.array(e.audio_codes) for e in ref_events if e.kind == "audio"]))


def test_generate_with_tools_uses_the_rendered_prompt(model, wave):
    short = wave[:16000]
    got = model.generate(short, system_prompt="", seed=0, deterministic=True, tools=TOOLS)
    want = model.generate(short, system_prompt=render_system_prompt("", TOOLS), seed=0, deterministic=True)
    plain = model.generate(short, seed=0, deterministic=True)
    np.testing.assert_array_equal(got.text_ids, want.text_ids)
    np.testing.assert_array_equal(got.function_ids, want.function_ids)
    assert not np.array_equal(got.text_ids, plain.text_ids)  # the prompt matters
    assert got.tool_calls == [] and plain.tool_calls == []


def test_a_call_still_open_when_the_stream_ends_is_reported(model, wave):
    tok = model.tokenizer
    drive = Driver(model, wave, tools=TOOLS, system_prompt="")
    span = ids(tok, '<SPECIAL_20><TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Par')
    drive.session.force_tokens("function", span)
    drive.frames(len(span))
    assert not [e for e in drive.events if e.kind.startswith("tool_call")]
    ending = drive.session.flush()
    assert [e.kind for e in ending] == ["tool_call_error", "done"]
    assert "ended inside a tool call" in ending[0].reason and ending[0].frame_index == drive.session.frame_index
    assert ending[0].text == '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Par'
    # the engine reports it the same way, with its done
    engine = model.create_engine(max_sessions=1)
    h = engine.open(nv.StreamingOptions(deterministic=True, tools=TOOLS, system_prompt="", tool_hold=None))
    h.force_tokens("function", span)
    h.push_audio(np.tile(wave, 2)[:len(span) * 1280], 16000)
    while h.pending_frames:
        engine.step()
    h.flush()
    assert [e.kind for e in engine.step()[h]] == ["tool_call_error", "done"]
