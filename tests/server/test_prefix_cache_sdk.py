"""A four-turn conversation through the official SDKs on the embedded model (SmolLM2, whose
template renders an answer back as it was written): each returning turn goes on from where the
last answer ended, reported in each API's own field, and the answers are the ones a server
without the prefix cache gives."""
from __future__ import annotations

import anthropic
import openai
import pytest

from ninfer.server.app import create_app
from ninfer.server.bootstrap import build_state
from ninfer.server.cli import build_parser
from support.live_server import LiveServer

pytestmark = pytest.mark.slow
KEY = "sk-local-test"
MODEL = "smollm2-135m-instruct"
QUESTIONS = ["Name a colour of the sky.", "And of grass?", "What do bees make?", "Say goodbye."]


@pytest.fixture(scope="module", params=[True, False], ids=["cache", "no-cache"])
def server(request):
    argv = ["--max-context", "1024", "--api-key", KEY] + ([] if request.param else ["--no-prefix-cache"])
    state, loop = build_state(build_parser().parse_args(argv))
    loop.start()
    with LiveServer(create_app(state)) as live:
        yield live.base_url, request.param
    loop.stop()


@pytest.fixture(scope="module")
def answers() -> dict:
    """Each API's answers, by whether the server had the prefix cache (filled as tests run)."""
    return {}


def chat_turns(base_url: str) -> list[tuple[str, int, int, int]]:
    """Four turns through the openai SDK: (answer, prompt tokens, completion tokens, cached)."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0)
    messages, out = [], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
        text = r.choices[0].message.content
        out.append((text, r.usage.prompt_tokens, r.usage.completion_tokens,
                    r.usage.prompt_tokens_details.cached_tokens))
        messages.append({"role": "assistant", "content": text})
    return out


def messages_turns(base_url: str) -> list[tuple[str, int, int, int]]:
    """The same through the anthropic SDK, with a system prompt of its own (a conversation that
    starts as the openai one would go on from its checkpoints): (answer, input tokens in all,
    output tokens, cache read)."""
    client = anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0)
    messages, out = [], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        r = client.messages.create(model=MODEL, max_tokens=24, system="Be brief.", messages=messages,
                                   extra_body={"temperature": 0})
        text = "".join(b.text for b in r.content if b.type == "text")
        read = r.usage.cache_read_input_tokens or 0
        out.append((text, r.usage.input_tokens + read, r.usage.output_tokens, read))
        messages.append({"role": "assistant", "content": text})
    return out


@pytest.mark.parametrize("api", [chat_turns, messages_turns], ids=["openai", "anthropic"])
def test_a_returning_conversation_goes_on_from_its_last_answer(server, answers, api):
    base_url, cache = server
    turns = api(base_url)
    texts = [t[0] for t in turns]
    assert all(texts)
    cached = [t[3] for t in turns]
    if cache:
        # all of the last prompt and its answer, but the answer's last token (sampled, never run)
        assert cached == [0] + [prompt + completion - 1 for _, prompt, completion, _ in turns[:-1]]
    else:
        assert cached == [0, 0, 0, 0]
    answers.setdefault(api.__name__, {})[cache] = texts
    if len(answers[api.__name__]) == 2:  # both servers have answered: the same words
        assert answers[api.__name__][True] == answers[api.__name__][False]
