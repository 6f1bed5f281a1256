"""atomflow.model.tokenizer must give the ids and prompts transformers gives (a different prompt is a
different model output), and stream text that is always valid UTF-8 and adds up to the full decode."""

import json
import shutil
from pathlib import Path

import pytest

from atomflow.errors import ChatTemplateError
from atomflow.model.tokenizer import IncrementalDecoder, Tokenizer

transformers = pytest.importorskip("transformers")

CORPUS = Path(__file__).resolve().parents[1] / "tools" / "corpus.txt"

# meta-llama/Llama-3.2-1B-Instruct's chat template (public), as data: system date, tools, tool calls.
LLAMA_3_2_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city, <°C> & wind.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

CONVERSATIONS = [  # (messages, extra template variables)
    ([{"role": "user", "content": "Hello!"}], {}),
    ([{"role": "system", "content": "  You are terse.  "}, {"role": "user", "content": "Héllo, 世界 🦙\n"}], {}),
    (
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and <b>3+3</b>?"},
        ],
        {"date_string": "01 Jan 2025"},
    ),
    ([{"role": "user", "content": "Weather in Paris?"}], {"tools": [WEATHER_TOOL]}),
    (
        [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Zürich?"}],
        {"tools": [WEATHER_TOOL], "tools_in_user_message": False, "date_string": "26 Jul 2024"},
    ),
    (
        [
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
            },
            {"role": "tool", "content": {"temp": -3, "wind": "5 m/s"}},
        ],
        {"date_string": "02 Feb 2025"},
    ),
]


@pytest.fixture(scope="module")
def tok(tiny_hf_dir):
    return Tokenizer.from_hf_dir(tiny_hf_dir)


@pytest.fixture(scope="module")
def hf(tiny_hf_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_hf_dir)


def _non_ascii_lines():
    return [ln for ln in CORPUS.read_text(encoding="utf-8").splitlines() if any(ord(c) > 127 for c in ln)]


TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n",
    "",
    "Le café est délicieux",
    "Ελληνικά και 中文 και 日本語",
    "🦙🚀👨‍👩‍👧 emoji ✨",
    "unseen: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ☃ Ωμέγα ğüşçö",
    "<|eot_id|> special in text",
    "x = 0xdeadbeef; y = 3.14e-2",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_and_round_trips(tok, hf, text):
    ids = tok.encode(text)
    assert ids == hf(text).input_ids
    assert ids[0] == tok.bos_token_id and tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids, skip_special_tokens=True) == text.replace("<|eot_id|>", "")
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_out_of_vocab_ids_decode_to_nothing(tok):
    """The random 3B/8B models have 128256 logits but this tokenizer knows 1024 ids."""
    assert tok.vocab_size == 1024
    ids = tok.encode("ok", add_special_tokens=False)
    assert tok.decode([5000, *ids, 128255, -1]) == "ok"
    dec = IncrementalDecoder(tok)
    assert "".join([dec.feed(i) for i in (100000, *ids, 2000)] + [dec.flush()]) == "ok"
    # a long run of unknown ids keeps the decode window short, and text after it still streams
    dec = IncrementalDecoder(tok)
    assert "".join(dec.feed(i) for i in range(2000, 3000)) == "" and len(dec.ids) - dec.prefix <= 9
    assert "".join([dec.feed(i) for i in ids] + [dec.flush()]) == "ok"


def test_incremental_decode_of_non_ascii_corpus(tok):
    lines = _non_ascii_lines()
    assert len(lines) >= 8
    split_chars = 0
    for line in lines:
        ids = tok.encode(line + "\n", add_special_tokens=False)
        dec = IncrementalDecoder(tok)
        pieces = [dec.feed(i) for i in ids]
        tail = dec.flush()
        assert "".join(pieces) + tail == tok.decode(ids) == line + "\n"
        assert not any("\ufffd" in p for p in pieces + [tail])
        split_chars += pieces.count("")  # a token ending mid-character is held, not printed
    assert split_chars > 20  # the corpus does exercise multi-byte characters split across tokens


def test_incremental_decode_of_whole_corpus_with_specials(tok):
    text = CORPUS.read_text(encoding="utf-8")
    ids = [tok.bos_token_id] + tok.encode(text, add_special_tokens=False) + [max(tok.eos_token_ids)]
    dec = IncrementalDecoder(tok)
    assert "".join(dec.feed(i) for i in ids) + dec.flush() == text  # specials skipped by default
    dec = IncrementalDecoder(tok, skip_special_tokens=False)
    assert "".join(dec.feed(i) for i in ids) + dec.flush() == tok.decode(ids)


def test_incremental_flush_emits_a_truly_incomplete_tail(tok):
    """A stream that ends mid-character: held while it might complete, then flushed as decode() has it."""
    byte_c3 = tok._tok.token_to_id("\u00c3")  # ByteLevel's symbol for the lone byte 0xC3 (how "é" starts)
    a = tok.encode("a", add_special_tokens=False)
    dec = IncrementalDecoder(tok)
    assert dec.feed(a[0]) == "a"
    assert dec.feed(byte_c3) == ""
    assert dec.flush() == "\ufffd" == tok.decode([byte_c3])


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("case", range(len(CONVERSATIONS)))
def test_llama_3_2_template_matches_transformers(tiny_hf_dir, hf, case, add_generation_prompt):
    messages, extra = CONVERSATIONS[case]
    ours = Tokenizer.from_metadata(
        (tiny_hf_dir / "tokenizer.json").read_text(),
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        LLAMA_3_2_TEMPLATE,
        {},
    )
    hf.chat_template = LLAMA_3_2_TEMPLATE
    got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)
    if got != want and "date_string" not in extra:  # strftime_now may have crossed midnight in between
        got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
    assert got == want
    assert got.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert "Cutting Knowledge Date: December 2023\nToday Date: " in got


def test_template_raise_exception_surfaces(tiny_hf_dir):
    ours = Tokenizer.from_metadata(
        (tiny_hf_dir / "tokenizer.json").read_text(), {"bos_token": "<|begin_of_text|>"}, LLAMA_3_2_TEMPLATE, {}
    )
    two_calls = [{"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": {}}}] * 2}]
    with pytest.raises(ChatTemplateError, match="failed to render: TemplateError: .*single tool-calls"):
        ours.apply_chat_template(two_calls)


@pytest.mark.parametrize("case", range(3))
def test_tiny_model_template_and_chat_prompt_match_transformers(tiny_hf_dir, tok, case):
    hf = transformers.AutoTokenizer.from_pretrained(tiny_hf_dir)  # fresh: the other test swaps its template
    messages = CONVERSATIONS[case][0]
    text = tok.apply_chat_template(messages)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = "Explain KV caches in one paragraph, s'il vous plaît."
    ids = tok.encode_prompt(prompt, chat=True)
    want = hf(
        hf.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    ).input_ids
    assert ids == want and ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert tok.encode_prompt(prompt, chat=False) == hf(prompt).input_ids


def test_eos_ids_and_metadata_path(tiny_hf_dir, tok):
    ids = {t: tok._tok.token_to_id(t) for t in ("<|end_of_text|>", "<|eot_id|>")}
    assert tok.eos_token_ids == set(ids.values())
    assert tok.has_chat_template
    # the .atomflow metadata shape written by atomflow/model/quantize.py
    meta = Tokenizer.from_metadata(
        (tiny_hf_dir / "tokenizer.json").read_text(),
        {
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "add_bos_token": None,
            "chat_template_source": "tokenizer_config.json",
        },
        tok.chat_template,
        {"bos_token_id": tok.bos_token_id, "eos_token_ids": [ids["<|end_of_text|>"]]},
    )
    assert meta.eos_token_ids == set(ids.values())  # generation_config's list + the tokenizer's eos_token
    assert meta.encode_prompt("hi", chat=True) == tok.encode_prompt("hi", chat=True)
    assert meta.encode_prompt("hi", chat=False) == tok.encode_prompt("hi", chat=False)
    no_template = Tokenizer.from_metadata((tiny_hf_dir / "tokenizer.json").read_text(), {}, "", {})
    assert not no_template.has_chat_template and no_template.eos_token_ids == set()
    with pytest.raises(ValueError, match="no chat template"):
        no_template.encode_prompt("hi", chat=True)


def test_add_bos_token_does_not_override_tokenizer_json(tiny_hf_dir, tmp_path):
    """transformers (4.x and 5.x) leaves BOS insertion to tokenizer.json's post-processor for Llama 3's
    PreTrainedTokenizerFast, whatever tokenizer_config's add_bos_token says; so do we."""
    d = tmp_path / "nobos"
    shutil.copytree(tiny_hf_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = False
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, hf = Tokenizer.from_hf_dir(d), transformers.AutoTokenizer.from_pretrained(d)
    assert ours.encode("Hello there") == hf("Hello there").input_ids
    assert ours.encode("Hello there")[0] == ours.bos_token_id
