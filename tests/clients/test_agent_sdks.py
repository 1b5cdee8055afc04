"""Agent frameworks' own clients against a real ``ninfer-serve`` on the embedded model: the OpenAI
Agents SDK (Responses API, a default strict function tool, and one forced by ``tool_choice``) and
LangChain's ``ChatOpenAI`` (Chat Completions and Responses). The small model may answer poorly;
what counts is that each completes its turn with what it sends by default. Server flags bound the
time, as none of them sets a limit: greedy decoding (``--temperature 0``) ends these short answers
well within ``--default-max-tokens``; the Agents SDK takes a response cut at its token limit for a
failure."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Literal

import pytest

from support.server_process import ServerProcess
from support.waiting import wait_for

pytestmark = pytest.mark.slow
SERVE = str(Path(sys.executable).parent / "ninfer-serve")  # the console script of this environment

KEY = "agents-sdk-key"
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agents")
    log = tmp / "requests.jsonl"
    proc = ServerProcess([SERVE, "--api-key", KEY, "--max-context", "2048",
                          "--temperature", "0", "--default-max-tokens", "256", "--request-log-jsonl", str(log)],
                         tmp / "server.log")
    yield proc, log
    proc.stop()


def records(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_openai_agents_runs_a_turn_with_a_function_tool(server):
    from agents import Agent, OpenAIProvider, RunConfig, Runner, function_tool
    from openai import AsyncOpenAI

    proc, log = server
    calls: list[str] = []

    @function_tool  # strict by default: its calls are held to the schema
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    before = len(records(log))
    client = AsyncOpenAI(base_url=proc.base_url + "/v1", api_key=KEY, max_retries=0)
    agent = Agent(name="assistant", instructions="You are a helpful assistant.", tools=[get_weather], model=MODEL)
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
    result = Runner.run_sync(agent, "Say hello", run_config=config, max_turns=4)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert all(r.usage.output_tokens > 0 for r in result.raw_responses)
    # the turn went over the Responses API, with the tool declared, and was served (not refused)
    def since() -> list[dict]:
        return [r for r in records(log)[before:] if r["event"] != "throughput"]

    assert wait_for(lambda: sum(r["event"] == "request_done" for r in since()) >= len(result.raw_responses), 10)
    mine = since()
    done = [r for r in mine if r["event"] == "request_done"]
    assert done and all(r["protocol"] == "openai_responses" for r in done)
    assert [r["error"] for r in mine if r["event"] == "request_rejected"] == []
    starts = [r for r in mine if r["event"] == "request_start"]
    assert starts[0]["shape"]["n_tools"] == 1 and len(starts) == len(result.raw_responses)
    assert len(calls) == sum(1 for r in result.raw_responses for o in r.output if o.type == "function_call")


def test_openai_agents_with_a_required_tool_call(server):
    """``tool_choice="required"``: the first turn is one call (``parallel_tool_calls=False``: a
    model this small, greedy, may otherwise write calls until its token limit) whose arguments
    validate (a strict tool, its city one of an enum); the SDK runs the tool and, its tool choice
    reset, the model answers."""
    from agents import Agent, ModelSettings, OpenAIProvider, RunConfig, Runner, function_tool
    from openai import AsyncOpenAI

    proc, _ = server
    calls: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome", "Tokyo"]) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    client = AsyncOpenAI(base_url=proc.base_url + "/v1", api_key=KEY, max_retries=0)
    agent = Agent(name="assistant", instructions="You are a helpful assistant.", tools=[get_weather], model=MODEL,
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False))
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
    result = Runner.run_sync(agent, "What is the weather in Rome?", run_config=config, max_turns=4)
    assert len(calls) >= 1 and set(calls) <= {"Paris", "Rome", "Tokyo"}
    first = result.raw_responses[0].output
    assert [o.type for o in first if o.type == "function_call"] and isinstance(result.final_output, str)


def test_langchain_chat_openai_invoke_stream_and_tools(server):
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    proc, _ = server
    llm = ChatOpenAI(model=MODEL, base_url=proc.base_url + "/v1", api_key=KEY, max_retries=0)
    reply = llm.invoke("Say hello")
    assert isinstance(reply, AIMessage) and reply.content.strip()
    assert reply.usage_metadata["output_tokens"] > 0 and reply.response_metadata["model_name"] == MODEL

    streamed = "".join(chunk.content for chunk in llm.stream("Say hello"))
    assert streamed.strip()

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    with_tools = llm.bind_tools([add]).invoke("Hi!")
    assert isinstance(with_tools, AIMessage) and (with_tools.content.strip() or with_tools.tool_calls)


def test_langchain_chat_openai_over_the_responses_api(server):
    from langchain_openai import ChatOpenAI

    proc, _ = server
    llm = ChatOpenAI(model=MODEL, base_url=proc.base_url + "/v1", api_key=KEY, max_retries=0, use_responses_api=True)
    reply = llm.invoke("Say hello")
    assert reply.text.strip() and reply.usage_metadata["output_tokens"] > 0
