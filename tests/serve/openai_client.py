"""A light OpenAI client process for the soak test: greedy completions over plain HTTP, standard library only.

`python openai_client.py '{"host": ..., "port": ..., "api_key": ..., "prompts": [...], "max_tokens": N,
"out": path}'` writes {prompt: [plain text, streamed text]} as JSON. It imports no torch, so sixteen of these
start in a fraction of a second where one nnsight client takes seconds.
"""

from __future__ import annotations

import http.client
import json
import sys


def complete(spec: dict, prompt: str, stream: bool) -> str:
    body = json.dumps(
        {"model": "tiny-facts", "prompt": prompt, "max_tokens": spec["max_tokens"], "temperature": 0, "stream": stream}
    )
    connection = http.client.HTTPConnection(spec["host"], spec["port"], timeout=60)
    try:
        connection.request(
            "POST",
            "/v1/completions",
            body=body,
            headers={"Authorization": f"Bearer {spec['api_key']}", "Content-Type": "application/json"},
        )
        response = connection.getresponse()
        text = response.read().decode()
    finally:
        connection.close()
    if response.status != 200:
        raise RuntimeError(f"{response.status}: {text}")
    if not stream:
        return json.loads(text)["choices"][0]["text"]
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    return "".join(json.loads(event)["choices"][0]["text"] for event in events)


def main() -> int:
    spec = json.loads(sys.argv[1])
    results = {
        prompt: [complete(spec, prompt, stream=False), complete(spec, prompt, stream=True)]
        for prompt in spec["prompts"]
    }
    with open(spec["out"], "w") as out:
        json.dump(results, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
