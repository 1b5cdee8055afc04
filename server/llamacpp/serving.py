"""llama.cpp-compatible endpoints: raw completion, tokenizer access, template, props and slots."""
from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from ...engine.frontend import fim
from ...engine.outputs import RequestOutput, TokenLogprob
from ...engine.sampling_params import SamplingParamError, SamplingParams
from ..errors import APIError
from ..generation import check_context_floor, check_prompt, check_token_ids
from ..choices import all_of, merged
from ..logprobs import TokenText, llamacpp_entries, llamacpp_logit_bias, new_logprobs
from ..openai_common import check_choices, check_model, timings
from ..state import ServerState
from ..streaming import sse_data
from .protocol import (ApplyTemplateRequest, CompletionRequest, InfillRequest, PromptParts, TokenizeRequest,
                       prompt_list)

REPLACEMENT = "\ufffd"


def prompt_ids(state: ServerState, parts: PromptParts, param: str, framed: bool = False) -> list[int]:
    """The ids of one prompt given as texts and token ids in order (each text tokenized apart).
    ``framed``: a prompt that is one text gets the special tokens the tokenizer puts around an
    input of its own (``Tokenizer.encode_alone``: embeddings)."""
    kinds = set(map(type, parts))  # in C: a returning conversation's prompt is 30,000 ids
    texts = [p for p in parts if isinstance(p, str)] if any(issubclass(k, str) for k in kinds) else []
    check_context_floor(state, sum(state.tokenizer.min_tokens(p) for p in texts) + len(parts) - len(texts), param)
    ids: list[int] = []
    if not texts:  # token ids only (a returning conversation's long prompt): checked in one pass
        check_token_ids(state, parts, param)
        ids = list(parts)
    for i, part in enumerate(parts if texts else ()):
        if isinstance(part, str):
            ids += state.tokenizer.encode_alone(part) if framed and len(parts) == 1 else state.tokenizer.encode(part)
        else:
            check_token_ids(state, [part], param, offset=i)
            ids.append(part)
    if not ids:
        raise APIError(400, "the prompt has no tokens", param, "invalid_value")
    check_prompt(state, ids, param)
    return ids


class PreparedCompletion:
    """One prompt of a ``/completion`` (or ``/infill``) request, tokenized and checked, with the
    request's sampling parameters; ``index``: its place in a batch; ``n``: its completions."""

    def __init__(self, req: CompletionRequest, state: ServerState, ids: list[int], params: SamplingParams,
                 index: int = 0, text: str | None = None, n: int = 1) -> None:
        self.prompt_ids = ids
        self.params = params
        self.index = index
        self.n = n
        self.id = "cmpl-" + uuid.uuid4().hex
        self.model = state.model_id
        self.req = req
        self.prompt_text = text  # None until ``decode_prompt``
        self.token_text = TokenText(state.tokenizer)
        self.workers = state.workers

    async def decode_prompt(self) -> str:
        """The prompt as text, which the last object of an answer names: decoded on a worker
        thread when the answer ends, not before the request goes to the engine (the ids of a
        returning conversation's prompt, 30,000 of them, take milliseconds to decode)."""
        if self.prompt_text is None:
            self.prompt_text = await self.workers.run(self.token_text.tokenizer.decode, self.prompt_ids)
        return self.prompt_text


def completion_params(req: CompletionRequest, state: ServerState) -> SamplingParams:
    try:
        return req.sampling_params(state.sampling, state.default_max_tokens,
                                   llamacpp_logit_bias(state, req.logit_bias))
    except SamplingParamError as exc:
        raise APIError(400, str(exc), exc.param, "invalid_value") from exc


def prepare_completion(req: CompletionRequest, state: ServerState) -> tuple[list[PreparedCompletion], bool]:
    """The prompts of a ``/completion`` request, and whether it is a batch (answered as a list)."""
    check_model(state, req.model)
    req.reject_unsupported()
    n_param = "n_cmpl" if req.n_cmpl is not None else "n"
    n = check_choices(state, req.choices, n_param)
    try:
        prompts, batch = prompt_list(req.prompt)
    except ValueError as exc:
        raise APIError(400, str(exc), "prompt", "invalid_value") from exc
    if batch and n > 1:
        raise APIError(400, "several completions of each prompt of a batch are not available: send a batch "
                       "or n_cmpl > 1, not both", n_param, "unsupported_parameter")
    params = completion_params(req, state)
    out = []
    for i, parts in enumerate(prompts):
        ids = prompt_ids(state, parts, f"prompt[{i}]" if batch else "prompt")
        text = parts[0] if len(parts) == 1 and isinstance(parts[0], str) else None
        out.append(PreparedCompletion(req, state, ids, params, i, text, n))
    return out, batch


def prepare_infill(req: InfillRequest, state: ServerState) -> PreparedCompletion:
    """The fill-in-the-middle prompt of an ``/infill`` request (``engine/frontend/fim.py``); a
    400 naming the FIM tokens the model's tokenizer lacks."""
    check_model(state, req.model)
    req.reject_unsupported()
    tok = state.tokenizer
    try:
        tokens = fim.FimTokens.of(tok)
    except fim.MissingFimTokens as exc:
        raise APIError(400, f"/infill needs a model trained for fill-in-the-middle: {exc} ('{state.model_id}')",
                       None, "fim_not_supported") from exc
    params = completion_params(req, state)
    parts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    prompt = prompt_ids(state, parts, "prompt") if any(p != "" for p in parts) else []
    for name in ("input_prefix", "input_suffix"):
        check_context_floor(state, tok.min_tokens(getattr(req, name)), name)
    prefix, suffix = tok.encode(req.input_prefix), tok.encode(req.input_suffix)
    extra = [fim.ExtraChunk(c.text, c.filename) for c in req.input_extra]
    reserve = min(params.max_tokens or 0, state.max_context // 2)  # room kept for the answer
    ids = fim.render(tok, tokens, prefix, suffix, prompt, extra, limit=state.max_context - 1 - reserve)
    check_prompt(state, ids, "input_suffix" if len(suffix) > len(prefix) else "input_prefix")  # the longer one
    return PreparedCompletion(req, state, ids, params)


def stop_type(final: RequestOutput) -> tuple[str, str]:
    """llama.cpp's ``stop_type`` (eos | word | limit | none) and ``stopping_word``."""
    if final.finish_reason == "stop":
        if isinstance(final.stop_reason, str):
            return "word", final.stop_reason
        return "eos", ""
    if final.finish_reason == "length":
        return "limit", ""
    return "none", ""


def _settings(prep: PreparedCompletion) -> dict[str, Any]:
    p = prep.params
    return {"n_predict": -1 if p.max_tokens is None else p.max_tokens, "temperature": p.temperature,
            "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p, "repeat_penalty": p.repetition_penalty,
            "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "seed": -1 if p.seed is None else p.seed, "ignore_eos": p.ignore_eos, "stop": list(p.stop),
            "n_probs": p.logprobs or 0, "post_sampling_probs": p.logprobs_after_sampling}


def probabilities(prep: PreparedCompletion, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """``completion_probabilities`` of these tokens, when the request asks (``n_probs``)."""
    if not prep.params.logprobs:
        return {}
    return {"completion_probabilities": llamacpp_entries(prep.token_text, logprobs,
                                                         prep.params.logprobs_after_sampling)}


def final_body(prep: PreparedCompletion, final: RequestOutput, content: str, tokens: list[int],
               logprobs: list[TokenLogprob] | None = None, index: int = 0) -> dict[str, Any]:
    """The last object of an answer (``logprobs``: all its tokens', for one that is not streamed)."""
    kind, word = stop_type(final)
    return {
        "index": index,
        "content": content,
        "tokens": tokens,
        "id_slot": -1,
        "stop": True,
        "model": prep.model,
        "tokens_predicted": final.completion_tokens,
        "tokens_evaluated": final.prompt_tokens,
        "tokens_cached": final.cached_tokens,
        "generation_settings": _settings(prep),
        "prompt": prep.prompt_text,
        "has_new_line": "\n" in content,
        "truncated": False,
        "stop_type": kind,
        "stopping_word": word,
        "timings": timings(final),
        **({} if logprobs is None else probabilities(prep, logprobs)),
    }


async def _choice(prep: PreparedCompletion, index: int, outputs: AsyncIterator[RequestOutput]) -> dict[str, Any]:
    text: list[str] = []
    tokens: list[int] = []
    logprobs: list[TokenLogprob] = []
    final: RequestOutput | None = None
    async for out in outputs:
        text.append(out.text)
        tokens += out.token_ids
        logprobs += new_logprobs(out)
        final = out
    assert final is not None and final.finished
    await prep.decode_prompt()
    return picked(final_body(prep, final, "".join(text), tokens, logprobs, prep.index + index), prep.req.response_fields)


def picked(body: dict[str, Any], fields: list[str] | None) -> dict[str, Any]:
    """Only the ``fields`` of ``body`` (all of it when none are named), each under its path:
    ``generation_settings/n_predict`` is that nested value; a path that leads nowhere is left out."""
    if not fields:
        return body
    out: dict[str, Any] = {}
    for path in fields:
        value: Any = body
        for key in path.strip("/").split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


async def complete(prep: PreparedCompletion, outputs: list[AsyncIterator[RequestOutput]]) -> Any:
    """The result object; with several completions (``n_cmpl``), a list of them in order."""
    results = await all_of([_choice(prep, i, o) for i, o in enumerate(outputs)])
    return results if len(results) > 1 else results[0]


async def stream(prep: PreparedCompletion, outputs: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
    """llama.cpp's SSE: ``data:`` chunks with ``stop: false``, then one with ``stop: true`` and the
    totals per completion (its ``content`` is empty: all text came in the chunks before); each
    chunk names its completion's ``index``. No ``[DONE]``."""
    try:
        async for i, out in merged(outputs):
            if out.text or out.token_ids:
                yield sse_data({"index": prep.index + i, "content": out.text, "tokens": list(out.token_ids),
                                "stop": False, "id_slot": -1, "tokens_predicted": out.completion_tokens,
                                "tokens_evaluated": out.prompt_tokens, **probabilities(prep, new_logprobs(out))})
            if out.finished:
                await prep.decode_prompt()
                yield sse_data(final_body(prep, out, "", [], index=prep.index + i))
    except APIError as exc:
        yield sse_data(exc.body())


# ---------------------------------------------------------------------------- tokenizer access
def tokenize(state: ServerState, req: TokenizeRequest) -> dict[str, Any]:
    req.reject_unsupported()
    tok = state.tokenizer
    ids = tok.encode(req.content)
    if req.add_special and tok.adds_bos and tok.bos_token_id is not None and ids[:1] != [tok.bos_token_id]:
        ids = [tok.bos_token_id, *ids]
    if not req.with_pieces:
        return {"tokens": ids}
    return {"tokens": [{"id": i, "piece": piece(state, i)} for i in ids]}


def piece(state: ServerState, token_id: int) -> str | list[int]:
    """A token's text, or its bytes as a list of ints when they are not valid UTF-8 on their own."""
    raw = state.tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def detokenize(state: ServerState, ids: list[int]) -> dict[str, Any]:
    check_token_ids(state, ids, "tokens")
    return {"content": state.tokenizer.decode(ids)}


# ---------------------------------------------------------------------------- server views
def props(state: ServerState) -> dict[str, Any]:
    s = state.sampling
    config = state.engine.config
    return {
        "model_alias": state.model_id,
        "model_path": state.model_id,
        "n_ctx": state.max_context,
        "total_slots": config.max_concurrency,
        "chat_template": state.template.source,
        "bos_token": state.tokenizer.bos_token,
        "eos_token": state.tokenizer.eos_token,
        "default_generation_settings": {
            "n_ctx": state.max_context,
            "params": {"n_predict": -1, "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
                       "min_p": s.min_p, "repeat_penalty": s.repetition_penalty},
        },
        "modalities": {"vision": False, "audio": False},
        "build_info": "ninfer",
    }


def slots(state: ServerState) -> list[dict[str, Any]]:
    """One entry per execution lane: the resident requests in admission order, then idle lanes.

    From the engine's snapshot (``engine/snapshot.py``); prompts and outputs are not shown, only
    counts."""
    running = state.engine.loop.view().lanes
    lanes = []
    for i in range(state.engine.config.max_concurrency):
        req = running[i] if i < len(running) else None
        lane: dict[str, Any] = {"id": i, "n_ctx": state.max_context, "is_processing": req is not None}
        if req is None:
            lane.update(state="idle", id_task=None)
        else:
            p = req.params
            decoded = req.output_tokens
            lane.update(
                state="prefill" if req.prefilling else "decode",
                id_task=req.request_id,
                n_prompt_tokens=req.prompt_tokens,
                n_prompt_tokens_processed=req.prompt_computed,
                n_decoded=decoded,
                n_remain=-1 if p.max_tokens is None else max(p.max_tokens - decoded, 0),
                params={"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
                        "n_predict": -1 if p.max_tokens is None else p.max_tokens,
                        "seed": -1 if p.seed is None else p.seed},
                running_s=time.monotonic() - req.arrival,
            )
        lanes.append(lane)
    return lanes


# ---------------------------------------------------------------------------- chat template
def chat_prompt(state: ServerState, body: ApplyTemplateRequest) -> str:
    """The prompt ``/v1/chat/completions`` renders for the same body: the same request model and
    the same preparation, stopped before the engine."""
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    from ..errors import validation_error
    from ..openai_chat.protocol import ChatCompletionRequest
    from ..openai_chat.serving import PreparedChat

    fields = body.model_dump(exclude={"model"})
    try:
        req = ChatCompletionRequest.model_validate({**fields, "model": state.model_id})
    except ValidationError as exc:
        raise validation_error(RequestValidationError(exc.errors())) from exc
    return PreparedChat(req, state).prepared.prompt_text
