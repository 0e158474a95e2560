"""What a row asks for: its prompt and its own sampling settings, from plain rows (`input.sampling_columns`)
or from OpenAI Batch API request lines (`input.format: openai_batch`); and the OpenAI Batch output line
of a finished row.

An OpenAI request line is `{"custom_id", "method": "POST", "url", "body"}` with `url`
`/v1/chat/completions` (`body.messages`) or `/v1/completions` (`body.prompt`, a string). Body keys map
to the row's settings: `max_tokens` / `max_completion_tokens` -> max_new_tokens, `temperature`, `top_p`,
`top_k`, `seed`, `stop` (a string or a list of strings), `n`, `response_format`, `logprobs` and
`top_logprobs` (chat: `logprobs: true`, `top_logprobs: k`; completions: `logprobs: k`). Keys that do not
change what is generated (`model`, `stream` false, `user`, `metadata`, `store`) are accepted; any other
key is named in the row's `warnings` column, never silently dropped. A row that cannot be served becomes
an error row.
"""

from __future__ import annotations

import json
import uuid

from pydantic import ValidationError

from specdec.config import SamplingParams

SETTINGS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "n", "logprobs",
            "top_logprobs", "response_format")
_BODY = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "temperature": "temperature",
         "top_p": "top_p", "top_k": "top_k", "seed": "seed", "stop": "stop", "n": "n", "logprobs": "logprobs",
         "top_logprobs": "top_logprobs", "response_format": "response_format"}
_HARMLESS = {"model": None, "stream": False, "user": None, "metadata": None, "store": None}
URLS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}


def settings(default: SamplingParams, overrides: dict) -> SamplingParams:
    """The row's settings: the job's `generation` with the row's own values; raises ValueError("bad_sampling: ...")."""
    if not overrides:
        return default
    values = dict(overrides)
    stop = values.get("stop")
    if isinstance(stop, str):
        values["stop"] = (stop,)
    fmt = values.get("response_format")
    if isinstance(fmt, str):  # a Parquet or CSV-born column holds the format as JSON text
        try:
            values["response_format"] = json.loads(fmt)
        except json.JSONDecodeError as exc:
            raise ValueError(f"bad_response_format: not JSON ({exc})") from None
    try:
        return SamplingParams.model_validate({**default.model_dump(), **values})
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        reason = "bad_response_format" if first["loc"][0] == "response_format" else "bad_sampling"
        raise ValueError(f"{reason}: {key}: {first['msg'].removeprefix('Value error, ')}") from None


def row_overrides(row: dict, columns: list[str]) -> dict:
    """The settings a plain row carries in `input.sampling_columns` (null: the job's)."""
    return {c: row[c] for c in columns if row.get(c) is not None}


def openai_request(row: dict) -> tuple[dict, dict, list[str]]:
    """(prompt fields, setting overrides, unknown body keys) of an OpenAI Batch request line; raises
    ValueError("bad_request: ...")."""
    url, body = row.get("url"), row.get("body")
    if row.get("method", "POST") != "POST" or url not in URLS:
        raise ValueError(f"bad_request: method {row.get('method')!r} url {url!r}; supported: POST "
                         f"{' or '.join(URLS)}")
    if not isinstance(body, dict):
        raise ValueError("bad_request: body must be an object")
    field = URLS[url]
    prompt = {field: body.get(field)}
    overrides, unknown = {}, []
    for key, value in body.items():
        if key == field or value is None:
            continue
        if key == "logprobs" and field == "prompt" and not isinstance(value, bool):  # completions: the top-k count
            overrides.update(logprobs=True, top_logprobs=value)
        elif key in _BODY:
            overrides[_BODY[key]] = value
        elif key in _HARMLESS and (_HARMLESS[key] is None or value == _HARMLESS[key]):
            continue
        else:
            unknown.append(key)
    return prompt, overrides, sorted(unknown)


def openai_logprobs(row: dict) -> dict | None:
    """A sample's `choices[].logprobs` as OpenAI writes them: `{content: [{token, logprob, bytes, top_logprobs}]}`
    (`bytes`: the UTF-8 of the token's text)."""
    if row.get("logprobs") is None:
        return None

    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    tops = row.get("top_logprobs") or [[] for _ in row["logprobs"]]
    return {"content": [{**entry(token, lp), "top_logprobs": [entry(t["token"], t["logprob"]) for t in top]}
                        for token, lp, top in zip(row["tokens"], row["logprobs"], tops)]}


def openai_response(rows: list[dict], chat: bool, model: str) -> dict:
    """The OpenAI Batch output line of one input row from its output rows (dicts of the Parquet part's columns):
    one choice per sample; `chat`: its request was a chat completion."""
    first = rows[0]
    line = {"id": f"batch_req_{uuid.uuid5(uuid.NAMESPACE_URL, str(first['id'])).hex}", "custom_id": first["id"]}
    failed = next((r for r in rows if r["finish_reason"] == "error"), None)
    if failed is not None:
        code, _, message = (failed["error"] or "error").partition(": ")
        return {**line, "response": None, "error": {"code": code, "message": message or code}}
    choices = []
    for row in rows:
        choice = {"index": row["sample_index"], "finish_reason": row["finish_reason"], "logprobs": openai_logprobs(row)}
        if chat:
            choice["message"] = {"role": "assistant", "content": row["completion"]}
        else:
            choice["text"] = row["completion"]
        choices.append(choice)
    completion = sum(r["generated_tokens"] for r in rows)
    usage = {"prompt_tokens": first["prompt_tokens"], "completion_tokens": completion,
             "total_tokens": first["prompt_tokens"] + completion,
             "prompt_tokens_details": {"cached_tokens": first.get("cached_prompt_tokens") or 0}}
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{line['id'][10:34]}",
            "object": "chat.completion" if chat else "text_completion", "model": model,
            "choices": choices, "usage": usage}
    return {**line, "response": {"status_code": 200, "request_id": line["id"], "body": body}, "error": None}


def interpret(row: dict, inp) -> tuple[dict, object, dict, list[str], bool]:
    """(the fields to render its prompt from, the InputSpec to render them with, setting overrides, unknown
    request keys, whether it is a chat request) of one input row under `inp` (workers.inputs.InputSpec)."""
    if inp.format != "openai_batch":
        return row, inp, row_overrides(row, inp.sampling_columns), [], bool(inp.messages_column or inp.chat_template)
    prompt, overrides, unknown = openai_request(row)
    chat = "messages" in prompt
    view = inp.model_copy(update={"messages_column": "messages" if chat else None, "prompt_column": "prompt",
                                  "prompt_template": None, "chat_template": False})
    return prompt, view, overrides, unknown, chat
