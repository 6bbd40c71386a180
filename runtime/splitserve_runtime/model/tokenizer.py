"""Text <-> token ids for a model directory, chat templates, and streaming detokenization.

Wraps ``tokenizers.Tokenizer`` (``tokenizer.json``) directly instead of ``transformers``,
so the server and the router stay light and torch-free. Chat templates are rendered the way
``transformers`` renders them (sandboxed Jinja with ``trim_blocks``/``lstrip_blocks``, the
``loopcontrols`` extension, a non-escaping ``tojson``, ``raise_exception``,
``strftime_now``, a no-op ``{% generation %}`` tag, and the special tokens as variables), so
a prompt renders identically here and in HF. The rendered prompt already holds its BOS
text; encode it with ``add_special_tokens=False``.

:class:`IncrementalDetokenizer` turns a token stream into text deltas without ever emitting
half of a multi-byte character: it decodes a short window of recent tokens and only emits
once the window decodes without a trailing U+FFFD, so concatenated deltas equal the full
decode.

Two things serve the HTTP server's promise that one large prompt never stalls the others
(nor ``/health``, whose stall makes a liveness probe restart the pod): :meth:`Tokenizer.encode` goes through ``encode_batch_fast``, which releases the GIL
while the Rust tokenizer works (plain ``encode`` holds it, about 1 s per MB of text), so
encoding on a worker thread leaves the event loop running; and :attr:`Tokenizer.max_chars_per_token` bounds
how much text one token can cover, so a prompt that cannot fit the context is refused from its
length alone, before any tokenizing (:func:`max_chars_per_token` says when that bound is sound).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers

from splitserve_contract.model_config import read_json_object

from .errors import ModelLoadError, parser_message

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_REPLACEMENT_CHAR = "\ufffd"
_GROWING_NORMALIZERS = frozenset({"Lowercase", "NFD", "NFKD", "Prepend"})
"""Normalizers whose output is never shorter than their input (each character maps to one or
more); NFC/NFKC (composition), Strip, Replace, BertNormalizer and Precompiled can shrink it."""
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Split", "Digits", "Punctuation"})
"""Pre-tokenizers that only cut the text (none drops a character, unless told to remove the
pieces it matched); Whitespace, WhitespaceSplit and BertPreTokenizer drop the whitespace."""


class ChatTemplateError(ValueError):
    """The chat template is missing, does not compile, or rejected the messages."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile ``source`` in the same sandbox and with the same helpers as HF."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def _token_text(value: Any) -> str | None:
    """Special tokens are stored as strings or as AddedToken dicts ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def max_chars_per_token(tokenizer: HFTokenizer) -> int | None:
    """The most input characters one token of ``tokenizer`` can cover, or None when that cannot
    be proven from its definition (then no prompt is refused by its length alone).

    The bound is sound for byte-level BPE (the Llama 3, Qwen2 and GPT-2 families): every byte
    of the normalized text lies in exactly one token (the vocabulary holds all 256 byte
    symbols, so nothing is dropped or unknown), a vocabulary token spells one byte per
    character, so it covers at most ``len(token)`` bytes, hence at most that many characters;
    an added or special token covers its own content. With a normalizer that never shortens
    the text and pre-tokenizers that drop nothing, ``num_tokens * bound >= len(text)``.
    """
    spec = json.loads(tokenizer.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None
    if not _keeps_every_character(spec.get("pre_tokenizer")) or not _never_shortens(spec.get("normalizer")):
        return None
    if any(tokenizer.token_to_id(symbol) is None for symbol in pre_tokenizers.ByteLevel.alphabet()):
        return None  # a byte without a token would be dropped
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max((len(token) for token in vocab), default=0) or None


def _components(spec: Any, *, key: str) -> list[dict[str, Any]]:
    if not isinstance(spec, dict):
        return []
    if spec.get("type") == "Sequence":
        parts = spec.get(key)
        return [p for p in parts if isinstance(p, dict)] if isinstance(parts, list) else [spec]
    return [spec]


def _keeps_every_character(spec: Any) -> bool:
    """A byte-level pre-tokenizer (possibly after splitting) that removes nothing."""
    parts = _components(spec, key="pretokenizers")
    if not any(p.get("type") == "ByteLevel" for p in parts):
        return False
    return all(p.get("type") in _KEEPING_PRE_TOKENIZERS and p.get("behavior") != "Removed" for p in parts)


def _never_shortens(spec: Any) -> bool:
    if spec is None:
        return True
    if not isinstance(spec, dict):
        return False
    return all(p.get("type") in _GROWING_NORMALIZERS for p in _components(spec, key="normalizers"))


def _ids(value: Any) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


class Tokenizer:
    """A model directory's tokenizer, special tokens and chat template."""

    def __init__(
        self,
        *,
        tokenizer: HFTokenizer,
        special_tokens: Mapping[str, str],
        eos_token_ids: Sequence[int],
        chat_template: str | None,
    ) -> None:
        self._tok = tokenizer
        self.special_tokens = dict(special_tokens)
        bos = special_tokens.get("bos_token")
        self.bos_token_id: int | None = None if bos is None else tokenizer.token_to_id(bos)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template
        self._compiled: jinja2.Template | None = None
        self._special_ids = frozenset(
            token_id for token_id, added in tokenizer.get_added_tokens_decoder().items() if added.special
        )
        self._encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        self.max_chars_per_token: int | None = max_chars_per_token(tokenizer)
        """See :func:`max_chars_per_token`: ``len(text) / max_chars_per_token`` tokens at least."""

    @classmethod
    def from_dir(cls, *, model_dir: Path) -> Tokenizer:
        """Load ``tokenizer.json`` and friends; EOS ids are the union of ``config.json``,
        ``generation_config.json`` and the tokenizer's ``eos_token``."""
        path = model_dir / TOKENIZER_FILE
        if not path.is_file():
            raise ModelLoadError(f"missing {TOKENIZER_FILE} in {model_dir}")
        try:
            tokenizer = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on parse errors
            raise ModelLoadError(f"cannot load {path}: {parser_message(exc)}") from exc
        tok_config = read_json_object(model_dir / TOKENIZER_CONFIG_FILE, required=False)
        special: dict[str, str] = {}
        for key in _SPECIAL_TOKEN_KEYS:
            text = _token_text(tok_config.get(key))
            if text is not None:
                # BOS/EOS must be real tokens; pad/unk texts are only template variables.
                if key in ("bos_token", "eos_token") and tokenizer.token_to_id(text) is None:
                    shown = text if len(text) <= 48 else text[:48] + "..."
                    raise ModelLoadError(f"{TOKENIZER_CONFIG_FILE}: {key} {shown!r} is not in {TOKENIZER_FILE}")
                special[key] = text
        eos: list[int] = []
        for name in ("config.json", "generation_config.json"):
            eos += _ids(read_json_object(model_dir / name, required=False).get("eos_token_id"))
        eos_token_id = tokenizer.token_to_id(special["eos_token"]) if "eos_token" in special else None
        if eos_token_id is not None:
            eos.append(eos_token_id)
        template_path = model_dir / CHAT_TEMPLATE_FILE
        template = tok_config.get("chat_template")
        if template_path.is_file():
            template = template_path.read_text(encoding="utf-8")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return cls(
            tokenizer=tokenizer,
            special_tokens=special,
            eos_token_ids=eos,
            chat_template=template if isinstance(template, str) else None,
        )

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the post-processor (BOS)."""
        return list(self._encoding(text, add_special_tokens=add_special_tokens).ids)

    def encode_bounded(
        self, text: str, *, add_special_tokens: bool = True, max_tokens: int | None = None
    ) -> tuple[int, list[int] | None]:
        """``(number of tokens, token ids)``, the ids None when there are more than
        ``max_tokens``: an oversized prompt costs no Python list of millions of ints."""
        encoding = self._encoding(text, add_special_tokens=add_special_tokens)
        num_tokens = len(encoding)
        if max_tokens is not None and num_tokens > max_tokens:
            return num_tokens, None
        return num_tokens, list(encoding.ids)

    def _encoding(self, text: str, *, add_special_tokens: bool) -> Any:
        """``encode_batch_fast`` (else ``encode_batch``) of one text gives the ids of
        ``encode`` but releases the GIL while it works, so other threads (the server's event
        loop) keep running; the fast variant also skips the character offsets, which cost 3x
        the time and a GIL-holding free of 0.2 s per 4 MB of text."""
        [encoding] = self._encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        found = self._tok.token_to_id(token)
        return None if found is None else int(found)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}]``) to the prompt text."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template (tokenizer_config.json)")
        if self._compiled is None:
            self._compiled = compile_chat_template(self.chat_template)
        context: dict[str, Any] = {**self.special_tokens, **template_kwargs}
        context["messages"] = [dict(m) for m in messages]
        context["add_generation_prompt"] = add_generation_prompt
        if tools is not None:
            context["tools"] = [dict(t) for t in tools]
        try:
            return self._compiled.render(**context)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template rejected the messages: {exc}") from exc


class IncrementalDetokenizer:
    """Streaming token -> text deltas that never split a UTF-8 character (see module doc).

    ``context_token_ids`` (e.g. the prompt's last tokens) only seed the decode window so
    tokenizers that drop a leading space at the start of a decode stay correct.
    """

    _CONTEXT_TOKENS = 5

    def __init__(
        self,
        *,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        context_token_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._tokens: list[int] = list(context_token_ids)[-self._CONTEXT_TOKENS :]
        if self._decode(self._tokens).endswith(_REPLACEMENT_CHAR):
            self._tokens = []  # a context cut inside a character would corrupt the first delta
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self.text = ""
        """All text emitted so far."""

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special)

    def step(self, token_id: int) -> str:
        """Add one token; return the newly complete text (possibly empty)."""
        self._tokens.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Return whatever is still held back (an incomplete character decodes as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) and not final:
            return ""
        if new_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        # Tokens before the window are never decoded again.
        drop = self._prefix_offset
        self._tokens = self._tokens[drop:]
        self._prefix_offset = 0
        self._read_offset -= drop
        self.text += delta
        return delta
