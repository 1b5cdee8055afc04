"""Our Qwen3.5 chat template and the sandboxed renderer."""
from __future__ import annotations

import json

import pytest

from ninfer.engine.frontend.chat_template import ChatTemplate, TemplateError, builtin_template

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo du jour",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def qwen() -> ChatTemplate:
    return ChatTemplate(builtin_template("qwen3_5"))


def test_simple_conversation_exact(qwen: ChatTemplate) -> None:
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
        {"role": "user", "content": "How are you?"},
    ]
    history = (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"  # past reasoning dropped
        "<|im_start|>user\nHow are you?<|im_end|>\n"
    )
    assert qwen.render(messages) == history + "<|im_start|>assistant\n<think>\n"
    assert qwen.render(messages, enable_thinking=True) == history + "<|im_start|>assistant\n<think>\n"
    assert qwen.render(messages, enable_thinking=False) == (
        history + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert qwen.render(messages, add_generation_prompt=False) == history


def test_no_system_turn_without_system_or_tools(qwen: ChatTemplate) -> None:
    assert qwen.render([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )


def test_content_parts(qwen: ChatTemplate) -> None:
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    out = qwen.render([{"role": "user", "content": parts}], add_generation_prompt=False)
    assert out == "<|im_start|>user\nHello there<|im_end|>\n"
    # an image part is its placeholder between the vision tokens (expanded by the server: server/media.py)
    image = qwen.render([{"role": "user", "content": [{"type": "image", "image": "data:,"}, "Hi"]}],
                        add_generation_prompt=False)
    assert image == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n"
    with pytest.raises(TemplateError, match="input_audio"):
        qwen.render([{"role": "user", "content": [{"type": "input_audio"}]}])


def test_preserve_thinking(qwen: ChatTemplate) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Bye"},
    ]
    out = qwen.render(messages, preserve_thinking=True, add_generation_prompt=False)
    assert "<|im_start|>assistant\n<think>\nGreet back.\n</think>\n\nHello!<|im_end|>\n" in out
    # reasoning written inline in content is recognised too, and dropped from history by default
    inline_turn = {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"}
    inline = [messages[0], inline_turn, messages[2]]
    assert qwen.render(inline, add_generation_prompt=False) == qwen.render(
        messages, add_generation_prompt=False
    )
    assert "Greet back." not in qwen.render(inline)


def test_tools_system_turn(qwen: ChatTemplate) -> None:
    out = qwen.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"}],
                      tools=[WEATHER_TOOL])
    system = out.split("<|im_end|>")[0]
    assert system.startswith(
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
    )
    assert "\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n</tools>\n\n" in system
    assert "Météo" in system  # non-ASCII kept
    assert "<tool_call>\n<function=" in system and "<parameter=" in system
    assert system.endswith("\n\nBe brief.")
    no_system = qwen.render([{"role": "user", "content": "Paris?"}], tools=[WEATHER_TOOL])
    assert no_system.startswith("<|im_start|>system\n# Tools") and "</tools>" in no_system


def tool_conversation() -> list[dict]:
    return [
        {"role": "user", "content": "Weather in Paris and Lyon?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Two cities, two calls.",
            "tool_calls": [
                {"id": "1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
                {"id": "2", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Lyon", "opts": {"unit": "°C"}}}},
            ],
        },
        {"role": "tool", "tool_call_id": "1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "2", "content": "rain"},
    ]


def test_tool_calls_and_responses(qwen: ChatTemplate) -> None:
    out = qwen.render(tool_conversation(), tools=[WEATHER_TOOL])
    turns = out.split("<|im_end|>\n<|im_start|>user\nWeather in Paris and Lyon?<|im_end|>\n")[1]
    assert turns == (
        "<|im_start|>assistant\n<think>\nTwo cities, two calls.\n</think>\n\nChecking.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n"
        '<parameter=opts>\n{"unit": "°C"}\n</parameter>\n</function>\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrain\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )


def test_tool_call_without_content(qwen: ChatTemplate) -> None:
    messages = [{"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    out = qwen.render(messages, add_generation_prompt=False)
    assert out.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n"
                        "<tool_call>\n<function=f>\n</function>\n</tool_call><|im_end|>\n")
    broken_call = {"function": {"name": "f", "arguments": "{oops"}}
    bad = [messages[0], {"role": "assistant", "tool_calls": [broken_call]}]
    with pytest.raises(TemplateError, match="not valid JSON"):
        qwen.render(bad)


def test_rendered_answer_extends_the_prompt(qwen: ChatTemplate) -> None:
    """Re-rendering a generated turn reproduces what was generated, so the prompt cache hits."""
    conversation = tool_conversation()
    for thinking in (True, False):
        prompt = qwen.render(conversation, enable_thinking=thinking)
        reasoning = "It is sunny in Paris." if thinking else ""
        generated = (reasoning + "\n</think>\n\n" if thinking else "") + "Paris: sunny. Lyon: rain."
        answer = {"role": "assistant", "content": "Paris: sunny. Lyon: rain.", "reasoning_content": reasoning}
        full = qwen.render(conversation + [answer], add_generation_prompt=False, enable_thinking=thinking)
        assert full == prompt + generated + "<|im_end|>\n"


def test_later_system_messages_keep_their_place(qwen: ChatTemplate) -> None:
    out = qwen.render([{"role": "user", "content": "a"}, {"role": "developer", "content": " b "},
                       {"role": "user", "content": "c"}], enable_thinking=False)
    assert out.startswith("<|im_start|>user\na<|im_end|>\n<|im_start|>system\nb<|im_end|>\n"
                          "<|im_start|>user\nc<|im_end|>\n")
    with pytest.raises(TemplateError, match="role"):
        qwen.render([{"role": "wizard", "content": "a"}])


def test_raise_exception_gives_template_error() -> None:
    template = ChatTemplate("{% if messages|length == 0 %}{{ raise_exception('no messages!') }}{% endif %}ok")
    assert template.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TemplateError, match="no messages!"):
        template.render([])
    assert issubclass(TemplateError, ValueError)


def test_jinja_errors_become_template_errors() -> None:
    with pytest.raises(TemplateError, match="syntax"):
        ChatTemplate("{% if %}")
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError):  # the sandbox refuses mutation
        ChatTemplate("{{ messages.append(1) }}").render([])


def test_tojson_and_globals() -> None:
    template = ChatTemplate("{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ bos_token }}{{ eos_token }}",
                            bos_token="<s>", eos_token="</s>")
    out = template.render([], x={"name": "日本", "b": [1, 2]})
    indented = '{\n  "name": "日本",\n  "b": [\n    1,\n    2\n  ]\n}'
    assert out == '{"name": "日本", "b": [1, 2]}|' + indented + "|<s></s>"
    assert len(ChatTemplate("{{ strftime_now('%Y') }}").render([])) == 4
    loops = ChatTemplate("{% for i in [1,2,3,4] %}{% if i == 2 %}{% continue %}{% endif %}"
                         "{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}")
    assert loops.render([]) == "13"


def test_builtin_template_names() -> None:
    assert "<|im_start|>" in builtin_template("qwen3_5")
    with pytest.raises(ValueError):
        builtin_template("nope")
    with pytest.raises(ValueError):
        builtin_template("../chat_template")
