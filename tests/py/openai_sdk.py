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
import traceback
import urllib.request

import gguf
import jinja2
import jinja2.sandbox
import jsonschema
import openai

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


# --- runner ------------------------------------------------------------------


def main():
    names = sys.argv[3:]
    checks = {k: v for k, v in globals().items() if k.startswith("check_")}
    unknown = [n for n in names if "check_" + n not in checks and n not in checks]
    if unknown:
        print(f"no such check: {unknown}")
        return 2
    chosen = [
        (k, f) for k, f in checks.items() if not names or k in names or k[len("check_") :] in names
    ]
    failed = 0
    for name, f in chosen:
        try:
            f()
            print(f"ok   {name}", flush=True)
        except Exception:  # noqa: BLE001 -- every failure is reported by name
            failed += 1
            print(f"FAIL {name}", flush=True)
            traceback.print_exc()
    print(f"{len(chosen) - failed} passed, {failed} failed")
    return min(failed, 100)


if __name__ == "__main__":
    sys.exit(main())
