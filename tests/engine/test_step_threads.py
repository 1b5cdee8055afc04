"""On the CPU a step of one token runs on ``cpu_threads_one_token`` threads, the others on every
thread the process has (``runner.StepThreads``); the server leaves the gateway a core that way."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.runner import StepThreads
from ninfer.server.bootstrap import one_token_threads


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_one_token_step_takes_fewer_threads_and_the_next_prompt_all(two_threads, tmp_path_factory):
    from support.decode_paths import load_parts
    from ninfer.engine.engine import LLMEngine
    from ninfer.engine.request import Request
    from ninfer.engine.sampling_params import SamplingParams

    model, tok = load_parts("qwen3_5", tmp_path_factory)
    engine = LLMEngine(model, tok, EngineConfig(max_context=128, max_concurrency=2, kv_capacity=512, page_size=8,
                                                cpu_threads_one_token=1))
    seen = []
    forward = engine.runner.model.forward

    def record(input_ids, batch):
        seen.append((input_ids.shape[0], torch.get_num_threads()))
        return forward(input_ids, batch)

    engine.runner.model.forward = record
    engine.add_request(Request("a", list(range(3, 23)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                               max_total_tokens=64))
    while engine.has_work:
        engine.step()
    engine.add_request(Request("b", list(range(5, 17)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                               max_total_tokens=64))
    while engine.has_work:
        engine.step()
    assert seen == [(20, 2), (1, 1), (1, 1), (12, 2), (1, 1)]


def test_the_server_leaves_one_core_for_one_token_steps_on_the_cpu(two_threads):
    assert one_token_threads(EngineConfig()).cpu_threads_one_token == 1
    assert one_token_threads(EngineConfig(cpu_threads_one_token=2)).cpu_threads_one_token == 2  # as given
    assert one_token_threads(EngineConfig(device="cuda")).cpu_threads_one_token == 0
    assert StepThreads.configure(torch.device("cuda"), 1) is None
    assert StepThreads.configure(torch.device("cpu"), 2) is None  # not fewer than the process has
    torch.set_num_threads(1)
    assert one_token_threads(EngineConfig()).cpu_threads_one_token == 0  # one core: nothing to leave
