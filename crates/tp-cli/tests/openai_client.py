"""`tp serve` through the official `openai` Python client.

Run by tests/openai_client.rs as `python3 openai_client.py BASE_URL MODEL API_KEY`; exits non-zero
on the first failed check, printing what differed. Every check compares two independent ways of
getting the same thing (streamed against whole, text against token ids) or a documented shape.
"""

import sys

import openai


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")


def main():
    base, model, key = sys.argv[1], sys.argv[2], sys.argv[3]
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=30)

    models = client.models.list()
    check([m.id for m in models.data] == [model], f"models: {models}")

    # Completions: whole against streamed, usage, finish reason.
    whole = client.completions.create(model=model, prompt="hello world", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    text = whole.choices[0].text
    check(whole.choices[0].finish_reason == "length", f"finish: {whole}")
    check(whole.usage.completion_tokens == 12, f"usage: {whole.usage}")
    pieces, reasons, usage = [], [], None
    for chunk in client.completions.create(model=model, prompt="hello world", max_tokens=12, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.text)
            if c.finish_reason:
                reasons.append(c.finish_reason)
    check("".join(pieces) == text, f"streamed {pieces!r} vs {text!r}")
    check(reasons == ["length"], f"stream finish: {reasons}")
    check(usage is not None and usage.completion_tokens == 12, f"stream usage: {usage}")

    # A stop string from the text: the answer ends right before it.
    stop = text[3:5]
    cut = client.completions.create(model=model, prompt="hello world", max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    check(cut.choices[0].text == text[:text.find(stop)], f"stop {stop!r}: {cut.choices[0].text!r}")
    check(cut.choices[0].finish_reason == "stop", f"stop finish: {cut}")

    # Logprobs (legacy form) and n.
    lp = client.completions.create(model=model, prompt="ab", max_tokens=4, logprobs=2, n=2, seed=5,
                                   extra_body={"ignore_eos": True})
    check(len(lp.choices) == 2, f"n: {lp}")
    check(len(lp.choices[0].logprobs.tokens) == 4, f"logprobs: {lp.choices[0].logprobs}")
    check(len(lp.choices[0].logprobs.top_logprobs[0]) <= 2, f"top: {lp.choices[0].logprobs}")

    # Chat: whole against streamed (role first, then content, then the finish reason).
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=10, temperature=0,
                                          logprobs=True, top_logprobs=1, extra_body={"ignore_eos": True})
    content = chat.choices[0].message.content
    check(chat.choices[0].message.role == "assistant", f"role: {chat}")
    check(len(chat.choices[0].logprobs.content) == 10, f"chat logprobs: {chat.choices[0].logprobs}")
    roles, deltas, finish = [], [], []
    for chunk in client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=10, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            if c.delta.content:
                deltas.append(c.delta.content)
            if c.finish_reason:
                finish.append(c.finish_reason)
    check(roles == ["assistant"], f"roles: {roles}")
    check("".join(deltas) == content, f"chat streamed {deltas!r} vs {content!r}")
    check(finish == ["length"], f"chat finish: {finish}")

    # Errors come back as the client's typed exceptions with the server's message.
    for call, exc, status in [
        (lambda: client.completions.create(model="nope", prompt="x"), openai.NotFoundError, 404),
        (lambda: client.completions.create(model=model, prompt="x", temperature=-1), openai.BadRequestError, 400),
        (lambda: client.chat.completions.create(model=model, messages=[{"role": "robot", "content": "x"}]),
         openai.BadRequestError, 400),
        (lambda: client.completions.create(model=model, prompt="x" * 400), openai.BadRequestError, 400),
    ]:
        try:
            call()
            check(False, f"expected {status}")
        except exc as e:
            check(e.status_code == status and e.message, f"{status}: {e}")

    wrong = openai.OpenAI(base_url=base, api_key=key + "x", max_retries=0, timeout=30)
    try:
        wrong.models.list()
        check(False, "a wrong key was accepted")
    except openai.AuthenticationError as e:
        check(e.status_code == 401, f"401: {e}")
    print("openai client: all checks passed")


if __name__ == "__main__":
    main()
