"""Notebook 11's stall probe: what an innocent stream sees when a long prompt arrives beside it.

A client streams one short request from a running server; once it has 20 chunks, a long prompt is
sent. The times each chunk arrived (client clock, seconds since the long prompt was sent) show the
stall: without a token budget one step carries the whole long prompt and the stream waits for it;
with one (chunked prefill, as vLLM V1's ``max_num_batched_tokens``) no step carries more than the
budget. :func:`largest_step` reads the server's live view for the most tokens one step carried.
"""
from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np


async def chunk_times_beside_a_long_prompt(url: str, long_prompt: list[int], prompt: str = "BORE, n.",
                                           max_tokens: int = 100) -> np.ndarray:
    """When each chunk of an innocent stream arrived, in seconds since the long prompt was sent."""
    times, t0 = [], time.perf_counter()
    async with httpx.AsyncClient(timeout=120) as c:
        async def innocent():
            body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            async with c.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith('data: {"id"') and '"text":""' not in line:  # a chunk with text
                        times.append(time.perf_counter() - t0)

        task = asyncio.ensure_future(innocent())
        while len(times) < 20:
            await asyncio.sleep(0.005)
        sent = time.perf_counter() - t0
        await c.post(url + "/v1/completions", json={"prompt": long_prompt, "max_tokens": 2})
        await task
    return np.array(times) - sent


def largest_step(url: str) -> int:
    """The most tokens one engine step carried, from the server's live view of its recent steps."""
    return max(sum(n for _, _, _, n, _ in s["seqs"]) for s in httpx.get(url + "/live/steps").json()["steps"])
