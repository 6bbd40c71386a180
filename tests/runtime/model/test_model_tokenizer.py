"""Tokenizer, chat template and streaming detokenizer vs Hugging Face ``transformers``."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from splitserve_runtime.model.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "Grüße, café 🙂"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "What is 2 + 2?"},
    ],
]
TEXTS = ["Hello world", "Grüße aus München! 日本語 🚀🌍 ✨", "  leading spaces and\nnewlines\t"]


@pytest.fixture(params=["tiny_llama_dir", "tiny_qwen2_dir"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return Path(request.getfixturevalue(request.param))


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_chat_template_matches_hf(model_dir: Path, conversation: int, add_generation_prompt: bool) -> None:
    messages = CONVERSATIONS[conversation]
    hf = AutoTokenizer.from_pretrained(model_dir)
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ours = Tokenizer.from_dir(model_dir=model_dir)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_encode_decode_match_hf(model_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(model_dir)
    ours = Tokenizer.from_dir(model_dir=model_dir)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"]
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True) == text


def test_bos_and_eos(tiny_llama_dir: Path, tiny_qwen2_dir: Path) -> None:
    llama = Tokenizer.from_dir(model_dir=tiny_llama_dir)
    assert llama.bos_token_id == llama.token_to_id("<|begin_of_text|>")
    assert llama.encode("hi")[0] == llama.bos_token_id
    assert llama.encode("hi", add_special_tokens=False)[0] != llama.bos_token_id
    assert set(llama.eos_token_ids) == {llama.token_to_id("<|end_of_text|>"), llama.token_to_id("<|eot_id|>")}
    assert llama.is_special(llama.token_to_id("<|eot_id|>") or -1)
    # The rendered prompt carries BOS as text: encoding it without special tokens has one BOS.
    prompt = llama.apply_chat_template(CONVERSATIONS[0])
    assert llama.encode(prompt, add_special_tokens=False).count(llama.bos_token_id) == 1
    qwen = Tokenizer.from_dir(model_dir=tiny_qwen2_dir)
    assert qwen.bos_token_id is None and qwen.encode("hi") == qwen.encode("hi", add_special_tokens=False)
    assert set(qwen.eos_token_ids) == {qwen.token_to_id("<|im_end|>"), qwen.token_to_id("<|endoftext|>")}


def test_template_raise_exception_is_a_clear_error(tiny_llama_dir: Path) -> None:
    tok = Tokenizer.from_dir(model_dir=tiny_llama_dir)
    with pytest.raises(ChatTemplateError, match="Unsupported role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_sandbox_blocks_attribute_escape(tiny_llama_dir: Path) -> None:
    tok = Tokenizer.from_dir(model_dir=tiny_llama_dir)
    tok.chat_template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_detokenizer_equals_full_decode(model_dir: Path, skip_special_tokens: bool) -> None:
    tok = Tokenizer.from_dir(model_dir=model_dir)
    text = "Grüße 🙂 日本語! " + tok.apply_chat_template(CONVERSATIONS[1]) + "🚀✨ done"
    ids = tok.encode(text, add_special_tokens=False)
    # The test must exercise split characters: some single tokens decode to U+FFFD alone.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tokenizer=tok, skip_special_tokens=skip_special_tokens)
    deltas = [detok.step(i) for i in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_incremental_detokenizer_flushes_incomplete_character(tiny_llama_dir: Path) -> None:
    tok = Tokenizer.from_dir(model_dir=tiny_llama_dir)
    ids = tok.encode("ok 🙂", add_special_tokens=False)
    partial = ids[:-1]  # the emoji's last byte is missing
    detok = IncrementalDetokenizer(tokenizer=tok, context_token_ids=tok.encode("prompt"))
    streamed = "".join(detok.step(i) for i in partial)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == tok.decode(partial)


def test_incremental_detokenizer_ignores_context_cut_inside_a_character(tiny_llama_dir: Path) -> None:
    tok = Tokenizer.from_dir(model_dir=tiny_llama_dir)
    ids = tok.encode("🙂🙂 ok", add_special_tokens=False)
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer=tok, context_token_ids=ids[:cut])
    streamed = "".join(detok.step(i) for i in ids[cut:]) + detok.flush()
    assert streamed == tok.decode(ids[cut:])
