"""Tokenizer, special tokens and chat template of a Hugging Face model directory."""

from __future__ import annotations

import json
import re
import secrets
from datetime import datetime
from pathlib import Path
from typing import Any

from .config import read_json, regular_file
from .errors import MoerunError, one_line


def _token_text(tok, name: str, path: Path) -> str | None:
    """A tokenizer_config token: a string, {"content": string}, or null."""
    if isinstance(tok, dict):
        tok = tok.get("content")
    if tok is not None and not isinstance(tok, str):
        raise MoerunError(f"{path}'s {name} must be a string, not {tok!r:.40}")
    return tok


class Tokenizer:
    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise MoerunError(f"{model_dir} has no tokenizer.json")
        try:
            self.tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises plain Exceptions
            raise MoerunError(f"{path} could not be read: {e}") from None
        cfg_path = Path(model_dir) / "tokenizer_config.json"
        cfg = read_json(cfg_path) if regular_file(cfg_path) else {}
        if not isinstance(cfg, dict):
            raise MoerunError(f"{cfg_path} must hold a JSON object")
        template = cfg.get("chat_template")
        jinja_file = Path(model_dir) / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        self._setup(_pick_template(template, cfg_path), _token_text(cfg.get("bos_token"), "bos_token", cfg_path),
                    _token_text(cfg.get("eos_token"), "eos_token", cfg_path), bool(cfg.get("add_bos_token", False)))

    @classmethod
    def from_parts(cls, tok, chat_template: str | None, bos: str | None, eos: str | None, add_bos: bool) -> "Tokenizer":
        """A Tokenizer around a built `tokenizers.Tokenizer` (a GGUF file's, loaders/gguf.py)."""
        self = cls.__new__(cls)
        self.tok = tok
        self._setup(chat_template, bos, eos, add_bos)
        return self

    def _setup(self, chat_template: str | None, bos: str | None, eos: str | None, add_bos: bool) -> None:
        self.chat_template: str | None = chat_template
        self.bos_token, self.eos_token, self.add_bos = bos, eos, add_bos
        self._template = None
        if self.chat_template:
            self._compile()  # a template that is not valid Jinja is said at load, not at the first chat
        self._plain = None  # `plain`, made when first needed
        self.special_texts = sorted(t.content for t in self.tok.get_added_tokens_decoder().values() if t.special)

    @property
    def plain(self):
        """The same tokenizer with its special tokens' texts read as plain text: what a chat
        message's content that holds one is encoded with (`encode_chat`)."""
        if self._plain is None:
            from tokenizers import Tokenizer as HFTokenizer

            plain = HFTokenizer.from_str(self.tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.tok.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text` as token ids; special tokens' texts in it become those tokens (a raw prompt
        is the caller's own; chat messages go through `encode_chat`)."""
        ids = _ids(self.tok, text, add_special_tokens)
        bos = self.token_id(self.bos_token)
        if add_special_tokens and self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """The chat template's rendering of `messages` as token ids, where only the template's
        own text can make special tokens: a user who types `<|im_end|>` gets those characters,
        never the marker (no forged turns).

        Contents that could make one (they hold a special token's text, or begin or end with
        part of one) are rendered as unique placeholders; the rendering is cut there, the
        template's pieces are encoded with special tokens and those contents as plain text.
        That must join up to the real rendering: a template that trims or edits such a content
        cannot be encoded safely, and the messages are refused. The text between two of the
        template's special tokens is encoded as one text, contents included (`_encode_joined`).
        Other contents are rendered and encoded as they are."""
        self._check_messages(messages)
        nonce = secrets.token_hex(8)
        marks, shown = {}, []
        for i, m in enumerate(messages):
            c = m["content"]
            if isinstance(c, str) and self._could_make_special(c):
                mark = f"MOERUNCONTENT{i}X{nonce}"
                marks[mark] = c
                m = {**m, "content": mark}
            shown.append(m)
        real = self.apply_chat_template(messages, add_generation_prompt)
        if not marks:
            return _ids(self.tok, real, False)
        pieces = re.split(f"(MOERUNCONTENT\\d+X{nonce})", self.apply_chat_template(shown, add_generation_prompt))
        texts = [(marks.get(p, p), p not in marks) for p in pieces if p]
        if sorted(pieces[1::2]) != sorted(marks) or "".join(t for t, _ in texts) != real:
            raise MoerunError("a message's content holds a special token's text, and this model's chat template "
                              "edits that content, so it cannot be encoded as plain text")
        return _encode_joined(self, texts)

    def _could_make_special(self, text: str) -> bool:
        """Whether `text` holds a special token's text, or could complete one with the text
        around it (it starts with the end of one, or ends with the start of one)."""
        for t in self.special_texts:
            if t in text or any(text.endswith(t[:k]) or text.startswith(t[-k:]) for k in range(1, len(t))):
                return True
        return False

    def _check_messages(self, messages) -> None:
        if not isinstance(messages, list):
            raise MoerunError("chat messages must be a list")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise MoerunError("each chat message must be a dict with 'role' and 'content'")
            for k, v in m.items():  # what the template prints besides contents (roles, names)
                if k != "content" and isinstance(v, str) and any(t in v for t in self.special_texts):
                    raise MoerunError(f"a chat message's {k} holds a special token's text")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise MoerunError("this model's tokenizer has no chat template")
        self._check_messages(messages)
        try:
            return self._compile().render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except Exception as e:  # noqa: BLE001 - raise_exception(), or the template's own failure
            raise MoerunError(f"the chat template rejected the messages: {one_line(e)}") from None

    def _compile(self):
        """The chat template, compiled once in a sandbox (a model's template is its author's code)."""
        if self._template is None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(self.chat_template)
            except TemplateError as e:
                raise MoerunError(f"this model's chat template is not valid Jinja: {one_line(e)}") from None
        return self._template


def _pick_template(template, path: Path) -> str | None:
    """A tokenizer_config's chat_template: a string, or a list of named ones (the default)."""
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list) and template and all(
            isinstance(t, dict) and isinstance(t.get("template"), str) for t in template):
        return next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    raise MoerunError(f"{path}'s chat_template must be a string or a list of {{name, template}} objects")


def _ids(tok, text: str, add_special_tokens: bool) -> list[int]:
    # encode_batch lets go of the GIL while it works (encode holds it): a long prompt
    # tokenized on a server's worker thread must not stall the event loop's streams
    return tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def _encode_joined(t: Tokenizer, texts: list[tuple[str, bool]]) -> list[int]:
    """The (text, is_template) pieces of a rendering as token ids: special tokens only where a
    template piece holds one, and the text between two of them encoded as one text (plainly),
    across the cuts between template and content pieces, as the whole rendering would be. A
    tokenizer whose encoding depends on where a text starts (SentencePiece's space prefix,
    the merges at a cut) then encodes a message the same whether it was cut out or not."""
    special = {i for i, a in t.tok.get_added_tokens_decoder().items() if a.special}
    templates = iter(t.tok.encode_batch([x for x, is_template in texts if is_template], add_special_tokens=False))
    runs: list[list[str]] = [[]]  # runs[k]: the text before marks[k]
    marks: list[int] = []
    for text, is_template in texts:
        if not is_template:
            runs[-1].append(text)
            continue
        pos, enc = 0, next(templates)
        for i, (start, end) in zip(enc.ids, enc.offsets):
            if i in special:
                runs[-1].append(text[pos:start])
                marks.append(i)
                runs.append([])
                pos = end
        runs[-1].append(text[pos:])
    raw = ["".join(r) for r in runs]
    todo = [k for k, r in enumerate(raw) if r]
    done = dict(zip(todo, (e.ids for e in t.plain.encode_batch([raw[k] for k in todo], add_special_tokens=False))))
    out: list[int] = []
    for k in range(len(raw)):
        out += done.get(k, [])
        out += marks[k : k + 1]
    return out


class IncrementalDecoder:
    """Turns a growing list of token ids into text pieces, never splitting a UTF-8 character.

    Keeps a short window of ids before the unread ones so that tokenizers whose decoding
    depends on the previous token (byte-level BPE, SentencePiece spaces) stay exact.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None):
        self.tok = tokenizer
        self.ids: list[int] = list(prompt_ids[-4:]) if prompt_ids else []
        self.prefix = 0
        self.read = len(self.ids)

    def push(self, token: int) -> str:
        self.ids.append(token)
        prefix_text = self.tok.decode(self.ids[self.prefix : self.read])
        text = self.tok.decode(self.ids[self.prefix :])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            piece = text[len(prefix_text) :]
            self.prefix, self.read = self.read, len(self.ids)
            return piece
        return ""
