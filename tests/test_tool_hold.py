"""Speaking while a tool runs, the configuration half: ToolHold, the phrase layout, numbers in words."""

from __future__ import annotations

import json
import math
import random

import pytest

import nvchat_torch as nv
from nvchat_torch.tiny import build_tokenizer
from nvchat_torch.tool_hold import (
    ACKNOWLEDGEMENTS,
    MAX_PHRASE_CHARACTERS,
    REMINDERS,
    ToolHold,
    layout_phrase,
    spell_numbers,
    spell_tool_response_numbers,
    tool_response_text,
)

# --------------------------------------------------------------------------------------
# Numbers in words: NeMo's outputs at commit 7bc52b9689cc (branch nemotron-labs-voicechat), run by hand
# with inflect 7.6.0. NeMo itself does not install for a CPU test run (it needs lhotse, hydra and Megatron),
# so its _convert_nums_in_json and _convert_tool_response_nums_to_text
# (nemotron_voicechat_inference_wrapper.py 1977-2024) were read from the branch's source into a scratch
# script and run on these inputs; the outputs below are theirs. Run the same way, the two agreed with ours
# on 20,000 random tool responses (ints up to 10**40, random float bit patterns, nested lists and dicts).

NEMO_SPELLED = [
    (0, "zero"), (7, "seven"), (13, "thirteen"), (21, "twenty-one"), (101, "one hundred one"),
    (115, "one hundred fifteen"), (1000, "one thousand"), (1234, "one thousand, two hundred thirty-four"),
    (2024, "two thousand twenty-four"),
    (123456789, "one hundred twenty-three million, four hundred fifty-six thousand, seven hundred eighty-nine"),
    (-5, "minus five"), (-1234, "minus one thousand, two hundred thirty-four"),
    (21.5, "twenty-one point five"), (0.25, "zero point two five"), (3.0, "three point zero"),
    (-2.5, "minus two point five"), (98.6, "ninety-eight point six"), (3.14159, "three point one four one five nine"),
    (123.456, "one hundred twenty-three point four five six"),
    (-0.5, "zero point five"),  # the int part of -0.5 is 0: the sign is lost
    (1e-05, "zero"), (1e16, "ten quadrillion"),  # str() writes an exponent and no ".": the int part alone
    (1.5e-07, "1.5e-07"),  # an exponent after the ".": inflect fails on "e", str() kept
    (1e20, "one hundred quintillion"),
    (12345678901234567890, "twelve quintillion, three hundred forty-five quadrillion, six hundred seventy-eight "
                           "trillion, nine hundred one billion, two hundred thirty-four million, five hundred "
                           "sixty-seven thousand, eight hundred ninety"),
    (10 ** 40, "10000000000000000000000000000000000000000"),  # past inflect's decillions: str()
    (float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "-inf"),
    (True, "True"), (False, "False"),  # inflect 7.6 fails on a bool (7.5 and older said "zero")
    (None, None), ("21 degrees", "21 degrees"), ("", ""),
    ([1, [2.5, {"a": 3}]], ["one", ["two point five", {"a": "three"}]]),
    ({"temp": 21, "ok": True, "note": "5 days", "nested": {"x": [0.5, None]}},
     {"temp": "twenty-one", "ok": "True", "note": "5 days", "nested": {"x": ["zero point five", None]}}),
]

NEMO_CONVERTED = [
    ('<TOOL_RESPONSE>[{"result": 20}]</TOOL_RESPONSE>', '<TOOL_RESPONSE>[{"result": "twenty"}]</TOOL_RESPONSE>'),
    ('<TOOL_RESPONSE>[{"a":1,"b":[2,3]}]</TOOL_RESPONSE>',  # written back with json.dumps' separators
     '<TOOL_RESPONSE>[{"a": "one", "b": ["two", "three"]}]</TOOL_RESPONSE>'),
    ('<TOOL_RESPONSE>[NaN, Infinity, -Infinity, true, false, null]</TOOL_RESPONSE>',
     '<TOOL_RESPONSE>["nan", "inf", "-inf", "True", "False", null]</TOOL_RESPONSE>'),
    ('<TOOL_RESPONSE>["caf\\u00e9", 2]</TOOL_RESPONSE>', '<TOOL_RESPONSE>["caf\\u00e9", "two"]</TOOL_RESPONSE>'),
    ('<TOOL_RESPONSE>[{"1": 2}]</TOOL_RESPONSE>', '<TOOL_RESPONSE>[{"1": "two"}]</TOOL_RESPONSE>'),  # keys kept
    # content that does not parse is left as it is; so is text with no tags
    ('<TOOL_RESPONSE>[not json 42]</TOOL_RESPONSE>', '<TOOL_RESPONSE>[not json 42]</TOOL_RESPONSE>'),
    ('<TOOL_RESPONSE>["a</TOOL_RESPONSE>b", 5]</TOOL_RESPONSE>', '<TOOL_RESPONSE>["a</TOOL_RESPONSE>b", 5]</TOOL_RESPONSE>'),
    ("no tags 42", "no tags 42"),
]

# The results as a session is given them, formatted by tools.format_tool_response, then NeMo's conversion.
NEMO_INJECTED = [
    ([{"city": "Paris", "temperature_c": 21.5, "sky": "clear"}],
     '<TOOL_RESPONSE>[{"city": "Paris", "temperature_c": "twenty-one point five", "sky": "clear"}]</TOOL_RESPONSE>'),
    ([{"result": 20}, "Rain, 9 degrees", '{"temp":21}'],
     '<TOOL_RESPONSE>[{"result": "twenty"}, "Rain, 9 degrees", {"temp": "twenty-one"}]</TOOL_RESPONSE>'),
    ([[1, 2.25, None, True], {"count": -3, "big": 10 ** 40}],
     '<TOOL_RESPONSE>[["one", "two point two five", null, "True"], {"count": "minus three", '
     '"big": "10000000000000000000000000000000000000000"}]</TOOL_RESPONSE>'),
    ([float("nan")], '<TOOL_RESPONSE>["nan"]</TOOL_RESPONSE>'),
]


@pytest.mark.parametrize("value, spelled", NEMO_SPELLED, ids=[repr(v)[:30] for v, _ in NEMO_SPELLED])
def test_spell_numbers_is_nemos(value, spelled):
    assert spell_numbers(value) == spelled


@pytest.mark.parametrize("text, converted", NEMO_CONVERTED)
def test_spell_tool_response_numbers_is_nemos(text, converted):
    assert spell_tool_response_numbers(text) == converted
    assert spell_tool_response_numbers(converted) == converted  # NVIDIA converts twice (P 1754, W 2134): a no-op


@pytest.mark.parametrize("results, injected", NEMO_INJECTED)
def test_tool_response_text_is_what_nvidia_injects(results, injected):
    assert tool_response_text(results, True) == injected
    assert tool_response_text(results, False) == nv.tools.format_tool_response(results)


def test_spelling_leaves_its_input_alone():
    value = {"a": [1, 2.5]}
    assert spell_numbers(value) == {"a": ["one", "two point five"]}
    assert value == {"a": [1, 2.5]}


# --------------------------------------------------------------------------------------
# The phrase layout: [BOS] + ids + [PAD] x max(17, ceil(0.5 x characters)) + [EOS]
# (streaming_s2s_pipeline.py 195-196, 239-248)

B, E, P = 1, 2, 12


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import PreTrainedTokenizerFast

    from nvchat_torch.tiny import SPECIAL_TOKENS_MAP

    return PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(300, specials=23), **SPECIAL_TOKENS_MAP)


def nemo_text_to_ids(tokenizer, text):
    """NeMo's AutoTokenizer.text_to_ids without include_special_tokens (auto_tokenizer.py 302-317)."""
    return tokenizer.convert_tokens_to_ids(tokenizer.tokenize(text))


@pytest.mark.parametrize("phrase, pads", [
    ("Sure, one moment.", 17),  # 17 characters: the floor
    ("Thanks for your patience, almost ok.", 18),  # 36 characters: ceil(18.0)
    ("This one has thirty-five characters", 18),  # 35: ceil(17.5)
    ("A phrase of forty-one characters, or so!!", 21),  # 41: ceil(20.5)
    ("x" * MAX_PHRASE_CHARACTERS, 100),
])
def test_layout_is_nvidias_rule(tokenizer, phrase, pads):
    ids = layout_phrase(tokenizer, phrase, bos_id=B, pad_id=P, eos_id=E)
    words = nemo_text_to_ids(tokenizer, phrase)
    assert ids == [B] + words + [P] * pads + [E]
    assert P not in words and B not in words


def test_layout_tokenises_as_nemo_does(tokenizer):
    model_tokenizer = nv.load_tiny_model(device="cpu").tokenizer
    for phrase in (*ACKNOWLEDGEMENTS, *REMINDERS, "  two  spaces ", "It's 21.5 degrees!"):
        for tok in (tokenizer, model_tokenizer):
            laid_out = layout_phrase(tok, phrase, bos_id=B, pad_id=P, eos_id=E)
            assert laid_out[1:1 + len(nemo_text_to_ids(tok, phrase))] == nemo_text_to_ids(tok, phrase)


@pytest.mark.parametrize("phrase", ["Say <s> now", "end </s>", "call <SPECIAL_20> it"])
def test_layout_refuses_special_tokens(tokenizer, phrase):
    with pytest.raises(ValueError, match="special token"):
        layout_phrase(tokenizer, phrase, bos_id=B, pad_id=P, eos_id=E)


def test_layout_checks_the_phrase(tokenizer):
    with pytest.raises(ValueError, match="the phrase must be ASCII"):
        layout_phrase(tokenizer, "Un caf\u00e9 ?", bos_id=B, pad_id=P, eos_id=E)
    with pytest.raises(ValueError, match="the phrase is empty"):
        layout_phrase(tokenizer, " ", bos_id=B, pad_id=P, eos_id=E)


# --------------------------------------------------------------------------------------
# ToolHold


def test_defaults_are_nvidias_stock_settings():
    hold = ToolHold()
    assert hold.acknowledgements == ACKNOWLEDGEMENTS and len(ACKNOWLEDGEMENTS) >= 6  # fc_random_ack_enabled
    assert dict(hold.on_hold) == {"default": REMINDERS}  # tool_reminder_enabled, no per-tool map
    assert hold.generic == () and hold.max_generic == 2 and hold.generic_gap_s == 1.0
    assert hold.timeout_s == 15.0 and hold.timeout_phrase is None and hold.spell_numbers is True
    assert hold.timeout_result["error"] == "timeout" and hold.timeout_result["message"]
    for phrase in hold.phrases():
        assert 15 <= len(phrase) <= 40 and phrase.isascii()
    assert nv.ToolHold is ToolHold


def test_fields_are_normalised():
    hold = ToolHold(acknowledgements=["Sure, one moment."], generic=["Still going."],
                    on_hold={"get_weather": "Looking at the sky.", "default": ["One moment.", "Nearly there."]},
                    timeout_s=3, generic_gap_s=2)
    assert hold.acknowledgements == ("Sure, one moment.",) and hold.generic == ("Still going.",)
    assert dict(hold.on_hold) == {"get_weather": ("Looking at the sky.",), "default": ("One moment.", "Nearly there.")}
    assert isinstance(hold.timeout_s, float) and isinstance(hold.generic_gap_s, float)
    with pytest.raises(TypeError):
        hold.on_hold["x"] = ("y",)  # read-only, as the dataclass is frozen
    result = {"error": "slow", "detail": [1]}
    held = ToolHold(timeout_result=result)
    result["detail"].append(2)
    assert held.timeout_result == {"error": "slow", "detail": [1]}  # a copy
    assert ToolHold(timeout_result='{"error":"x"}').timeout_result == {"error": "x"}  # a JSON string is its JSON


@pytest.mark.parametrize("kwargs, message", [
    ({"acknowledgements": ("Fine.", "")}, r"tool_hold\.acknowledgements\[1\] is empty"),
    ({"acknowledgements": ("   ",)}, r"tool_hold\.acknowledgements\[0\] is empty"),
    ({"acknowledgements": "Sure."}, r"tool_hold\.acknowledgements must be a list of phrases, got str"),
    ({"acknowledgements": (3,)}, r"tool_hold\.acknowledgements\[0\] must be a string, got int"),
    ({"generic": ("Un moment, s'il vous pla\u00eet.",)}, r"tool_hold\.generic\[0\] must be ASCII"),
    ({"generic": ("Line one\nline two",)}, r"tool_hold\.generic\[0\] holds a control character"),
    ({"generic": ("x" * (MAX_PHRASE_CHARACTERS + 1),)}, r"tool_hold\.generic\[0\] has 201 characters"),
    ({"on_hold": {"default": ""}}, r'tool_hold\.on_hold\["default"\] is empty'),
    ({"on_hold": {"get_weather": []}}, r'tool_hold\.on_hold\["get_weather"\] must hold at least one phrase'),
    ({"on_hold": {"get_weather": ["Fine.", 5]}}, r'tool_hold\.on_hold\["get_weather"\]\[1\] must be a string'),
    ({"on_hold": {"": "Fine."}}, r"tool_hold\.on_hold keys must be tool names"),
    ({"on_hold": ["Fine."]}, r"tool_hold\.on_hold must be a mapping"),
    ({"max_generic": -1}, r"tool_hold\.max_generic must be an int >= 0"),
    ({"max_generic": 1.5}, r"tool_hold\.max_generic must be an int >= 0"),
    ({"max_generic": True}, r"tool_hold\.max_generic must be an int >= 0"),
    ({"timeout_s": 0}, r"tool_hold\.timeout_s must be a finite number of seconds above 0"),
    ({"timeout_s": -1.0}, r"tool_hold\.timeout_s must be a finite number"),
    ({"timeout_s": float("nan")}, r"tool_hold\.timeout_s must be a finite number"),
    ({"timeout_s": float("inf")}, r"tool_hold\.timeout_s must be a finite number"),
    ({"timeout_s": "15"}, r"tool_hold\.timeout_s must be a number of seconds, got str"),
    ({"generic_gap_s": 0.0}, r"tool_hold\.generic_gap_s must be a finite number of seconds above 0"),
    ({"generic_gap_s": float("nan")}, r"tool_hold\.generic_gap_s must be a finite number"),
    ({"timeout_result": {"when": object()}}, r"tool_hold\.timeout_result: the tool result is not JSON-serialisable"),
    ({"timeout_result": {1j}}, r"tool_hold\.timeout_result: the tool result is not JSON-serialisable"),
    ({"timeout_phrase": ""}, r"tool_hold\.timeout_phrase is empty"),
    ({"timeout_phrase": 7}, r"tool_hold\.timeout_phrase must be a string"),
    ({"spell_numbers": 1}, r"tool_hold\.spell_numbers must be a bool"),
])
def test_bad_values_name_their_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ToolHold(**kwargs)


def test_a_valid_configuration_passes():
    hold = ToolHold(acknowledgements=(), on_hold={"get_weather": ["Checking the sky.", "Reading the forecast."]},
                    generic=("Still going.", "Almost."), max_generic=0, generic_gap_s=0.25, timeout_s=120,
                    timeout_result="took too long", timeout_phrase="That took too long, sorry.", spell_numbers=False)
    hold.check_tools(["get_weather", "get_time"])
    assert hold.phrases() == ("Checking the sky.", "Reading the forecast.", "Still going.", "Almost.",
                              "That took too long, sorry.")


def test_on_hold_must_name_a_tool_of_the_session():
    hold = ToolHold(on_hold={"get_weather": "Checking.", "default": "One moment."})
    hold.check_tools(["get_weather"])
    with pytest.raises(ValueError, match=r'tool_hold\.on_hold\["get_weather"\]: .get_weather. is not one of the '
                                         r"session's tools \(get_time, send_email\)"):
        hold.check_tools(["get_time", "send_email"])
    with pytest.raises(ValueError, match=r"none were given"):
        hold.check_tools([])
    ToolHold().check_tools([])  # "default" names no tool


def test_from_mapping_round_trips():
    values = {"acknowledgements": ["Sure, one moment."], "on_hold": {"get_weather": ["Checking.", "Looking."],
                                                                      "default": "One moment."},
              "generic": ["Still going."], "max_generic": 1, "generic_gap_s": 0.5, "timeout_s": 20,
              "timeout_result": {"error": "timeout", "message": "Too slow."}, "timeout_phrase": "Sorry, too slow.",
              "spell_numbers": False}
    hold = ToolHold.from_mapping(values)
    assert hold.acknowledgements == ("Sure, one moment.",) and hold.generic == ("Still going.",)
    assert dict(hold.on_hold) == {"get_weather": ("Checking.", "Looking."), "default": ("One moment.",)}
    plain = hold.to_dict()
    assert ToolHold.from_mapping(json.loads(json.dumps(plain))) == hold
    assert plain["on_hold"] == {"get_weather": ["Checking.", "Looking."], "default": ["One moment."]}
    assert plain["timeout_s"] == 20.0 and plain["max_generic"] == 1
    assert ToolHold.from_mapping({}) == ToolHold() and ToolHold.from_mapping(ToolHold().to_dict()) == ToolHold()
    assert ToolHold.from_mapping({"timeout_s": 5}) == ToolHold(timeout_s=5.0)


def test_from_mapping_refuses_unknown_keys_and_bad_values():
    with pytest.raises(ValueError, match=r"unknown tool_hold field 'timeout'; known: acknowledgements, on_hold"):
        ToolHold.from_mapping({"timeout": 5})
    with pytest.raises(ValueError, match=r"tool_hold must be a mapping of its fields, got list"):
        ToolHold.from_mapping([("timeout_s", 5)])
    with pytest.raises(ValueError, match=r"tool_hold\.generic\[0\] is empty"):
        ToolHold.from_mapping({"generic": [""]})


def test_picks_follow_nvidias_rules():
    hold = ToolHold(acknowledgements=("Sure.", "Of course."), generic=("One.", "Two.", "Three."),
                    on_hold={"get_weather": ["Sky.", "Clouds."], "default": "Moment."})
    rng = random.Random(0)
    assert {hold.pick_acknowledgement(rng) for _ in range(50)} == {"Sure.", "Of course."}
    assert {hold.pick_on_hold("get_weather", rng) for _ in range(50)} == {"Sky.", "Clouds."}
    assert hold.pick_on_hold("get_time", rng) == "Moment."  # the tool has none: "default"
    for _ in range(20):
        picked = hold.pick_generic(rng)
        assert len(picked) == 2 and len(set(picked)) == 2 and set(picked) <= set(hold.generic)
    assert ToolHold(generic=("One.",)).pick_generic(rng) == ["One."]
    assert ToolHold(generic=("One.", "Two."), max_generic=0).pick_generic(rng) == []
    silent = ToolHold(acknowledgements=(), on_hold={})
    assert silent.pick_acknowledgement(rng) is None and silent.pick_on_hold("get_weather", rng) is None
    assert ToolHold(on_hold={"get_weather": "Sky."}).pick_on_hold("get_time", rng) is None
    assert ToolHold().pick_on_hold("anything", rng) in REMINDERS


def test_the_timeout_result_is_injected_like_a_result():
    hold = ToolHold()
    text = tool_response_text([hold.timeout_result], hold.spell_numbers)
    assert text == '<TOOL_RESPONSE>[' + json.dumps(hold.timeout_result) + ']</TOOL_RESPONSE>'
    assert math.isclose(ToolHold(timeout_s=2.5).timeout_s, 2.5)
