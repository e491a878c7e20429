"""Text mode: ask the engine how many tokens a new prefix has (``POST /tokenize``).

Text mode converts its character chunks into tokens at a learned
characters-per-token estimate (:class:`~prefixrouter.core.hashing.TokenEstimator`),
global and per prefix, taught by each answer's ``usage.prompt_tokens``. A
new document has no estimate of its own until its first answer, and that
answer comes after the document's whole cold prefill: every request for it
routed in between converts at the global estimate, the prior of 4.0 before
any answer. On vLLM's CPU build with a small model's tokenizer (about 1.9
characters per token) that predicted 2,523 cached tokens where the engine
reused 5,504, for every request of the document's first prefill.

So when a text-mode request is routed and
:meth:`~prefixrouter.core.dispatch.Dispatcher.wants_token_count` says its
prefix has no estimate yet, :class:`TokenCounter` sends the same prompt
(the messages and the options that change the chat template's output, or the
prompt string) to the chosen worker's ``/tokenize`` and hands the count to
:meth:`~prefixrouter.core.dispatch.Dispatcher.counted`, which teaches the
estimate as an answer would (and, on a cluster replica, tells its peers).
It runs beside the request, never before it: the request is not delayed,
and a count that fails changes nothing (the first answer still teaches the
estimate). vLLM serves ``/tokenize`` on its API server, off the
engine's step loop.

Bounded: one count in flight per prefix key (the requests routed while it is
out would ask for the same), at most ``max_in_flight`` in all (a burst of
unique prompts costs that many small requests, never one per prompt), each
cut after ``timeout_s``; a worker that answers 404 or 405 (an engine without
the endpoint) is not asked again until it is re-registered. Only ``vllm``
workers are asked: other engines' tokenize endpoints take other bodies.

Metrics: ``prefixrouter_token_counts_total{outcome}`` (``ok``, ``error``,
``unsupported``, ``skipped``: over the in-flight bound).
"""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import orjson

from prefixrouter.core.dispatch import Admission, Dispatcher
from prefixrouter.gateway.background import BackgroundTasks
from prefixrouter.gateway.metrics import GatewayMetrics
from prefixrouter.gateway.request_builder import BuiltRequest
from prefixrouter.gateway.workers import Worker

log = logging.getLogger("prefixrouter.gateway")

CHAT_TEMPLATE_FIELDS = (
    "messages",
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
)
"""Chat fields that decide the rendered prompt, hence its token count (vLLM's
``TokenizeChatRequest`` takes them all; ``add_generation_prompt`` is on by
default there, as in a chat completion)."""


def tokenize_body(built: BuiltRequest) -> dict[str, Any] | None:
    """The ``/tokenize`` body that counts the same tokens as ``built``'s completion.

    None when the request cannot be counted that way (a completion whose
    prompt is not one string).
    """
    body = built.body
    out: dict[str, Any] = {"model": built.model}
    if "messages" in body:
        for name in CHAT_TEMPLATE_FIELDS:
            if name in body:
                out[name] = body[name]
        return out
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        return None
    out["prompt"] = prompt
    if "add_special_tokens" in body:
        out["add_special_tokens"] = body["add_special_tokens"]
    return out


class TokenCounter:
    """Counts new prefixes' tokens on the engines, in the background (module docstring).

    Args:
        dispatch: The dispatcher whose estimate the counts teach.
        metrics: Where the outcomes are counted.
        max_in_flight: Counts out at once.
        timeout_s: Time allowed for one count.
    """

    def __init__(
        self,
        dispatch: Dispatcher,
        metrics: GatewayMetrics,
        max_in_flight: int = 8,
        timeout_s: float = 5.0,
    ) -> None:
        self.dispatch = dispatch
        self.metrics = metrics
        self.max_in_flight = max_in_flight
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._pending: set[str] = set()  # prefix keys with a count out
        self._tasks = BackgroundTasks()
        self._unsupported: set[Worker] = set()

    def routed(
        self,
        built: BuiltRequest,
        admission: Admission,
        worker: Worker,
        session: aiohttp.ClientSession | None,
    ) -> None:
        """A first attempt was routed: count its prompt's tokens if its prefix has no estimate."""
        if (
            session is None
            or not built.text_chars
            or worker.config.kind != "vllm"
            or worker in self._unsupported
            or not self.dispatch.wants_token_count(admission)
        ):
            return
        key = admission.decision.prefix_key
        if key in self._pending:
            return
        if len(self._tasks) >= self.max_in_flight:
            self.metrics.token_count("skipped")
            return
        body = tokenize_body(built)
        if body is None:
            return
        self._pending.add(key)
        self._tasks.spawn(
            self._count(session, worker, body, built.text_chars, admission, key), "token-count"
        )

    async def _count(
        self,
        session: aiohttp.ClientSession,
        worker: Worker,
        body: dict[str, Any],
        chars: int,
        admission: Admission,
        key: str,
    ) -> None:
        try:
            count = await self._ask(session, worker, body)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.metrics.token_count("error")
            log.debug("token count on %s failed: %s", worker.id, exc)
            return
        finally:
            self._pending.discard(key)
        if count is None:
            self._unsupported.add(worker)
            self.metrics.token_count("unsupported")
            log.info("worker %s has no /tokenize: its estimates come from answers", worker.id)
            return
        self.dispatch.counted(admission, chars, count)  # and a replica's peers learn it
        self.metrics.token_count("ok")

    async def _ask(
        self, session: aiohttp.ClientSession, worker: Worker, body: dict[str, Any]
    ) -> int | None:
        """The engine's count; None if it has no ``/tokenize``. ValueError on a bad answer."""
        async with session.post(
            worker.url + "/tokenize",
            data=orjson.dumps(body),
            headers={**worker.headers, "Content-Type": "application/json"},
            timeout=self.timeout,
        ) as resp:
            if resp.status in (404, 405):
                return None
            raw = await resp.read()
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}")
        answer = orjson.loads(raw)
        count = answer.get("count") if isinstance(answer, dict) else None
        if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
            raise ValueError(f"no positive 'count' in the answer: {raw[:80]!r}")
        return count

    async def close(self) -> None:
        """Cancel the counts still out (the application's cleanup)."""
        await self._tasks.close()
        self._pending.clear()
