"""Text mode's view of a simulated request: token ids -> an OpenAI chat body.

The gateway's default routing mode sees prompts as text (rendered ChatML in
character chunks, tokens estimated). To simulate it, every
:class:`~prefixrouter.sim.workload.SimRequest` is turned into the chat body a
client would send, and the simulator builds and hashes it through the
gateway's own request path (:func:`prefixrouter.prompt.request.build_prompt`
and the dispatcher's text-mode hashing). The simulated engine keeps its exact
token-level KV model: the token arrays stay the engine's truth; only the
router sees text.

**The token -> text mapping.** Token id ``t`` is the word ``" " + w(t)``, where
``w(t)`` is ``t`` written in bijective base 26 over ``a..z`` (``0 -> a``,
``25 -> z``, ``26 -> aa``, ...). A token array's text is the concatenation of
its tokens' words, so:

* **prefix preserving**: ``text(a + b) == text(a) + text(b)``; equal token
  prefixes give equal text prefixes, and a shared segment (a system prompt, a
  document) is a shared text prefix wherever the requests share it;
* **injective**: words contain no space and each starts with one, so the text
  splits back into the token ids (different tokens give different text from
  the first token that differs);
* **about 4.4 characters per token** for ids drawn uniformly from 32,000 (a
  Llama-2-sized vocabulary): words of 1 to 4 letters plus the space, close to
  English under a BPE tokenizer, and varying per token as real text does;
* deterministic, with no state: the same ids give the same text in every run.

**The body.** Tokens before ``first_user_offset`` are the system message,
the rest the user message (a request without a system part has only the user
message); ``max_tokens`` is the request's output length and ``model`` the
namespace's model revision. The rendered prompt then adds the ChatML markup
(``<|im_start|>system\\n`` ... ``<|im_start|>assistant\\n``, 80 characters
for a system and a user message).

**The engine's prompt_tokens** is the workload's token count in both modes:
the token arrays stand for the whole prompt as the engine tokenizes it, so a
text run and a token run prefill, cache and report the same tokens and their
results compare like for like. The ChatML markup has no tokens of its own
here (the live ``prefixrouter engine`` counts its template's tokens with the
project's BPE tokenizer): the characters-per-token estimate learns the
markup's characters as part of the prompt's, a bias of 80 characters per
request (about 0.05 % of a doc-qa prompt, 2 % of a 1,000-token one).

**Caching.** Workloads share segment array objects (a document asked about
600 times is one array); :class:`TextRenderer` renders each shared segment
once and keeps its text (least recently used first out past a character
budget), so a run renders a 40,000-token document once, not once per request
and policy. Segments used by one request only are rendered when needed and
not kept.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from prefixrouter.core.types import RoutingRequest
from prefixrouter.prompt.classify import DEFAULT_PARAMS, ClassifierParams
from prefixrouter.prompt.request import CHAT, build_prompt_request
from prefixrouter.sim.workload import DEFAULT_VOCAB, SimRequest

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
DEFAULT_TEXT_BUDGET_CHARS = 64 * 1024 * 1024
"""Characters of shared-segment text a :class:`TextRenderer` keeps (about 64 MB)."""


def token_word(token: int) -> str:
    """The word of one token id: a space, then ``token`` in bijective base 26 (``a..z``)."""
    if token < 0:
        raise ValueError(f"token ids are non-negative, got {token}")
    letters: list[str] = []
    n = token + 1
    while n > 0:
        n, r = divmod(n - 1, 26)
        letters.append(_LETTERS[r])
    return " " + "".join(reversed(letters))


_WORDS: tuple[str, ...] = tuple(token_word(t) for t in range(DEFAULT_VOCAB))


def tokens_text(tokens: Sequence[int]) -> str:
    """The text of a token array (see the module docstring); ``""`` for no tokens."""
    if not tokens:
        return ""
    words = _WORDS
    if max(tokens) < len(words):
        return "".join(map(words.__getitem__, tokens))  # C loops: ~1 ms per 40k tokens
    return "".join(words[t] if t < len(words) else token_word(t) for t in tokens)


def text_tokens(text: str) -> list[int]:
    """The token ids of a text made by :func:`tokens_text` (its inverse)."""
    out: list[int] = []
    for word in text.split(" ")[1:]:
        n = 0
        for ch in word:
            n = n * 26 + _LETTERS.index(ch) + 1
        out.append(n - 1)
    return out


class TextRenderer:
    """Chat bodies of a workload's requests, with each shared segment's text rendered once.

    Args:
        requests: The requests the renderer will see: a segment object that two
            or more of them carry is cached; the others are rendered on demand.
        budget_chars: Characters of cached text kept (least recently used evicted).
    """

    def __init__(
        self, requests: Iterable[SimRequest], budget_chars: int = DEFAULT_TEXT_BUDGET_CHARS
    ) -> None:
        seen: set[int] = set()
        shared: set[int] = set()
        for req in requests:
            for seg in req.segments:
                key = id(seg)
                if key in seen:
                    shared.add(key)
                seen.add(key)
        self._shared = shared
        self._budget = budget_chars
        self._chars = 0
        # id(segment) -> (segment, text): the segment is held so its id is not reused.
        self._cache: OrderedDict[int, tuple[array[int], str]] = OrderedDict()

    def segment_text(self, seg: array[int]) -> str:
        """The text of one segment (cached when the workload shares it)."""
        key = id(seg)
        if key not in self._shared:
            return tokens_text(seg)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit[1]
        text = tokens_text(seg)
        self._cache[key] = (seg, text)
        self._chars += len(text)
        while self._chars > self._budget and len(self._cache) > 1:
            _, (_, old) = self._cache.popitem(last=False)
            self._chars -= len(old)
        return text

    def messages(self, req: SimRequest) -> list[dict[str, str]]:
        """The request's chat messages: the system part, then the user part."""
        offset = req.first_user_offset
        system: list[str] = []
        user: list[str] = []
        pos = 0
        for seg in req.segments:
            end = pos + len(seg)
            if end <= offset:
                system.append(self.segment_text(seg))
            elif pos >= offset:
                user.append(self.segment_text(seg))
            else:  # the first user message starts inside this segment
                system.append(tokens_text(seg[: offset - pos]))
                user.append(tokens_text(seg[offset - pos :]))
            pos = end
        out: list[dict[str, str]] = []
        if system:
            out.append({"role": "system", "content": "".join(system)})
        out.append({"role": "user", "content": "".join(user)})
        return out

    def chat_body(self, req: SimRequest, max_tokens: int | None = None) -> dict[str, Any]:
        """The OpenAI chat body a client would send for ``req``.

        ``max_tokens``: the client's cap; None: the answer's own length, as a
        benchmark client sends it; 0: no ``max_tokens`` field at all.
        """
        body: dict[str, Any] = {
            "model": req.namespace.model_revision,
            "messages": self.messages(req),
        }
        sent = req.output_tokens if max_tokens is None else max_tokens
        if sent:
            body["max_tokens"] = sent
        return body


def text_routing_request(
    req: SimRequest,
    renderer: TextRenderer,
    classifier: ClassifierParams = DEFAULT_PARAMS,
    max_tokens: int | None = None,
) -> tuple[RoutingRequest, int]:
    """The router's view of ``req`` in text mode, built as the gateway builds it.

    The chat body goes through the gateway's request path
    (:func:`~prefixrouter.prompt.request.build_prompt_request`, no tokenizer:
    text mode; no ``X-Prefix-Class``: the class is inferred, as for a client
    that sends none) and becomes the :class:`RoutingRequest` the gateway's
    request builder makes of it (namespace: the simulated request's own).
    ``max_tokens`` is what the client sends (:meth:`TextRenderer.chat_body`).

    Returns:
        The routing request and its prompt's characters (with the engine's
        ``prompt_tokens`` they teach the characters-per-token estimate).
    """
    built = build_prompt_request(renderer.chat_body(req, max_tokens), CHAT, classifier=classifier)
    prompt = built.prompt
    routing = RoutingRequest(
        request_id=req.request_id,
        namespace=req.namespace,
        text=prompt.text,
        max_tokens=built.options.max_tokens,
        prefix_class=prompt.prefix_class,
        model=built.options.model,
        first_user_text=prompt.first_user_text,
    )
    return routing, prompt.text_chars
