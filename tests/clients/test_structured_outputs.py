"""Structured outputs as users ask for them, against a real ``ninfer-serve`` on the embedded model:
the ``openai`` SDK's ``chat.completions.parse()`` and ``responses.parse()`` with a pydantic model
(nested objects, enums, arrays, optional fields), LangChain's ``with_structured_output`` (a
response format, and a forced strict tool call), and the llama.cpp dialect's ``json_schema`` and
GBNF ``grammar``. The model is small and the prompts are varied; the grammar is what makes every
answer parse. The model bounds its strings, numbers and lists, as one does for a model this small:
unbounded, it may write a string until the token limit."""
from __future__ import annotations

import asyncio
import json
import re
import sys
from enum import Enum
from pathlib import Path
from typing import Optional

import httpx
import pytest
from pydantic import BaseModel, Field

from support.server_process import ServerProcess

pytestmark = pytest.mark.slow
SERVE = str(Path(sys.executable).parent / "ninfer-serve")
MODEL = "smollm2-135m-instruct"


class Kind(str, Enum):
    city = "city"
    town = "town"
    village = "village"


class Place(BaseModel):
    name: str = Field(max_length=32)
    country: str = Field(max_length=32)
    kind: Kind


class Trip(BaseModel):
    traveller: str = Field(max_length=40)
    days: int = Field(ge=1, le=30)
    places: list[Place] = Field(max_length=4)
    budget_eur: Optional[int] = Field(ge=0, le=100_000)
    rating: Kind | None = None


SUBJECTS = ["Paris", "Tokyo", "a fishing village in Norway", "Rome and Florence", "the Scottish highlands",
            "Lisbon", "New York", "a small town in Peru", "Berlin", "Cairo"]
ASKS = ["Plan a trip to {}.", "Describe a weekend in {} as a trip.", "A student visits {}: write the trip.",
        "Give me a cheap trip to {}.", "My parents want to see {}. Write their trip."]
PROMPTS = [a.format(s) for a in ASKS for s in SUBJECTS]  # 50


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("structured")
    proc = ServerProcess([SERVE, "--max-context", "2048", "--max-concurrency", "50", "--temperature", "0.7"],
                         tmp / "server.log")
    yield proc
    proc.stop()


def test_fifty_prompts_through_chat_completions_parse_all_validate(server):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=600)

    async def one(prompt: str, seed: int):
        r = await client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                response_format=Trip, max_tokens=700, seed=seed)
        return r.choices[0]

    async def every():
        return await asyncio.gather(*(one(p, i) for i, p in enumerate(PROMPTS)))

    choices = asyncio.run(every())
    assert len(choices) == 50
    for c in choices:
        assert c.finish_reason == "stop"
        assert isinstance(c.message.parsed, Trip)  # the SDK parsed and validated it
        Trip.model_validate_json(c.message.content)


def test_responses_parse(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=300)
    r = client.responses.parse(model=MODEL, input="Plan a trip to Vienna.", text_format=Trip, max_output_tokens=700)
    assert isinstance(r.output_parsed, Trip)


def test_langchain_with_structured_output(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.base_url + "/v1", api_key="none", model=MODEL, max_tokens=700, max_retries=0)
    trip = llm.with_structured_output(Trip).invoke("Plan a trip to Madrid.")
    assert isinstance(trip, Trip)


def test_langchain_with_structured_output_through_a_forced_tool_call(server):
    """``method="function_calling"``: the schema becomes a strict tool that ``tool_choice`` names,
    and the answer is read from the call's arguments."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.base_url + "/v1", api_key="none", model=MODEL, max_tokens=700, max_retries=0)
    structured = llm.with_structured_output(Trip, method="function_calling", strict=True)
    for city in ("Madrid", "Oslo"):
        assert isinstance(structured.invoke(f"Plan a trip to {city}."), Trip)


def test_llamacpp_json_schema_and_grammar(server):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer"}},
              "required": ["answer", "score"]}
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        r = http.post("/completion", json={"prompt": "Is Paris in France? Answer:", "json_schema": schema,
                                           "n_predict": 64, "temperature": 0})
        assert r.status_code == 200, r.text
        out = json.loads(r.json()["content"])
        assert out["answer"] in ("yes", "no") and isinstance(out["score"], int)
        gbnf = 'root ::= "The colour is " colour "."\ncolour ::= "red" | "green" | "blue"'
        r = http.post("/completion", json={"prompt": "Name a colour.", "grammar": gbnf, "n_predict": 32})
        assert r.status_code == 200, r.text
        assert re.fullmatch(r"The colour is (red|green|blue)\.", r.json()["content"])
        r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 16, "messages": [
            {"role": "user", "content": "Pick one"}], "guided_choice": ["alpha", "beta"]})
        assert r.json()["choices"][0]["message"]["content"] in ("alpha", "beta")
        r = http.post("/completion", json={"prompt": "x", "grammar": "root ::= nothing"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "grammar"
