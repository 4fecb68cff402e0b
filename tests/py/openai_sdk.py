"""sluice driven by the official OpenAI Python client.

Run by tests/it/sdk.rs against a running server, in the virtualenv that
`deploy/install-deps --for-tests` makes (openai, jsonschema, jinja2, gguf):

    python tests/py/openai_sdk.py BASE_URL MODEL_PATH [CHECK ...]

Each check is a function below; every one runs (or those named), each failure
is printed with its check's name, and the exit status is the number failed.
Checks assert what the answers are, never how fast they came.
"""

import json
import sys
import urllib.request

import gguf
import jinja2
import jinja2.sandbox
import jsonschema
import openai

import checks

BASE, MODEL_PATH = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=600)


def gguf_template():
    """The GGUF's chat template and special tokens, read by llama.cpp's own reader."""
    r = gguf.GGUFReader(MODEL_PATH)
    tokens = r.fields["tokenizer.ggml.tokens"].contents()

    def special(key):
        f = r.fields.get(key)
        return tokens[f.contents()] if f is not None else ""

    return (
        r.fields["tokenizer.chat_template"].contents(),
        special("tokenizer.ggml.bos_token_id"),
        special("tokenizer.ggml.eos_token_id"),
    )


def render_like_transformers(template, messages, bos, eos):
    """As Hugging Face's apply_chat_template renders: jinja2's sandbox, trim_blocks, lstrip_blocks."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos
    )


def tokenize(text):
    req = urllib.request.Request(
        BASE + "/tokenize",
        data=json.dumps({"prompt": text}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.load(resp)["tokens"]


def chat(messages, **kw):
    kw.setdefault("max_tokens", 8)
    return client.chat.completions.create(model="default", messages=messages, **kw)


# --- checks ----------------------------------------------------------------


def check_prompt_tokens_are_the_models_jinja_template_rendered_in_python():
    template, bos, eos = gguf_template()
    chats = [
        [{"role": "user", "content": "Say hi."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}],
        [
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "  And 3 + 3?\n"},
        ],
    ]
    for messages in chats:
        text = render_like_transformers(template, messages, bos, eos)
        want = len(tokenize(text))
        got = chat(messages).usage.prompt_tokens
        assert got == want, f"{messages}: sluice counted {got} prompt tokens, the template renders {want}"
    # SmolLM2's template adds its default system prompt when there is none.
    assert "You are a helpful AI assistant named SmolLM" in render_like_transformers(
        template, chats[0], bos, eos
    )


def check_an_unimplemented_field_gets_400_naming_it():
    try:
        chat([{"role": "user", "content": "hi"}], prediction={"type": "content", "content": "x"})
    except openai.BadRequestError as e:
        assert e.status_code == 400
        assert e.body.get("param") == "prediction", e.body
        assert "prediction" in e.body.get("message", ""), e.body
    else:
        raise AssertionError("a request with 'prediction' was answered 200")
    try:
        chat([{"role": "user", "content": "hi"}], extra_body={"frobnicate": 1})
    except openai.BadRequestError as e:
        assert e.body.get("param") == "frobnicate", e.body
    else:
        raise AssertionError("a request with an unknown field was answered 200")


def greedy(messages, **kw):
    kw.setdefault("max_tokens", 40)
    return chat(messages, temperature=0, **kw).choices[0].message.content


def most_repeated(text):
    counts = {}
    for t in tokenize(text):
        counts[t] = counts.get(t, 0) + 1
    return max(counts.values())


REPEATS = [{"role": "user", "content": "Write the word 'hello' twenty times."}]


def check_frequency_penalty_changes_a_greedy_answer_that_repeats():
    plain = greedy(REPEATS)
    assert most_repeated(plain) >= 5, f"the greedy answer does not repeat: {plain!r}"
    assert greedy(REPEATS) == plain, "greedy is deterministic"
    penalised = greedy(REPEATS, frequency_penalty=2.0)
    assert penalised != plain, penalised
    assert most_repeated(penalised) < most_repeated(plain), (plain, penalised)


def check_presence_and_repetition_penalties_change_it_too():
    plain = greedy(REPEATS)
    assert greedy(REPEATS, presence_penalty=2.0) != plain
    assert greedy(REPEATS, extra_body={"repetition_penalty": 1.5}) != plain
    # Negative penalties are allowed (they encourage repeats); out of range is 400.
    try:
        greedy(REPEATS, frequency_penalty=2.5)
    except openai.BadRequestError as e:
        assert e.body.get("param") == "frequency_penalty", e.body
    else:
        raise AssertionError("frequency_penalty 2.5 was accepted")


def check_logit_bias_bans_and_forces_tokens():
    plain = greedy(REPEATS, max_tokens=4)
    first = tokenize(plain)[0]
    banned = greedy(REPEATS, max_tokens=4, logit_bias={str(first): -100})
    assert tokenize(banned)[0] != first, (plain, banned)
    # +100 on one token makes greedy pick it every time.
    forced = tokenize(" banana")[0]
    text = greedy(REPEATS, max_tokens=3, logit_bias={str(forced): 100})
    assert tokenize(text) == [forced] * 3, text
    try:
        greedy(REPEATS, logit_bias={"999999999": 1})
    except openai.BadRequestError as e:
        assert e.body.get("param") == "logit_bias", e.body
    else:
        raise AssertionError("a token outside the vocabulary was accepted")


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {
            "type": "array",
            "items": {"type": "string", "maxLength": 20},
            "maxItems": 3,
        },
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "hobbies", "role"],
    "additionalProperties": False,
}


def check_json_mode_output_parses():
    # Free-form JSON from a 135M model at temperature 1 can ramble past any
    # max_tokens (still valid JSON so far); greedy answers end.
    asks = [
        "What is the capital of France? Answer in JSON.",
        "Return a JSON object with your name.",
        "Give a JSON object with keys city and country.",
    ]
    for ask in asks:
        r = chat(
            [{"role": "user", "content": ask}],
            response_format={"type": "json_object"},
            max_tokens=400,
            temperature=0,
        )
        c = r.choices[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.message.content)
        value = json.loads(c.message.content)
        assert isinstance(value, dict) and value, c.message.content


def check_json_schema_output_validates_for_ten_seeds_at_temperature_1():
    for seed in range(10):
        r = chat(
            [{"role": "user", "content": "Make up a person."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "strict": True, "schema": PERSON},
            },
            max_tokens=200,
            temperature=1,
            seed=seed,
        )
        c = r.choices[0]
        assert c.finish_reason == "stop", (seed, c.finish_reason, c.message.content)
        jsonschema.validate(json.loads(c.message.content), PERSON)


def check_the_sdks_pydantic_parse_helper_gets_a_parsed_model():
    import pydantic

    class Pet(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        legs: int = pydantic.Field(ge=0, le=8)

    class Owner(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        pets: list[Pet] = pydantic.Field(max_length=2)

    r = client.chat.completions.parse(
        model="default",
        messages=[{"role": "user", "content": "An owner and their pets."}],
        response_format=Owner,
        max_tokens=300,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(r.choices[0].message.parsed, Owner), r.choices[0].message


def check_unsupported_schema_keywords_get_400_naming_them_when_strict():
    schema = {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": schema}}
    try:
        chat([{"role": "user", "content": "hi"}], response_format=rf)
    except openai.BadRequestError as e:
        assert e.body.get("param") == "response_format.json_schema.schema", e.body
        assert "dependentSchemas" in e.body.get("message", ""), e.body
    else:
        raise AssertionError("an unenforceable strict schema was accepted")
    # Not strict: best effort, as OpenAI's non-strict mode.
    rf["json_schema"]["strict"] = False
    r = chat([{"role": "user", "content": "hi"}], response_format=rf, max_tokens=100, temperature=0)
    assert r.choices[0].message.content.startswith("{"), r.choices[0].message.content


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 40}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_a_required_tool_call_returns_tool_calls_whose_arguments_validate():
    for seed in range(3):
        r = chat(ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=100, temperature=1, seed=seed)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", (c.finish_reason, c.message)
        assert c.message.content is None, c.message
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_"), call
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    # A named function is the one called.
    r = chat(ASK, tools=[WEATHER, TIME], max_tokens=100, temperature=0,
             tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time", call
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])


def check_a_streamed_tool_call_arrives_as_tool_calls_deltas():
    stream = chat(ASK, tools=[WEATHER], tool_choice="required", max_tokens=100, temperature=0, stream=True)
    name, args, finish, ids = None, "", None, set()
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        assert not d.content, d
        for tc in d.tool_calls or []:
            if tc.id:
                ids.add(tc.id)
            if tc.function and tc.function.name:
                assert name is None, "the name is sent once"
                name = tc.function.name
            if tc.function and tc.function.arguments:
                args += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls", finish
    assert name == "get_weather" and len(ids) == 1, (name, ids)
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
    # The same call, not streamed.
    whole = chat(ASK, tools=[WEATHER], tool_choice="required", max_tokens=100, temperature=0)
    assert json.loads(whole.choices[0].message.tool_calls[0].function.arguments) == json.loads(args)


def check_a_call_and_its_result_in_the_history_are_answered_in_text():
    r = chat(ASK, tools=[WEATHER], tool_choice="required", max_tokens=100, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    answer = chat(history, tools=[WEATHER], tool_choice="none", max_tokens=30, temperature=0)
    assert answer.choices[0].message.content, answer
    assert answer.choices[0].message.tool_calls is None, answer
    # The call is in the prompt: the history is longer than the question.
    assert answer.usage.prompt_tokens > r.usage.prompt_tokens


def streamed_answer(messages, **kw):
    """A streamed chat's text, its call (name, arguments) and finish reason."""
    text, name, args, finish = "", None, "", None
    for chunk in chat(messages, stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        text += d.content or ""
        for tc in d.tool_calls or []:
            if tc.function and tc.function.name:
                assert name is None, "the name is sent once"
                name = tc.function.name
            args += (tc.function and tc.function.arguments) or ""
        finish = chunk.choices[0].finish_reason or finish
    return text, name, args, finish


def check_tool_choice_auto_answers_in_text_or_with_a_call():
    asks = ["What is the weather in Paris?", "Hello! Who are you?", "Write a haiku about the sea.",
            "What time is it in Tokyo?"]
    forms = set()
    runs = [(q, {"temperature": 0}) for q in asks] + [(asks[0], {"temperature": 1, "seed": s}) for s in range(4)]
    for q, kw in runs:
        ask = [{"role": "user", "content": q}]
        # No tool_choice: OpenAI's default with tools, "auto".
        r = chat(ask, tools=[WEATHER, TIME], max_tokens=60, **kw)
        c = r.choices[0]
        if c.message.tool_calls:
            forms.add("call")
            assert c.message.content is None, c.message
            (call,) = c.message.tool_calls
            tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            if c.finish_reason == "tool_calls":
                jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
            else:
                assert c.finish_reason == "length", c
        else:
            forms.add("text")
            assert c.message.content, c.message
            assert c.finish_reason in ("stop", "length"), c
            assert not c.message.content.startswith('{"response"'), c.message.content
        if kw["temperature"] == 0:
            # Streamed, the same answer in the same form.
            text, name, args, finish = streamed_answer(ask, tools=[WEATHER, TIME], tool_choice="auto",
                                                       max_tokens=60, **kw)
            assert finish == c.finish_reason, (finish, c.finish_reason)
            if c.message.tool_calls:
                assert (name, args) == (call.function.name, call.function.arguments), (name, args)
                assert text == ""
            else:
                assert (text, name) == (c.message.content, None), (text, name)
    # This model, on these asks, answers both ways.
    assert forms == {"call", "text"}, forms


def check_n_choices_come_back_by_index():
    r = chat([{"role": "user", "content": "Name a fruit."}], n=3, max_tokens=8, temperature=1, seed=3)
    assert [c.index for c in r.choices] == [0, 1, 2], r.choices
    assert all(c.message.content for c in r.choices), r.choices
    assert 3 <= r.usage.completion_tokens <= 3 * 8, r.usage
    seen = {}
    for chunk in chat([{"role": "user", "content": "Name a fruit."}], n=2, max_tokens=8, stream=True):
        for c in chunk.choices:
            seen.setdefault(c.index, "")
            seen[c.index] += c.delta.content or ""
    assert sorted(seen) == [0, 1], seen


def check_embeddings_come_back_through_the_sdk():
    texts = ["The cat sat on the mat.", "Stock markets fell sharply today.", "The cat sat on the mat."]
    # The SDK asks for base64 unless told otherwise, and decodes it.
    r = client.embeddings.create(model="default", input=texts)
    assert [d.index for d in r.data] == [0, 1, 2], r.data
    vs = [d.embedding for d in r.data]
    assert len({len(v) for v in vs}) == 1 and len(vs[0]) > 0
    for v in vs:
        assert abs(sum(x * x for x in v) ** 0.5 - 1) < 1e-3
    cos = lambda a, b: sum(x * y for x, y in zip(a, b))  # noqa: E731 -- unit vectors
    assert cos(vs[0], vs[2]) > 0.9999 and cos(vs[0], vs[1]) < 0.999
    assert r.usage.prompt_tokens == sum(len(tokenize(t)) for t in texts), r.usage
    f = client.embeddings.create(model="default", input=texts[0], encoding_format="float")
    assert cos(f.data[0].embedding, vs[0]) > 0.9999


# --- runner ------------------------------------------------------------------


def main():
    return checks.run(globals(), sys.argv[3:])


if __name__ == "__main__":
    sys.exit(main())
