"""The tools in the system prompt: checking OpenAI-format function tools and rendering the system
prompt NVIDIA's function-calling template makes of them (``template.jinja`` of NeMo's
``nemotron-labs-voicechat`` branch); and the text a result goes back in (``<TOOL_RESPONSE>``). Parsing
calls and feeding results back is :mod:`nvchat_torch.tools`'."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["TOOL_SYSTEM_MESSAGE", "MAX_TOOLS", "CALL_START", "CALL_END", "RESPONSE_END", "validate_tools",
           "tool_result_json", "format_tool_response", "response_text",
           "render_system_prompt"]

# NVIDIA recommends at most 5 tools per session; more degrade the model's tool use.
MAX_TOOLS = 5
CALL_START, CALL_END, RESPONSE_END = "<SPECIAL_20>", "<SPECIAL_21>", "<SPECIAL_22>"

# The function-calling system message the checkpoint was trained with (NVIDIA's default for the
# function-calling scripts); used when tools are given and the caller gives no instructions.
TOOL_SYSTEM_MESSAGE = (
    "You are an AI voice assistant developed by NVIDIA. "
    "Your name is NVIDIA Voice Chat. "
    "Your job is to be helpful and harmless and have engaging conversations in English. "
    "Maintain a warm and friendly tone. "
    "Keep the dialogue open and ongoing. "
    "Be clear and direct, especially when answering yes or no questions and multiple-choice questions. "
    "Avoid long answers unless the user asks you to provide details or context. "
    "You must provide diverse responses and rephrase answers if the user asks the same question. "
    "DO NOT interrupt the user when they are speaking, let them finish their turn before answering."
    "\n\nWhen you receive a request, follow this decision process:\n"
    "1. Does the request match one of your available tools below? If yes, you MUST call that tool - "
    "never answer it directly from your own knowledge, even if you think you know the answer.\n"
    "2. Is it a general knowledge question (history, science, geography, math, facts, etc.)? "
    "If yes, answer directly from your own knowledge - do not call any tool.\n"
    "3. Does it require an external action or live data that none of your tools cover "
    "(e.g. ordering food, sending email)? If yes, politely say you don't have that capability."
    "\n\nNEVER say \"I don't have a tool for that\" for general knowledge questions you can answer yourself."
    "\n\nDO NOT use any tools when not needed to answer the user's requests, under no circumstance."
    "\n\nYou are an expert across history, geography, science, math, literature, biographies, languages, "
    "recipes, programming, current affairs, and general knowledge. When the user asks about any of these, "
    "answer directly and conversationally from your own knowledge - no <TOOLCALL>."
    "\n\nCall a tool ONLY when the user's request matches one of the tools listed in <AVAILABLE_TOOLS> below. "
    "For every other request, do not call any tool - just answer from your knowledge. "
    "Never invent or call a tool name that is not literally in <AVAILABLE_TOOLS>."
    "\n\nTool-call arguments must be values the user spoke. "
    "If a required argument is missing, ask the user; never guess."
    "\n\nIf a tool call fails or returns an error, do not retry the tool call for the same request. "
    "Tell the user that the API has an issue."
)

# The fixed text of the tool block (NVIDIA's template.jinja).
_TOOLS_INTRO = "You can use the following tools to assist the user if required:\n<AVAILABLE_TOOLS>["
_TOOLS_OUTRO = (
    "]</AVAILABLE_TOOLS>\n\n"
    "If you decide to call any tool(s), use the following format:\n"
    '<TOOLCALL>[{"name": "tool_name1", "arguments": "tool_args1"}, '
    '{"name": "tool_name2", "arguments": "tool_args2"}]</TOOLCALL>\n\n'
    "The user will execute tool-calls and return responses from tool(s) in this format:\n"
    '<TOOL_RESPONSE>[{"tool_response1"}, {"tool_response2"}]</TOOL_RESPONSE>\n\n'
    "Based on the tool responses, you can call additional tools if needed, correct tool calls if any "
    "errors are found, or just respond to the user."
)


def validate_tools(tools: Sequence[Mapping] | None) -> list[dict]:
    """Check OpenAI-format function tools and return their definitions as the prompt shows them:
    the ``function`` object of a nested tool (``{"type": "function", "function": {...}}``) or the
    flat tool itself, without its ``type`` key. Raises ``ValueError`` naming what is wrong."""
    if tools is None:
        return []
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ValueError(f"tools must be a list of tool dicts, got {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools per session (NVIDIA's limit for this model), got {len(tools)}")
    definitions, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise ValueError(f"{where} must be a dict, got {type(tool).__name__}")
        if tool.get("type", "function") != "function":
            raise ValueError(f"{where} has type {tool['type']!r}; only function tools are supported")
        if "function" in tool:
            definition = tool["function"]
            where += ".function"
            if not isinstance(definition, Mapping):
                raise ValueError(f"{where} must be a dict, got {type(definition).__name__}")
        else:
            definition = tool
        name = definition.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{where} needs a non-empty string 'name', got {name!r}")
        if name in names:
            raise ValueError(f"{where}: the tool name {name!r} is given twice")
        if not isinstance(definition.get("description", ""), str):
            raise ValueError(f"{where}.description must be a string")
        if not isinstance(definition.get("parameters", {}), Mapping):
            raise ValueError(f"{where}.parameters must be a dict (a JSON schema)")
        shown = {k: v for k, v in definition.items() if k != "type"}
        try:
            json.dumps(shown, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where} ({name!r}) is not JSON-serialisable: {e}") from None
        names.add(name)
        definitions.append(shown)
    return definitions


def _tojson(value: Any) -> str:
    """Jinja's ``tojson`` filter as NVIDIA's template renders it: ``json.dumps`` with sorted keys
    (ASCII, default separators), then ``< > & '`` as ``\\u`` escapes."""
    text = json.dumps(value, sort_keys=True)
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("'", "\\u0027"))


def render_system_prompt(system_prompt: str | None, tools: Sequence[Mapping] | None) -> str:
    """The system prompt text NVIDIA's function-calling template renders for ``system_prompt`` and
    ``tools``; the session tokenises it as ``[BOS] + encode(text) + [EOS]``.

    ``system_prompt=None`` with tools gives the trained :data:`TOOL_SYSTEM_MESSAGE`; without tools,
    the text is ``system_prompt`` itself (``""`` for None)."""
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise ValueError(f"system_prompt must be a string or None, got {type(system_prompt).__name__}")
    definitions = validate_tools(tools)
    if not definitions:
        return system_prompt or ""
    message = TOOL_SYSTEM_MESSAGE if system_prompt is None else system_prompt
    separator = "\n\n" if message != "" else ""
    return message + separator + _TOOLS_INTRO + ", ".join(_tojson(d) for d in definitions) + _TOOLS_OUTRO


def tool_result_json(output: Any) -> str:
    """One result as it goes into ``<TOOL_RESPONSE>``: ``json.dumps`` with its defaults, as NVIDIA's
    offline script. A string holding JSON is that JSON (re-serialised); any other string becomes a
    JSON string. Raises ``ValueError`` for what JSON cannot hold."""
    if isinstance(output, str):
        try:
            output = json.loads(output)
        except json.JSONDecodeError:
            pass
    try:
        return json.dumps(output)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the tool result is not JSON-serialisable: {e}") from None


def format_tool_response(outputs: Sequence[Any]) -> str:
    """``<TOOL_RESPONSE>[r1, r2]</TOOL_RESPONSE>``: the results of one call span, in call order."""
    return response_text([tool_result_json(o) for o in outputs])


def response_text(serialised: list[str]) -> str:
    """``<TOOL_RESPONSE>[r1, r2]</TOOL_RESPONSE>`` of results serialised already (:func:`tool_result_json`)."""
    return "<TOOL_RESPONSE>[" + ", ".join(serialised) + "]</TOOL_RESPONSE>"
