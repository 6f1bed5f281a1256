"""Text <-> token ids: a Hugging Face fast tokenizer (`tokenizers`), the model's chat template
rendered through jinja2 exactly as transformers renders it, and a UTF-8-safe streaming detokenizer.

Reads either an HF model directory or the strings stored in a .atomflow file's metadata.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import signal
import threading
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from atomflow.errors import ChatTemplateError, FormatError


def _token_text(v) -> str | None:
    """tokenizer_config tokens are a string or an AddedToken dict {"content": ...}."""
    return v.get("content") if isinstance(v, dict) else v


def _eos_list(v) -> list[int]:
    return [e for e in (v if isinstance(v, list) else [v]) if isinstance(e, int)]


class Tokenizer:
    """encode / decode / chat template for one model.

    tokenizer_config: bos_token, eos_token (strings or AddedToken dicts). BOS insertion is
    tokenizer.json's post-processor (Llama 3's TemplateProcessing); add_bos_token is ignored, as
    transformers 4.x and 5.x ignore it for Llama 3's PreTrainedTokenizerFast.
    generation_config: eos_token_id (int or list, HF) or eos_token_ids (list, .atomflow).
    """

    def __init__(self, tok: _HFTokenizer, tokenizer_config: dict, chat_template: str, generation_config: dict):
        self._tok = tok
        self.config = dict(tokenizer_config)
        self.chat_template = chat_template or ""
        self.generation_config = dict(generation_config)
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_token_id = self._id(self.bos_token)
        if self.bos_token_id is None and isinstance(self.generation_config.get("bos_token_id"), int):
            self.bos_token_id = self.generation_config["bos_token_id"]
        eos = _eos_list(self.generation_config.get("eos_token_ids", self.generation_config.get("eos_token_id")))
        if self._id(self.eos_token) is not None:
            eos.append(self._id(self.eos_token))
        self._eos = frozenset(eos)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path) -> Tokenizer:
        """tokenizer.json + tokenizer_config.json + optional chat_template.jinja (which wins over
        the config's chat_template, as in transformers) + optional generation_config.json."""
        path = Path(path)

        def read_json(name: str) -> dict:
            p = path / name
            return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}

        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json (a Hugging Face fast tokenizer is required)")
        config = read_json("tokenizer_config.json")
        template = config.get("chat_template") or ""
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), "")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(_HFTokenizer.from_file(str(path / "tokenizer.json")), config, template, read_json("generation_config.json"))

    @classmethod
    def from_metadata(cls, tokenizer_json: str, tokenizer_config: dict, chat_template: str, generation_config: dict) -> Tokenizer:
        """From a .atomflow file's metadata (tokenizer_config's chat_template key names the source
        file there; the template itself is the chat_template argument)."""
        config = {k: v for k, v in (tokenizer_config or {}).items() if k != "chat_template"}
        return cls(_HFTokenizer.from_str(tokenizer_json), config, chat_template or "", generation_config or {})

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    # -- properties -----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included (may be less than the model's vocab)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> set[int]:
        """Every id that ends generation: generation_config's EOS list plus the tokenizer's eos_token."""
        return set(self._eos)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template.strip())

    # -- text <-> ids ---------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """add_special_tokens: run the post-processor (Llama 3: prepend <|begin_of_text|>).
        Special-token strings in the text are matched either way, as in transformers."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Ids outside [0, vocab_size) (a random model's logits can pick them) decode to ""."""
        n = self.vocab_size
        return self._tok.decode([int(i) for i in ids if 0 <= int(i) < n], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render the chat template as transformers' apply_chat_template(tokenize=False) does:
        variables messages, tools (None), documents (None), add_generation_prompt, the special
        tokens (bos_token, eos_token, ...) and any extra kwargs (e.g. date_string)."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; encode the prompt raw (chat=False)")
        special = {
            k: _token_text(self.config[k])
            for k in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
            if self.config.get(k) is not None
        }
        context = {**special, "tools": None, "documents": None, **kwargs}
        context.update(messages=copy.deepcopy(list(messages)), add_generation_prompt=add_generation_prompt)
        template = _compile_checked(self.chat_template)
        try:
            return template.render(**context)
        except ChatTemplateError:
            raise
        except Exception as e:  # a template is code: raise_exception(), undefined names, 1 / 0, ...
            raise ChatTemplateError(f"the chat template failed to render: {_one_line(e)}") from None

    def encode_prompt(self, prompt: str, chat: bool) -> list[int]:
        """chat: one user turn through the template, encoded without adding special tokens (the
        template already starts with BOS). raw: encoded with the post-processor's BOS."""
        if chat:
            text = self.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
            return self.encode(text, add_special_tokens=False)
        return self.encode(prompt, add_special_tokens=True)


def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:200]}" if msg else type(e).__name__


def _compile_checked(template: str):
    try:
        return _compile(template)
    except Exception as e:  # jinja2.TemplateSyntaxError and anything a broken template raises while compiling
        raise ChatTemplateError(f"the chat template does not compile: {_one_line(e)}") from None


TEMPLATE_CHECK_S = 5


@contextlib.contextmanager
def _time_limit(seconds: float, message: str):
    """Raises ChatTemplateError(message) if the body runs past `seconds` (a template is code and
    can loop: jinja's sandbox bounds range() but not nested loops). Only in the main thread and
    only when no other interval timer is set; elsewhere the body runs unbounded."""
    if threading.current_thread() is not threading.main_thread() or signal.getitimer(signal.ITIMER_REAL) != (0.0, 0.0):
        yield
        return

    def expired(signum, frame):
        raise ChatTemplateError(message)

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def checked_tokenizer(
    path, tokenizer_json: str, tokenizer_config: dict, chat_template: str, generation_config: dict, vocab_size: int
) -> Tokenizer:
    """Tokenizer.from_metadata, with every failure a one-line FormatError naming `path`: the
    tokenizer must parse and know no more ids than the model's vocab, the chat template (if any)
    must compile and render one user turn to at least one token."""
    try:
        tok = Tokenizer.from_metadata(tokenizer_json, tokenizer_config, chat_template, generation_config)
    except BaseException as e:  # tokenizers raises Exception, and a Rust panic arrives as a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit, MemoryError)):
            raise
        raise FormatError(f"{path}: the tokenizer does not load ({_one_line(e)})") from None
    if tok.vocab_size > vocab_size:
        raise FormatError(f"{path}: the tokenizer knows {tok.vocab_size} ids, more than the model's vocab_size {vocab_size}")
    try:
        with _time_limit(TEMPLATE_CHECK_S, f"the chat template did not render one user turn within {TEMPLATE_CHECK_S} s"):
            ids = tok.encode_prompt("Hello", chat=tok.has_chat_template)
    except ChatTemplateError as e:
        raise FormatError(f"{path}: {e}") from None
    except Exception as e:
        raise FormatError(f"{path}: the tokenizer fails to encode text ({_one_line(e)})") from None
    if not ids:
        raise FormatError(
            f"{path}: the {'chat template' if tok.has_chat_template else 'tokenizer'} turns a prompt into no tokens"
        )
    return tok


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    """The environment transformers builds (chat_template_utils._compile_jinja_template)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
        rendering only needs the body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters; transformers replaces it with plain json.dumps
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


class IncrementalDecoder:
    """Streams text from token ids, one id at a time, never splitting a UTF-8 character.

    The prefix/read offset technique (TGI, vLLM): decode the window ids[prefix:] and the part
    ids[prefix:read] already printed; the difference is new text, printed only when the window
    does not end in U+FFFD (a byte-level token can end mid-character). Decoding a short window
    rather than the bare new id keeps context-dependent decoders (leading spaces) right.
    Concatenating every feed() and the final flush() gives decode(all ids).
    """

    MAX_SILENT = 8  # ids in a window that decodes to "" before it is cut short

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # start of the decode window
        self.read = 0  # ids before this are printed

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def feed(self, token_id: int) -> str:
        """The new printable text after appending token_id ("" while a character is incomplete)."""
        self.ids.append(int(token_id))
        printed = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if len(text) > len(printed) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(printed) :]
        if not text and len(self.ids) - self.prefix > self.MAX_SILENT:
            # a run of ids that print nothing (specials, ids the tokenizer lacks: a random model's):
            # nothing is pending, so keep one id of context and stop decoding an ever longer window
            self.prefix = self.read = len(self.ids) - 1
        return ""

    def flush(self) -> str:
        """Whatever is held back at the end (a truly incomplete tail decodes to U+FFFD)."""
        printed = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(printed) :]
