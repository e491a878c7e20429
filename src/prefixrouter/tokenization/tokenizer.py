"""The project's own tokenizer and chat template: real token counts with no downloads.

Nothing can be downloaded on the machines this project runs on, yet the engine
server, the gateway's token-mode routing and the tiny real-vLLM model must all
count tokens the same way. So the tokenizer is *built* locally, deterministically:

* **Corpus**: the Python standard library's top-level ``*.py`` sources
  (``sysconfig.get_paths()["stdlib"]``), in file-name order, at most
  ``PER_FILE_CHARS`` characters of each and ``CORPUS_CHARS`` in all: code,
  docstrings and comments, so English prose tokenizes plausibly.
* **Model**: byte-level BPE (GPT-2 style byte alphabet, so any text encodes, no
  unknown token), ``VOCAB_SIZE`` = 8,192 entries, trained with ``tokenizers``.
  Training is deterministic (ties between merges are broken by the pair), and
  the JSON is written with the vocabulary in id order, so the same corpus gives
  the same file byte for byte. The corpus depends on the Python minor version,
  which is part of :data:`TOKENIZER_VERSION`.
* **Special tokens**: ``<|endoftext|>`` (0), ``<|im_start|>`` (1),
  ``<|im_end|>`` (2). They are matched in input text, as Hugging Face
  tokenizers do, so a rendered chat template encodes them as single ids.
* **Chat template**: ChatML (:mod:`.chatml`), rendered by the project's one
  renderer, :func:`prefixrouter.prompt.render.render_chat` (no Jinja), which the
  gateway uses for both routing modes; a model folder's own template is
  rendered as vLLM renders it (:mod:`.chat_template`).

Building takes about 0.3 s; the result is cached as
``<cache dir>/tokenizer-<version>.json`` where the cache dir is
``$PREFIXROUTER_CACHE``, else ``$XDG_CACHE_HOME/prefixrouter``, else
``~/.cache/prefixrouter``. The file is written to a temporary name and renamed,
so concurrent processes never read a partial file (each may build; all write
the same bytes). :func:`hf_tokenizer_dir` also writes a Hugging Face style
folder (``tokenizer.json`` + ``tokenizer_config.json`` with an equivalent
Jinja template) for tools that load tokenizers by directory: sglang-router,
transformers, vLLM.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HfTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from prefixrouter.errors import ConfigError
from prefixrouter.prompt.render import IM_END, IM_START, content_text, json_text
from prefixrouter.tokenization.chat_template import (
    ModelChatTemplate,
    continue_final,
    find_chat_template,
)
from prefixrouter.tokenization.chatml import CHAT_TEMPLATE_JINJA, ChatTemplateError, render_chat

__all__ = [
    "CHAT_TEMPLATE_JINJA",
    "SPECIAL_TOKENS",
    "TOKENIZER_VERSION",
    "VOCAB_SIZE",
    "ChatTemplateError",
    "Tokenizer",
    "build_tokenizer_json",
    "cache_dir",
    "hf_tokenizer_dir",
    "load_tokenizer",
    "render_chat",
    "tokenizer_path",
]

RECIPE = "r1"
"""Bump when anything below changes the built file."""
TOKENIZER_VERSION = f"{RECIPE}-py{sys.version_info.major}{sys.version_info.minor}"
"""Recipe and Python minor version (the corpus comes from the standard library)."""
VOCAB_SIZE = 8192
CORPUS_CHARS = 1_000_000
PER_FILE_CHARS = 40_000
SPECIAL_TOKENS = ("<|endoftext|>", IM_START, IM_END)

# ----------------------------------------------------------------- building


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(stdlib.glob("*.py"), key=lambda p: p.name):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")[:PER_FILE_CHARS]
        except OSError:
            continue
        if total + len(text) > CORPUS_CHARS:
            text = text[: CORPUS_CHARS - total]
        texts.append(text)
        total += len(text)
        if total >= CORPUS_CHARS:
            break
    if total < 100_000:
        raise RuntimeError(f"too little standard-library source under {stdlib} to train on")
    return texts


def build_tokenizer_json() -> str:
    """Train the tokenizer from the standard library sources; return its JSON text.

    Deterministic: the same Python installation gives the same text.
    """
    tok = _HfTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = _corpus()
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return tok.to_str()


def cache_dir() -> Path:
    """Where built tokenizers are kept (see the module docstring)."""
    env = os.environ.get("PREFIXROUTER_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "prefixrouter"


def _write_atomic(path: Path, data: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; other users' tools read the cache too
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _valid(path: Path) -> bool:
    try:
        _HfTokenizer.from_file(str(path))
    except Exception:
        return False
    return True


def tokenizer_path(directory: str | os.PathLike[str] | None = None) -> Path:
    """The cached tokenizer file, built first if missing or unreadable.

    Args:
        directory: Cache directory (default :func:`cache_dir`).

    Returns:
        ``<directory>/tokenizer-<TOKENIZER_VERSION>.json``.
    """
    path = Path(directory) if directory is not None else cache_dir()
    path = path / f"tokenizer-{TOKENIZER_VERSION}.json"
    if not (path.is_file() and _valid(path)):
        _write_atomic(path, build_tokenizer_json())
    return path


def hf_tokenizer_dir(directory: str | os.PathLike[str] | None = None) -> Path:
    """A Hugging Face style tokenizer folder beside the cached file.

    Holds ``tokenizer.json``, ``tokenizer_config.json`` (ChatML Jinja template,
    special tokens) and ``special_tokens_map.json``; each written atomically.

    Returns:
        ``<directory>/tokenizer-<TOKENIZER_VERSION>/``.
    """
    src = tokenizer_path(directory)
    folder = src.with_suffix("")
    data = src.read_text(encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 1_000_000,
        "chat_template": CHAT_TEMPLATE_JINJA,
        "clean_up_tokenization_spaces": False,
    }
    special = {"eos_token": IM_END, "pad_token": "<|endoftext|>"}
    files = {
        "tokenizer.json": data,
        "tokenizer_config.json": json_text(config) + "\n",
        "special_tokens_map.json": json_text(special) + "\n",
    }
    for name, text in files.items():
        target = folder / name
        if not target.is_file() or target.read_text(encoding="utf-8") != text:
            _write_atomic(target, text)
    return folder


# ----------------------------------------------------------------- the object

LONG_TEXT_CHARS = 64_000
"""Texts this long are encoded with the GIL released (:meth:`Tokenizer.encode`).

Below it the GIL is held for a few milliseconds at most, and plain ``encode``
saves the batch call's overhead on the short prompts of the hot path."""


class Tokenizer:
    """A loaded tokenizer: encode, decode and the chat template.

    Thread safe (the underlying Rust tokenizer is); share one per process via
    :func:`load_tokenizer`.

    Attributes:
        path: The JSON file it was loaded from.
        revision: First 16 hex digits of the file's SHA-256: put it in a
            :class:`~prefixrouter.core.types.CacheNamespace` so a tokenizer
            change never reuses stale routing state.
    """

    __slots__ = ("_tok", "eos_token_id", "path", "revision", "template")

    def __init__(self, path: Path, template: ModelChatTemplate | None = None) -> None:
        """Load ``path``.

        Raises:
            OSError: The file cannot be read.
            ConfigError: It is not a ``tokenizers`` JSON file.
        """
        data = path.read_bytes()
        self.path = path
        self.template = template
        """The model's own chat template (None: the project's ChatML, :func:`render_chat`)."""
        digest = hashlib.sha256(data)
        if template is not None:
            digest.update(template.source.encode("utf-8"))
        self.revision = digest.hexdigest()[:16]
        try:
            self._tok = _HfTokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # the Rust side raises plain Exception; UnicodeDecodeError too
            raise ConfigError(f"{path}: not a tokenizers file ({exc})") from None
        eos = self._tok.token_to_id(IM_END)
        self.eos_token_id: int = eos if eos is not None else 0

    @property
    def vocab_size(self) -> int:
        """Entries in the vocabulary, special tokens included."""
        return int(self._tok.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens in the text become their ids).

        A text of :data:`LONG_TEXT_CHARS` or more is encoded with the GIL
        released, so a caller that runs this on a worker thread leaves its
        event loop free meanwhile (a 3 MB prompt takes seconds).
        """
        if len(text) < LONG_TEXT_CHARS:
            return list(self._tok.encode(text, add_special_tokens=False).ids)
        # tokenizers holds the GIL for all of encode() but releases it in
        # encode_batch(): the same ids, and other threads run meanwhile.
        return list(self._tok.encode_batch([text], add_special_tokens=False)[0].ids)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a completions prompt: as vLLM, with the tokenizer's own
        special tokens added (a BOS for models whose post-processor adds one)."""
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``."""
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry, None if absent."""
        tid = self._tok.token_to_id(token)
        return None if tid is None else int(tid)

    def id_to_token(self, tid: int) -> str | None:
        """Vocabulary entry of an id (byte-level form), None if out of range."""
        tok = self._tok.id_to_token(tid)
        return None if tok is None else str(tok)

    @property
    def renders_chatml(self) -> bool:
        """Its chat template is the project's ChatML (:func:`render_chat`)."""
        return self.template is None

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        documents: Sequence[Any] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text of chat messages: the model's template, else :func:`render_chat`.

        The keywords are a chat request's fields of those names
        (``variables``: its ``chat_template_kwargs``), as
        :meth:`ModelChatTemplate.render` takes them. A template the request
        brings is not compiled here
        (:attr:`~prefixrouter.prompt.request.TemplateOptions.request_template_key`).
        """
        template = self.template
        if template is not None:
            return template.render(
                messages,
                tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                documents=documents,
                variables=variables,
            )
        # ChatML takes no variables nor documents (its Jinja twin reads none).
        text = render_chat(messages, tools, add_generation_prompt=add_generation_prompt)
        if continue_final_message:
            text = continue_final(text, content_text(messages[-1].get("content")))
        return text

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of the rendered chat (template, then :meth:`encode`)."""
        return self.encode(
            self.apply_chat_template(messages, tools, add_generation_prompt=add_generation_prompt)
        )


_loaded: dict[Path, Tokenizer] = {}
_lock = threading.Lock()


def load_tokenizer(path: str | os.PathLike[str] | None = None) -> Tokenizer:
    """Load a tokenizer, once per process and path.

    Args:
        path: A tokenizer JSON file, or a folder holding ``tokenizer.json``;
            default: the project's own tokenizer (built and cached on first use).

    Returns:
        The shared :class:`Tokenizer` for that file.

    Raises:
        OSError: The file cannot be read.
        ConfigError: It is not a ``tokenizers`` JSON file.
    """
    if path is None:
        file = tokenizer_path()
    else:
        file = Path(path).expanduser()
        if file.is_dir():
            file = file / "tokenizer.json"
    file = file.resolve()
    with _lock:
        tok = _loaded.get(file)
        if tok is None:
            tok = _loaded[file] = Tokenizer(file, _model_template(file.parent))
        return tok


def _model_template(folder: Path) -> ModelChatTemplate | None:
    """The folder's chat template if it is not the project's own ChatML."""
    template = find_chat_template(folder)
    if template is None or template.source == CHAT_TEMPLATE_JINJA:
        return None  # ours: render_chat is the same text, and faster
    return template
