"""The client side of ``bench.serve``: prompts of exact token lengths, streams read from the
server's llama.cpp ``/completion`` SSE (every chunk carries its token ids, so each count is exact
and ``ignore_eos`` makes every answer ``n_predict`` tokens long), sessions of several turns,
arrival all at once or as a Poisson process, and the figures of one run."""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
from httpx_sse import SSEError, aconnect_sse


@dataclass(frozen=True)
class Load:
    """What one run sends: ``streams`` sessions of ``turns`` requests each."""

    streams: int
    prompt_tokens: int
    output_tokens: int
    turns: int = 1
    turn_tokens: int = 32  # the new user turn appended to the conversation before each later turn
    rate: float = 0.0  # sessions started per second, Poisson; 0: all at once
    temperature: float = 0.0
    timeout_s: float = 600.0  # longest wait for the next chunk of a stream
    concurrency: int = 0  # requests in flight at most (0: every session's at once); the rest queue in order
    prompt_tokens_max: int = 0  # first prompts spread evenly from prompt_tokens to this (0: all prompt_tokens)
    shared_tokens: int = 0  # every first prompt begins with the same this many tokens (a system prompt)

    def __post_init__(self) -> None:
        for name in ("streams", "prompt_tokens", "turns", "turn_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.concurrency < 0 or self.shared_tokens < 0:
            raise ValueError(f"concurrency and shared_tokens must be >= 0, got {self.concurrency}, {self.shared_tokens}")
        if self.prompt_tokens_max and self.prompt_tokens_max < self.prompt_tokens:
            raise ValueError(f"prompt_tokens_max ({self.prompt_tokens_max}) must be >= prompt_tokens "
                             f"({self.prompt_tokens})")
        if self.output_tokens < 2:
            raise ValueError(f"output_tokens must be >= 2 (a gap needs two tokens), got {self.output_tokens}")
        if self.rate < 0 or self.temperature < 0 or self.timeout_s <= 0:
            raise ValueError("rate and temperature must be >= 0, timeout_s > 0")

    def first_prompt_tokens(self, session: int) -> int:
        """Session ``session``'s first prompt length: ``prompt_tokens``, or spread evenly up to
        ``prompt_tokens_max`` over the sessions."""
        if not self.prompt_tokens_max or self.streams == 1:
            return self.prompt_tokens
        span = self.prompt_tokens_max - self.prompt_tokens
        return self.prompt_tokens + round(span * session / (self.streams - 1))


@dataclass
class Session:
    index: int
    start_s: float  # after the run's start
    prompt: list[int]  # the first turn
    follow_ups: list[list[int]]  # the user turn added before each later turn


@dataclass
class Record:
    """One request as the client saw it (times in seconds after the run's start)."""

    session: int
    turn: int
    sent: float
    prompt_tokens: int = 0  # as the server counted them
    cached_tokens: int = 0  # of them, taken from a prefix checkpoint
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried tokens
    chunk_sizes: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    done: float = 0.0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first chunk over the time from the first chunk to the last."""
        span = self.chunk_times[-1] - self.chunk_times[0]
        return (sum(self.chunk_sizes[1:]) / span) if span > 0 else None


async def tokenize(client: httpx.AsyncClient, text: str) -> list[int]:
    reply = await client.post("/tokenize", json={"content": text})
    reply.raise_for_status()
    return reply.json()["tokens"]


async def prompt_ids(client: httpx.AsyncClient, tag: str, n: int) -> list[int]:
    """The first ``n`` token ids, by the server's tokenizer, of a text that starts with ``tag``
    (so no two prompts of a run are the same) and goes on with numbers drawn from a generator
    seeded by it (so every run sends the same prompts)."""
    rng, words = random.Random(tag), n
    while True:
        ids = await tokenize(client, f"{tag}: " + " ".join(str(rng.randrange(100_000)) for _ in range(words)))
        if len(ids) >= n:
            return ids[:n]
        words *= 2


async def plan(client: httpx.AsyncClient, load: Load, tag: str) -> list[Session]:
    """Every session's prompts (tokenized before anything is timed) and start time."""
    rng, start, sessions = random.Random(f"{tag}/arrivals"), 0.0, []
    shared = await prompt_ids(client, f"System {tag}", load.shared_tokens) if load.shared_tokens else []
    for i in range(load.streams):
        if i and load.rate > 0:
            start += rng.expovariate(load.rate)
        first = shared + await prompt_ids(client, f"Session {tag}-{i}", load.first_prompt_tokens(i))
        follow = [await prompt_ids(client, f"\nTurn {tag}-{i}-{t}", load.turn_tokens) for t in range(1, load.turns)]
        sessions.append(Session(i, start, first, follow))
    return sessions


def _error_text(body: dict) -> str:
    err = body.get("error", body)
    return f"{err.get('code') or err.get('type')}: {err.get('message')}" if isinstance(err, dict) else str(err)


async def send(client: httpx.AsyncClient, rec: Record, ids: list[int], load: Load, seed: int, t0: float) -> None:
    """Stream one completion into ``rec``; any failure lands in ``rec.error``, never raises."""
    body = {"prompt": ids, "n_predict": load.output_tokens, "ignore_eos": True, "stream": True,
            "temperature": load.temperature, "seed": seed}
    final = None
    try:
        async with aconnect_sse(client, "POST", "/completion", json=body) as source:
            if source.response.status_code != 200:
                await source.response.aread()
                try:
                    detail = _error_text(source.response.json())
                except ValueError:
                    detail = source.response.text[:200]
                rec.error = f"HTTP {source.response.status_code} {detail}"
                return
            async for event in source.aiter_sse():
                data = json.loads(event.data)
                if "error" in data:
                    rec.error = _error_text(data)
                    return
                if data.get("stop"):
                    final = data
                    break
                if data["tokens"]:
                    rec.chunk_times.append(time.perf_counter() - t0)
                    rec.chunk_sizes.append(len(data["tokens"]))
                    rec.output_ids += data["tokens"]
    except (httpx.HTTPError, SSEError, json.JSONDecodeError, KeyError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
        return
    finally:
        rec.done = time.perf_counter() - t0
    if final is None:
        rec.error = "the stream ended without its final chunk"
        return
    rec.prompt_tokens = final.get("tokens_evaluated", 0)
    rec.cached_tokens = final.get("tokens_cached", 0)
    got = len(rec.output_ids)
    if got != load.output_tokens or final.get("tokens_predicted") != got:
        rec.error = f"{got} tokens streamed, {final.get('tokens_predicted')} counted, {load.output_tokens} asked"


async def converse(client: httpx.AsyncClient, s: Session, load: Load, t0: float,
                   slots: asyncio.Semaphore | None = None) -> list[Record]:
    """One session: each turn sends the conversation so far (prompt, answers and user turns, as
    token ids) and appends the answer and the next user turn to it. With ``slots``, each turn
    waits for one (first come, first served: sessions take turns)."""
    await asyncio.sleep(max(0.0, s.start_s - (time.perf_counter() - t0)))
    conversation, records = list(s.prompt), []
    for turn in range(load.turns):
        async with slots if slots is not None else contextlib.nullcontext():
            rec = Record(s.index, turn, time.perf_counter() - t0)
            records.append(rec)
            await send(client, rec, conversation, load, seed=s.index * load.turns + turn, t0=t0)
        if rec.error is not None:
            break
        if turn + 1 < load.turns:
            conversation += rec.output_ids + s.follow_ups[turn]
    return records


async def run(client: httpx.AsyncClient, sessions: list[Session], load: Load) -> tuple[list[Record], float]:
    """Every session of ``sessions``; the records and the wall time from the start to the last end."""
    t0 = time.perf_counter()
    slots = asyncio.Semaphore(load.concurrency) if load.concurrency else None
    done = await asyncio.gather(*(converse(client, s, load, t0, slots) for s in sessions))
    return [r for rs in done for r in rs], time.perf_counter() - t0


async def measure(base_url: str, load: Load, tag: str, warmup_tokens: int) -> dict:
    """Warm the server up with ``load.streams`` other prompts (``warmup_tokens`` out, all at once;
    0: no warm-up), then run ``load`` and return its figures."""
    limits = httpx.Limits(max_connections=load.streams + 4, max_keepalive_connections=load.streams + 4)
    timeout = httpx.Timeout(load.timeout_s, connect=30.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        measured = await plan(client, load, tag)
        if warmup_tokens:
            warm = Load(min(load.streams, load.concurrency or load.streams), load.prompt_tokens,
                        max(warmup_tokens, 2), temperature=load.temperature, timeout_s=load.timeout_s)
            await run(client, await plan(client, warm, f"warm-{tag}"), warm)
        records, wall = await run(client, measured, load)
        cache = await cache_gauges(client)
    return {**summarize(records, wall, load), "prompts": [s.prompt for s in measured], "cache_after": cache}


async def cache_gauges(client: httpx.AsyncClient) -> dict[str, float]:
    """The server's prefix-cache and host-memory figures from ``/metrics`` (empty where it has none)."""
    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith(("ninfer_prefix_", "ninfer_host_")):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def summarize(records: list[Record], wall: float, load: Load) -> dict:
    """The run's figures: total tok/s (every streamed token over the wall time), per-stream tok/s
    (the mean over requests of their rate after the first token), time to first token and the gap
    between chunks over all requests; for sessions of several turns, the returning turns' time to
    first token and the prompt tokens they took from prefix checkpoints."""
    ok = [r for r in records if r.error is None]
    ttft, gaps = [r.ttft for r in ok], [g for r in ok for g in r.gaps]
    returning = [r for r in ok if r.turn > 0]
    rates = [x for x in (r.decode_tok_s for r in ok) if x is not None]
    tokens = sum(len(r.output_ids) for r in records)
    return {
        "streams": load.streams, "requests": len(records), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error is not None}),
        "output_tokens": tokens, "wall_s": wall, "total_tok_s": tokens / wall if wall > 0 else 0.0,
        "per_stream_tok_s": statistics.fmean(rates) if rates else None,
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99), "ttft_max_s": max(ttft, default=None),
        "itl_p50_s": _pct(gaps, 50), "itl_p99_s": _pct(gaps, 99),
        "return_ttft_p50_s": _pct([r.ttft for r in returning], 50),
        "return_ttft_mean_s": statistics.fmean([r.ttft for r in returning]) if returning else None,
        "return_cached_share": (sum(r.cached_tokens for r in returning) / max(sum(r.prompt_tokens for r in returning), 1)
                                if returning else None),
        "requests_detail": [{"session": r.session, "turn": r.turn, "prompt_tokens": r.prompt_tokens,
                             "cached_tokens": r.cached_tokens,
                             "output_tokens": len(r.output_ids), "sent_s": r.sent, "done_s": r.done,
                             "ttft_s": r.ttft if r.chunk_times else None, "decode_tok_s": r.decode_tok_s
                             if r.chunk_times else None, "itl_p99_s": _pct(r.gaps, 99), "error": r.error}
                            for r in records],
    }
