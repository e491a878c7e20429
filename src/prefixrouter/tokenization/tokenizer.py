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
* **Chat template**: ChatML, rendered by :func:`render_chat`, a pure function
  (no Jinja) that the gateway reuses for token-mode routing::

      <|im_start|>{role}\\n{content}<|im_end|>\\n ... <|im_start|>assistant\\n

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
import json
import os
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as _HfTokenizer

if TYPE_CHECKING:
    from prefixrouter.chat_template import ModelChatTemplate
from tokenizers import decoders, models, pre_tokenizers, trainers

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
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
IM_START, IM_END = "<|im_start|>", "<|im_end|>"

CHAT_TEMPLATE_JINJA = (
    # Roles are rendered as given; naming 'developer' here keeps vLLM from
    # rewriting developer messages to system ones (and merging them).
    "{#- ChatML; roles (system, user, assistant, tool, 'developer') as given -#}"
    "{%- macro obj(d) -%}{{ '{' }}"
    "{%- for k, v in d|dictsort(true) if v is not none -%}"
    "{{ (', ' if not loop.first else '') ~ k|tojson ~ ': ' }}"
    "{{ obj(v) if k == 'function' and v is mapping else v|tojson(sort_keys=true) }}"
    "{%- endfor -%}{{ '}' }}{%- endmacro -%}"
    "{%- set ns = namespace(section='', text='') -%}"
    "{%- if tools -%}"
    "{%- for tool in tools -%}"
    "{%- set ns.section = ns.section ~ ('\\n' if not loop.first else '') ~ obj(tool) -%}"
    "{%- endfor -%}"
    "{%- set ns.section = '# Tools\\n\\n<tools>\\n' ~ ns.section ~ '\\n</tools>' -%}"
    "{%- if messages[0]['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\n' ~ ns.section ~ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set ns.text = message['content'] or '' -%}"
    "{%- if message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set ns.text = (ns.text ~ '\\n' if ns.text else '') ~ '<tool_call>\\n{\"name\": '"
    " ~ call['function']['name']|tojson ~ ', \"arguments\": '"
    " ~ (call['function']['arguments'] or {})|tojson ~ '}\\n</tool_call>' -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- if loop.first and tools and message['role'] == 'system' -%}"
    "{%- set ns.text = ns.text ~ '\\n\\n' ~ ns.section if ns.text else ns.section -%}"
    "{%- endif -%}"
    "{{ '<|im_start|>' ~ message['role'] ~ '\\n' ~ ns.text ~ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
"""The same rendering as :func:`render_chat`, as Jinja (for ``tokenizer_config.json``).

Checked against vLLM 0.32 (``scripts/probe_vllm.py``): vLLM joins text parts,
turns tool-call ``arguments`` into objects and dumps tools with every field
(absent ones as null) before rendering, so the template writes arguments with
``tojson`` and drops null tool fields, as :func:`render_chat` does. It relies
on the ``tojson`` filter of transformers (``sort_keys``, no HTML escaping).
"""


class ChatTemplateError(ValueError):
    """Malformed chat messages or tools; the message names the field (``messages[2].role``)."""


# ----------------------------------------------------------------- chat template


def _json(value: Any) -> str:
    """Canonical JSON: sorted keys, no ASCII escaping (the same text on every run)."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(", ", ": "))


def _content_text(content: Any, where: str) -> str:
    """A message's text as vLLM gives it to a template that takes strings."""
    if isinstance(content, str):
        return content
    # vLLM joins the text parts of one message with a newline for string templates.
    return "\n".join(_content_texts(content, where))


def _content_texts(content: Any, where: str) -> list[str]:
    """The text parts of a message's content (null: none; a string: one)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise ChatTemplateError(f"{where}: must be a string, a list of content parts or null")
    texts: list[str] = []
    for i, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, Mapping):
            raise ChatTemplateError(f"{where}[{i}]: a content part must be an object")
        kind = part.get("type", "text")
        if kind not in ("text", "input_text"):
            raise ChatTemplateError(
                f"{where}[{i}].type: unsupported content part {kind!r} (this model is text only)"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatTemplateError(f"{where}[{i}].text: must be a string")
        texts.append(text)
    return texts


def _tool_call_function(call: Any, where: str) -> Mapping[str, Any]:
    """A tool call's ``function`` (checked: an object with a string ``name``)."""
    if not isinstance(call, Mapping):
        raise ChatTemplateError(f"{where}: a tool call must be an object")
    fn = call.get("function")
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ChatTemplateError(f"{where}.function.name: must be a string")
    return fn


def _tool_call_arguments(fn: Mapping[str, Any]) -> Mapping[str, Any]:
    """A tool call's ``arguments`` as vLLM hands them to the template.

    OpenAI's JSON text is parsed to an object (keys in their order); anything
    that is not an object (empty, malformed, a list, a number) becomes ``{}``.
    """
    args = fn.get("arguments")
    if isinstance(args, str) and args:
        try:
            args = json.loads(args)
        except ValueError:
            args = {}
    return args if isinstance(args, Mapping) else {}


def _tool_call_text(call: Any, where: str) -> str:
    fn = _tool_call_function(call, where)
    args_text = json.dumps(_tool_call_arguments(fn), ensure_ascii=False)
    return f'<tool_call>\n{{"name": {_json(fn["name"])}, "arguments": {args_text}}}\n</tool_call>'


def _tools_text(tools: Sequence[Any]) -> str:
    lines = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ChatTemplateError(f"tools[{i}]: must be an object")
        # Null fields are dropped (vLLM sends every field, absent ones as null).
        tool = {k: v for k, v in tool.items() if v is not None}
        fn = tool.get("function")
        if isinstance(fn, Mapping):
            tool["function"] = {k: v for k, v in fn.items() if v is not None}
        lines.append(_json(tool))
    return "# Tools\n\n<tools>\n" + "\n".join(lines) + "\n</tools>"


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> str:
    """Render OpenAI chat messages to the prompt text the model sees (ChatML).

    Pure and deterministic: the same messages give the same text, byte for byte.
    Rules:

    * each message is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``;
    * ``content`` may be a string, null, or a list of text parts (joined with
      ``\\n``, as vLLM does); other part types are rejected (text-only model);
    * an assistant message's ``tool_calls`` follow its content, one
      ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` each,
      separated by newlines; ``arguments`` (JSON text or an object) is written
      as JSON with its keys in their order, ``{}`` when it is not an object;
    * ``tools`` (when non-empty) are listed, one canonical JSON object a line
      (null fields of a tool and of its ``function`` left out), in
      a ``# Tools`` section appended to the first system message (a system
      message is inserted first if there is none);
    * ``add_generation_prompt`` appends ``<|im_start|>assistant\\n``.

    Args:
        messages: Chat messages (``role``, ``content``, optional ``tool_calls``).
        tools: OpenAI tool definitions, if any.
        add_generation_prompt: Open an assistant turn at the end.

    Returns:
        The prompt text, special tokens included as text.

    Raises:
        ChatTemplateError: If a message or tool is malformed (names the field).
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages: must be a list of message objects")
    if not messages:
        raise ChatTemplateError("messages: must not be empty")
    if tools is not None and (isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence)):
        raise ChatTemplateError("tools: must be a list of tool objects")
    turns: list[tuple[str, str]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ChatTemplateError(f"{where}: must be an object")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"{where}.role: must be a non-empty string")
        text = _content_text(msg.get("content"), f"{where}.content")
        calls = msg.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise ChatTemplateError(f"{where}.tool_calls: must be a list")
            rendered = [_tool_call_text(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
            text = "\n".join(([text] if text else []) + rendered)
        turns.append((role, text))
    if tools:
        section = _tools_text(tools)
        if turns[0][0] == "system":
            system = turns[0][1]
            turns[0] = ("system", f"{system}\n\n{section}" if system else section)
        else:
            turns.insert(0, ("system", section))
    out = [f"{IM_START}{role}\n{text}{IM_END}\n" for role, text in turns]
    if add_generation_prompt:
        out.append(f"{IM_START}assistant\n")
    return "".join(out)


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
        "tokenizer_config.json": _json(config) + "\n",
        "special_tokens_map.json": _json(special) + "\n",
    }
    for name, text in files.items():
        target = folder / name
        if not target.is_file() or target.read_text(encoding="utf-8") != text:
            _write_atomic(target, text)
    return folder


# ----------------------------------------------------------------- the object


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
        data = path.read_bytes()
        self.path = path
        self.template = template
        """The model's own chat template (None: the project's ChatML, :func:`render_chat`)."""
        digest = hashlib.sha256(data)
        if template is not None:
            digest.update(template.source.encode("utf-8"))
        self.revision = digest.hexdigest()[:16]
        self._tok = _HfTokenizer.from_str(data.decode("utf-8"))
        eos = self._tok.token_to_id(IM_END)
        self.eos_token_id: int = eos if eos is not None else 0

    @property
    def vocab_size(self) -> int:
        """Entries in the vocabulary, special tokens included."""
        return int(self._tok.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens in the text become their ids)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

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

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text of chat messages: the model's template, else :func:`render_chat`."""
        if self.template is not None:
            return self.template.render(
                messages, tools, add_generation_prompt=add_generation_prompt
            )
        return render_chat(messages, tools, add_generation_prompt=add_generation_prompt)

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
    from prefixrouter.chat_template import find_chat_template

    template = find_chat_template(folder)
    if template is None or template.source == CHAT_TEMPLATE_JINJA:
        return None  # ours: render_chat is the same text, and faster
    return template
