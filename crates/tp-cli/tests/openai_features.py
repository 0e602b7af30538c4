"""Structured outputs, tools, tokenize and speculative decoding of `tp serve` through the official
`openai` Python client, checked by independent references: the `jsonschema` package validates
every finished constrained answer, the `tokenizers` package tokenizes, and a second server
without speculation answers the same requests.

Run by tests/openai_client.rs:
  python3 openai_features.py structured BASE_URL MODEL TOKENIZER_JSON
  python3 openai_features.py same BASE_URL_A BASE_URL_B MODEL
Exits non-zero on the first failed check, printing what differed.
"""

import concurrent.futures
import json
import sys

import httpx
import jsonschema
import openai
import tokenizers


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")


def s(max_len=8, **kw):
    return {"type": "string", "maxLength": max_len, **kw}


def obj(props, required=None, **kw):
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **kw}


# Bounded schemas (a random model writes until the schema ends): nested objects, enums, consts,
# integers and numbers with bounds, arrays with bounds, anyOf, patterns, optional keys, $ref.
SCHEMAS = [
    obj({"name": s()}),
    obj({"n": {"type": "integer", "minimum": -5, "maximum": 5}}),
    obj({"x": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj({"ok": {"type": "boolean"}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"kind": {"const": "point"}, "v": {"type": "integer", "minimum": 0, "maximum": 9}}),
    obj({"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3}}),
    obj({"pair": {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 3}, {"enum": ["x", "y"]}],
                  "items": False, "minItems": 2, "maxItems": 2}}),
    obj({"inner": obj({"a": {"type": "integer", "minimum": 1, "maximum": 2}, "b": s(4)})}),
    obj({"deep": obj({"deeper": obj({"z": {"enum": [1, 2, 3]}})})}),
    obj({"id": s(6, pattern="^[a-f0-9]{2,6}$")}),
    obj({"zip": s(5, pattern="^[0-9]{5}$")}),
    obj({"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none"]}]}}),
    obj({"v": {"anyOf": [obj({"a": {"const": 1}}), obj({"b": {"const": 2}})]}}),
    obj({"maybe": {"type": ["integer", "null"], "minimum": 0, "maximum": 3}}),
    obj({"a": s(3), "b": {"type": "integer", "minimum": 0, "maximum": 3}}, required=["a"]),
    obj({"list": {"type": "array", "items": obj({"k": {"enum": ["p", "q"]}}), "maxItems": 2}}),
    obj({"grid": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1},
                                             "minItems": 1, "maxItems": 2}, "minItems": 1, "maxItems": 2}}),
    {"type": "array", "items": {"enum": [True, False]}, "minItems": 2, "maxItems": 4},
    {"enum": ["yes", "no", 0, None]},
    obj({"p": {"$ref": "#/$defs/point"}}, **{"$defs": {"point": obj({"x": {"type": "integer", "minimum": 0, "maximum": 2}})}}),
    obj({"when": s(10, format="date")}),
    obj({"e": s(12, format="email")}) | {"required": []},
    {"type": "integer", "minimum": 10, "maximum": 12},
]

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
     "parameters": obj({"city": {"enum": ["Oslo", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}})}},
    {"type": "function", "function": {"name": "ping", "parameters": obj({})}},
]


def structured(base, model, tokenizer_json):
    client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)

    def ask(i_schema):
        i, schema = i_schema
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Give JSON number {i}."}], n=4, seed=i,
            max_completion_tokens=1200,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})
        return i, schema, r

    finished = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(SCHEMAS)) as pool:
        for i, schema, r in pool.map(ask, enumerate(SCHEMAS)):
            check(len(r.choices) == 4, f"schema {i}: {len(r.choices)} choices")
            for c in r.choices:
                if c.finish_reason == "length":
                    continue
                check(c.finish_reason == "stop", f"schema {i}: finish {c.finish_reason}")
                try:
                    value = json.loads(c.message.content)
                except json.JSONDecodeError as e:
                    raise SystemExit(f"FAILED: schema {i}: not JSON: {c.message.content!r}: {e}")
                try:
                    jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
                except jsonschema.ValidationError as e:
                    raise SystemExit(f"FAILED: schema {i}: {c.message.content!r} does not validate: {e.message}")
                finished += 1
    check(finished >= 3 * len(SCHEMAS), f"only {finished} of {4 * len(SCHEMAS)} constrained answers finished")

    # Tools: forced calls (the template writes <tool_call>, so in Hermes' format), each closing
    # with tool_calls well inside 200 tokens at temperature 0 and 0.7, streamed equal to whole;
    # then the round trip with the tool's answer.
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]

    def streamed_calls(**kw):
        calls, reason = {}, None
        for chunk in client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, stream=True, **kw):
            for ch in chunk.choices:
                reason = ch.finish_reason or reason
                for d in ch.delta.tool_calls or []:
                    entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                    if d.function and d.function.name:
                        entry["name"] = d.function.name
                    if d.function and d.function.arguments:
                        entry["arguments"] += d.function.arguments
        return calls, reason

    named_choice = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named_choice):
        for temperature in (0.0, 0.7):
            kw = dict(tool_choice=choice, seed=3, temperature=temperature, max_completion_tokens=200)
            whole = client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, **kw)
            c = whole.choices[0]
            what = f"tool_choice {choice} at temperature {temperature}"
            check(c.finish_reason == "tool_calls", f"{what}: finish {c}")
            calls = c.message.tool_calls
            check(calls and all(t.type == "function" for t in calls), f"{what}: calls {c.message}")
            check(choice == "required" or all(t.function.name == "get_weather" for t in calls), f"{what}: {calls}")
            for t in calls:
                spec = next(x for x in TOOLS if x["function"]["name"] == t.function.name)
                jsonschema.validate(json.loads(t.function.arguments), spec["function"]["parameters"])
            streamed, reason = streamed_calls(**kw)
            want = {k: {"name": t.function.name, "arguments": t.function.arguments} for k, t in enumerate(calls)}
            check(streamed == want and reason == "tool_calls", f"{what}: streamed {streamed} ({reason}) vs {want}")
    whole = client.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice="required", seed=3,
                                           max_completion_tokens=200)
    c = whole.choices[0]
    calls = c.message.tool_calls
    round_trip = msgs + [c.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": t.id, "content": "sunny"} for t in calls]
    answer = client.chat.completions.create(model=model, messages=round_trip, tools=TOOLS, max_completion_tokens=8)
    check(answer.choices[0].finish_reason in ("stop", "length", "tool_calls"), f"round trip: {answer}")
    try:
        client.chat.completions.create(model=model, messages=msgs + [{"role": "tool", "tool_call_id": "nope", "content": "x"}])
        check(False, "a tool message answering no call was accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400, f"tool message: {e}")

    # /tokenize and /detokenize against the tokenizers package.
    tok = tokenizers.Tokenizer.from_file(tokenizer_json)
    root = base.rsplit("/v1", 1)[0]
    for text in ["hello world", "JSON: {\"a\": [1, 2]}", "ünïcödé ✓", ""]:
        got = httpx.post(f"{root}/tokenize", json={"prompt": text}).json()
        ids = tok.encode(text).ids
        check(got["tokens"] == ids and got["count"] == len(ids), f"tokenize {text!r}: {got} vs {ids}")
        back = httpx.post(f"{root}/detokenize", json={"tokens": ids}).json()
        check(back["prompt"] == tok.decode(ids, skip_special_tokens=False), f"detokenize {ids}: {back}")
    print("openai features: all checks passed")


def same(base_a, base_b, model):
    a = openai.OpenAI(base_url=base_a, api_key="none", max_retries=0, timeout=300)
    b = openai.OpenAI(base_url=base_b, api_key="none", max_retries=0, timeout=300)
    prompt = "abcabcabcabc abcabcabc abcabc"
    for kw in [dict(temperature=0), dict(seed=7, n=2), dict(seed=1, temperature=0.7, top_p=0.9)]:
        x = a.completions.create(model=model, prompt=prompt, max_tokens=24, extra_body={"ignore_eos": True}, **kw)
        y = b.completions.create(model=model, prompt=prompt, max_tokens=24, extra_body={"ignore_eos": True}, **kw)
        check([c.text for c in x.choices] == [c.text for c in y.choices], f"{kw}: {x.choices} vs {y.choices}")
    print("openai same answers: all checks passed")


if __name__ == "__main__":
    if sys.argv[1] == "structured":
        structured(*sys.argv[2:5])
    elif sys.argv[1] == "same":
        same(*sys.argv[2:5])
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]}")
