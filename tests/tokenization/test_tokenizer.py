"""The built-in tokenizer: deterministic build, safe cache, ChatML rendering."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from prefixrouter.tokenization import (
    LONG_TEXT_CHARS,
    SPECIAL_TOKENS,
    TOKENIZER_VERSION,
    VOCAB_SIZE,
    ChatTemplateError,
    hf_tokenizer_dir,
    load_tokenizer,
    render_chat,
    tokenizer_path,
)


def test_build_is_deterministic_byte_for_byte(tmp_path: Path) -> None:
    a = tokenizer_path(tmp_path / "a")
    b = tokenizer_path(tmp_path / "b")
    assert a.name == b.name == f"tokenizer-{TOKENIZER_VERSION}.json"
    assert a.read_bytes() == b.read_bytes()
    # No temporary files are left behind by the atomic write.
    assert [p.name for p in (tmp_path / "a").iterdir()] == [a.name]


def test_cache_is_reused_and_repaired(tmp_path: Path) -> None:
    path = tokenizer_path(tmp_path)
    stamp = path.stat().st_mtime_ns
    assert tokenizer_path(tmp_path).stat().st_mtime_ns == stamp  # not rebuilt
    good = path.read_bytes()
    path.write_text("{not a tokenizer")
    assert tokenizer_path(tmp_path).read_bytes() == good  # rebuilt, same bytes


def test_default_location_honours_env(tokenizer_cache: str) -> None:
    tok = load_tokenizer()
    assert tok.path.parent == Path(tokenizer_cache).resolve()
    assert load_tokenizer() is tok  # one per process and path
    assert load_tokenizer(tok.path.parent / tok.path.name) is tok


def test_vocab_special_tokens_and_round_trip() -> None:
    tok = load_tokenizer()
    assert tok.vocab_size == VOCAB_SIZE
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    text = "def main():\n    return 'héllo wörld' 🎉  # comment\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text)  # merges happen: it is a real BPE
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert ids[0] == 1 and 2 in ids  # special tokens are single ids
    assert len(tok.revision) == 16


def test_render_chat_plain_messages() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert render_chat(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render_chat(messages, add_generation_prompt=False).endswith("Hi!<|im_end|>\n")
    tok = load_tokenizer()
    assert tok.apply_chat_template(messages) == render_chat(messages)
    assert tok.encode_chat(messages) == tok.encode(render_chat(messages))


def test_render_chat_parts_tool_calls_and_tools() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
    out = render_chat(messages, tools)
    assert out == (
        "<|im_start|>system\n# Tools\n\n<tools>\n"
        '{"function": {"name": "f", "parameters": {"a": 2, "b": 1}}, "type": "function"}\n'
        "</tools><|im_end|>\n"
        "<|im_start|>user\na\nb<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>tool\n42<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # Tools join an existing system message; rendering is pure (same input, same text).
    with_system = [{"role": "system", "content": "S"}, *messages]
    assert render_chat(with_system, tools).startswith("<|im_start|>system\nS\n\n# Tools\n")
    assert render_chat(with_system, tools) == render_chat(with_system, tools)


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([], "messages"),
        ("hi", "messages"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0].type"),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
        (
            [{"role": "assistant", "tool_calls": [{"function": {}}]}],
            "messages[0].tool_calls[0].function.name",
        ),
    ],
)
def test_render_chat_errors_name_the_field(messages: object, field: str) -> None:
    with pytest.raises(ChatTemplateError) as info:
        render_chat(messages)  # type: ignore[arg-type]
    assert str(info.value).startswith(field + ":")


def test_hf_folder_for_peer_routers(tokenizer_cache: str) -> None:
    folder = hf_tokenizer_dir()
    assert folder.parent == Path(tokenizer_cache)
    assert (folder / "tokenizer.json").read_bytes() == tokenizer_path().read_bytes()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"] and config["eos_token"] == "<|im_end|>"
    assert sorted(os.listdir(folder)) == [
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    assert load_tokenizer(folder).path == (folder / "tokenizer.json").resolve()


def test_a_long_text_encodes_to_the_same_ids_with_the_gil_released() -> None:
    tok = load_tokenizer()
    piece = "The <|im_start|>cache holds 12,345 blocks; café naïve — ok.\n"
    text = piece * (LONG_TEXT_CHARS // len(piece) + 2)
    assert len(text) >= LONG_TEXT_CHARS
    # The long path (encode_batch) against the short one, piece by piece: the pieces
    # end in a newline, which no token crosses here.
    assert tok.encode(text) == tok.encode(piece) * (LONG_TEXT_CHARS // len(piece) + 2)
