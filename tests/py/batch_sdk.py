"""sluice's Batch API driven by the official OpenAI Python client.

Run by tests/it/batch.rs against a running server, in the virtualenv that
`deploy/install-deps --for-tests` makes:

    python tests/py/batch_sdk.py BASE_URL [CHECK ...]

Each check asserts states and counts (every custom_id answered once), never
how fast; a poll gives up only after POLL_LIMIT_S, a fail-safe against a hang.
"""

import io
import json
import sys
import time

import openai

import checks

BASE = sys.argv[1]
client = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=600)
POLL_LIMIT_S = 900
ENDED = ("completed", "failed", "expired", "cancelled")


def chat_lines(n, max_tokens, prefix="req"):
    lines = []
    for i in range(n):
        body = {
            "messages": [{"role": "user", "content": f"Name a colour. ({i})"}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        lines.append(
            json.dumps({"custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
        )
    return "\n".join(lines) + "\n"


def upload(text, name="input.jsonl"):
    return client.files.create(file=(name, io.BytesIO(text.encode()), "application/jsonl"), purpose="batch")


def wait_ended(batch_id):
    start = time.monotonic()
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in ENDED:
            return b
        assert time.monotonic() - start < POLL_LIMIT_S, f"batch still {b.status} after {POLL_LIMIT_S} s"
        time.sleep(0.2)


def results(file_id):
    if file_id is None:
        return []
    text = client.files.content(file_id).text
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def check_a_50_line_batch_completes_with_every_custom_id_answered_once():
    f = upload(chat_lines(50, 8))
    assert f.purpose == "batch" and f.bytes > 0, f
    assert client.files.retrieve(f.id).id == f.id
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"job": "colours"})
    assert b.status == "in_progress" and b.request_counts.total == 50, b
    b = wait_ended(b.id)
    assert b.status == "completed", b
    assert (b.request_counts.completed, b.request_counts.failed) == (50, 0), b.request_counts
    assert b.metadata == {"job": "colours"}, b.metadata
    out = results(b.output_file_id)
    ids = [r["custom_id"] for r in out]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(50)), ids
    for r in out:
        assert r["response"]["status_code"] == 200, r
        body = r["response"]["body"]
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 8, body
    assert b.error_file_id is None
    assert b.id in [x.id for x in client.batches.list(limit=100).data]


def check_a_malformed_line_is_refused_with_its_line_number():
    good = chat_lines(3, 4).splitlines()
    bad = good[:2] + ['{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": '] + good[2:]
    f = upload("\n".join(bad) + "\n")
    try:
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    except openai.BadRequestError as e:
        assert "line 3" in str(e), str(e)
    else:
        raise AssertionError("a batch with a malformed line was accepted")
    wrong = chat_lines(2, 4).replace('"max_tokens": 4', '"max_tokens": "four"', 1)
    f = upload(wrong)
    try:
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    except openai.BadRequestError as e:
        assert "line 1" in str(e) and "max_tokens" in str(e), str(e)
    else:
        raise AssertionError("a batch with an invalid body was accepted")


def check_cancel_stops_a_batch_mid_way_and_every_line_has_one_result():
    f = upload(chat_lines(50, 200, prefix="long"))
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    c = client.batches.cancel(b.id)
    assert c.status in ("cancelling", "cancelled"), c
    b = wait_ended(b.id)
    assert b.status == "cancelled", b
    done, failed = results(b.output_file_id), results(b.error_file_id)
    ids = [r["custom_id"] for r in done + failed]
    assert sorted(ids) == sorted(f"long-{i}" for i in range(50)), "each line once"
    cancelled = [r for r in failed if r["error"]["code"] == "batch_cancelled"]
    assert cancelled, "no line was cancelled"
    assert (b.request_counts.completed, b.request_counts.failed) == (len(done), len(failed)), b.request_counts


def check_files_are_listed_read_and_deleted():
    f = upload("{}\n", name="scratch.jsonl")
    assert f.id in [x.id for x in client.files.list().data]
    assert client.files.content(f.id).text == "{}\n"
    d = client.files.delete(f.id)
    assert d.deleted, d
    try:
        client.files.retrieve(f.id)
    except openai.NotFoundError:
        pass
    else:
        raise AssertionError("a deleted file is still there")


# --- runner ------------------------------------------------------------------


def main():
    return checks.run(globals(), sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
