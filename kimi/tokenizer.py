"""Kimi-K2 tokenizer: tiktoken BPE vocabulary, special tokens, chat template, incremental detokenizer.

Format (see docs/model-format.md, Tokenizer, and docs/model-format.md, Chat and tool-call format):

- `tiktoken.model`: one line per ordinary token, `base64(bytes) rank`, ranks 0..163583 (the same file for
  K2 through K2.6).
- Special tokens: ids 163584..163841. Named ones come from `added_tokens_decoder` in `tokenizer_config.json`
  (or `special_tokens.json`); the unnamed ids are `<|reserved_token_{id}|>`. Each entry's `special` flag
  decides whether `skip_special_tokens` drops it (the five tool-call tokens and `<think>`/`</think>` are
  not special, so they survive).
- Pre-tokenization uses the split pattern below (fancy-regex syntax, which tiktoken's Rust regex accepts).
- No BOS/EOS is ever added by `encode`.

Everything here is loaded from plain files: no remote code, no HF AutoTokenizer.
"""

from __future__ import annotations

import base64
import codecs
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import jinja2
import tiktoken
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kimi import envs

NUM_ORDINARY_TOKENS = 163584  # ranks 0..163583 in tiktoken.model
SPECIAL_ID_START = 163584
SPECIAL_ID_END = 163842  # exclusive: specials are 163584..163841
MODEL_VOCAB_SIZE = 163840  # the model's embedding rows (config vocab_size)

# docs/model-format.md, Tokenizer, joined by "|".
PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

# Chunking limits of the reference tokenizer: tiktoken never sees more than this many characters at once, nor
# a run of more than this many consecutive whitespace / non-whitespace characters.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000

DEFAULT_SPECIAL_TOKENS: dict[int, tuple[str, bool]] = {  # id -> (content, special); docs/model-format.md, Tokenizer
    163584: ("[BOS]", True),
    163585: ("[EOS]", True),
    163586: ("<|im_end|>", True),
    163587: ("<|im_user|>", True),
    163588: ("<|im_assistant|>", True),
    163594: ("<|im_system|>", True),
    163595: ("<|tool_calls_section_begin|>", False),
    163596: ("<|tool_calls_section_end|>", False),
    163597: ("<|tool_call_begin|>", False),
    163598: ("<|tool_call_argument_begin|>", False),
    163599: ("<|tool_call_end|>", False),
    163601: ("<|im_middle|>", True),
    163602: ("<|media_begin|>", True),
    163603: ("<|media_content|>", True),
    163604: ("<|media_end|>", True),
    163605: ("<|media_pad|>", True),
    163606: ("<think>", False),
    163607: ("</think>", False),
    163838: ("[UNK]", True),
    163839: ("[PAD]", True),
}

_TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")
# the maximal whitespace / non-whitespace runs longer than MAX_RUN_CHARS (the only ones _split_for_encode cuts): a
# match may start only where a run starts (the lookbehinds), so shorter runs cost one failed attempt each and no
# Python-level iteration
_LONG_RUN_RE = re.compile(rf"(?<!\s)\s{{{MAX_RUN_CHARS + 1},}}|(?<!\S)\S{{{MAX_RUN_CHARS + 1},}}")


def _reserved_name(token_id: int) -> str:
    return f"<|reserved_token_{token_id}|>"


def _load_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                b64, rank = line.split()
                ranks[base64.b64decode(b64)] = int(rank)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: expected 'base64(bytes) rank', got {line[:80]!r}") from e
    return ranks


def _split_for_encode(text: str) -> Iterator[str]:
    """Yield consecutive pieces of `text` that tiktoken can encode without pathological regex cost.

    Same cut points as the reference Kimi tokenizer: pieces of at most MAX_ENCODE_CHARS characters, and
    inside each, a run of whitespace (`str.isspace`) or non-whitespace characters is cut every
    MAX_RUN_CHARS characters (counted from the start of the run).
    """
    for start in range(0, len(text), MAX_ENCODE_CHARS):
        chunk = text[start : start + MAX_ENCODE_CHARS]
        if len(chunk) <= MAX_RUN_CHARS:
            yield chunk
            continue
        last = 0
        for m in _LONG_RUN_RE.finditer(chunk):
            for cut in range(m.start() + MAX_RUN_CHARS, m.end(), MAX_RUN_CHARS):
                yield chunk[last:cut]
                last = cut
        yield chunk[last:]


def _tojson(
    value: Any,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
    ensure_ascii: bool = False,
) -> str:
    """Jinja2 `tojson` filter on top of `json.dumps` (no HTML escaping, non-ASCII kept unless asked)."""
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


def _raise_exception(message: str) -> None:
    raise ValueError(message)


class KimiTokenizer:
    """The Kimi-K2 tiktoken tokenizer (docs/model-format.md, Tokenizer) and its chat template
    (docs/model-format.md, Chat and tool-call format).

    Build with `KimiTokenizer.from_dir(path)`. Ids: ordinary tokens 0..163583, specials 163584..163841;
    `vocab_size` counts both (163842), which is more than the model's 163840 embedding rows.
    """

    def __init__(
        self,
        mergeable_ranks: dict[bytes, int],
        added_tokens: dict[int, tuple[str, bool]],
        chat_template: str | None = None,
        bos_token: str | None = "[BOS]",
        eos_token: str | None = "[EOS]",
        pad_token: str | None = "[PAD]",
        name: str = "kimi",
    ):
        """Args:
            mergeable_ranks: ordinary token bytes -> rank (the tiktoken.model contents).
            added_tokens: id -> (content, special flag) for the named special tokens; ids in
                163584..163841 not listed become `<|reserved_token_{id}|>` (special).
            chat_template: Jinja2 source, or None (then `apply_chat_template` raises ValueError).
            bos_token / eos_token / pad_token: token strings (looked up among the special tokens).
        Raises ValueError if a special id collides with an ordinary rank or a content string repeats.
        """
        specials: dict[int, tuple[str, bool]] = {
            i: (_reserved_name(i), True) for i in range(SPECIAL_ID_START, SPECIAL_ID_END)
        }
        specials.update(added_tokens)
        n_ordinary = len(mergeable_ranks)
        for i in specials:
            if i < n_ordinary:
                raise ValueError(f"special token id {i} collides with an ordinary token rank (< {n_ordinary})")
        special_map = {content: i for i, (content, _) in specials.items()}
        if len(special_map) != len(specials):
            raise ValueError("special token contents are not unique")
        self._enc = tiktoken.Encoding(
            name, pat_str=PAT_STR, mergeable_ranks=mergeable_ranks, special_tokens=special_map
        )
        size = max(max(mergeable_ranks.values(), default=-1), max(specials)) + 1
        table: list[bytes | None] = [None] * size
        for b, r in mergeable_ranks.items():
            table[r] = b
        for i, (content, _) in specials.items():
            table[i] = content.encode("utf-8")
        self._table = table
        self._special_to_id = special_map
        self._ordinary_to_id = mergeable_ranks
        self.special_ids: frozenset[int] = frozenset(i for i, (_, special) in specials.items() if special)
        self.added_tokens = specials
        self.chat_template = chat_template
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.bos_token_id = special_map.get(bos_token) if bos_token else None
        self.eos_token_id = special_map.get(eos_token) if eos_token else None
        self.pad_token_id = special_map.get(pad_token) if pad_token else None
        self.im_end_id = special_map.get("<|im_end|>")
        self._longest_token_bytes: int | None = None  # min_num_tokens computes it on first use

    # ----------------------------------------------------------------------------------------------- loading
    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> KimiTokenizer:
        """Load a tokenizer from a checkpoint (or tokenizer) folder.

        Reads `tiktoken.model`; special tokens and bos/eos/pad strings from `tokenizer_config.json` (or, when
        that is absent, `special_tokens.json` as in ../shared/kimi-tokenizer); the chat template from
        `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (a string, or HF's list of
        `{"name", "template"}` where "default" is used).
        Raises FileNotFoundError if `tiktoken.model` or both config files are missing, ValueError on
        malformed contents.
        """
        path = Path(path)
        model_file = path / "tiktoken.model"
        if not model_file.is_file():
            raise FileNotFoundError(f"{model_file} not found (a Kimi tokenizer needs tiktoken.model)")
        for cfg_name in ("tokenizer_config.json", "special_tokens.json"):
            if (path / cfg_name).is_file():
                with open(path / cfg_name, encoding="utf-8") as f:
                    cfg = json.load(f)
                break
        else:
            raise FileNotFoundError(f"neither tokenizer_config.json nor special_tokens.json in {path}")
        added = {
            int(k): (v["content"], bool(v.get("special", True))) for k, v in cfg.get("added_tokens_decoder", {}).items()
        }
        template = None
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif isinstance(cfg.get("chat_template"), str):
            template = cfg["chat_template"]
        elif isinstance(cfg.get("chat_template"), list):
            named = {t.get("name"): t.get("template") for t in cfg["chat_template"]}
            template = named.get("default")

        def token_str(key: str, default: str) -> str | None:
            v = cfg.get(key, default)
            return v.get("content") if isinstance(v, dict) else v

        return cls(
            _load_ranks(model_file),
            added,
            template,
            bos_token=token_str("bos_token", "[BOS]"),
            eos_token=token_str("eos_token", "[EOS]"),
            pad_token=token_str("pad_token", "[PAD]"),
        )

    # ------------------------------------------------------------------------------------------ vocabulary
    @property
    def vocab_size(self) -> int:
        """Number of tokenizer ids, ordinary + special (163842 for Kimi)."""
        return len(self._table)

    def token_to_id(self, token: str) -> int:
        """Id of a special token string, or of an ordinary token whose UTF-8 bytes are one vocabulary entry.

        Raises KeyError if `token` is neither.
        """
        if token in self._special_to_id:
            return self._special_to_id[token]
        rank = self._ordinary_to_id.get(token.encode("utf-8"))
        if rank is None:
            raise KeyError(f"{token!r} is not a single token of this vocabulary")
        return rank

    def id_to_bytes(self, token_id: int) -> bytes:
        """The bytes of one token (a special token's are its UTF-8 content). Raises ValueError if unknown."""
        b = self._table[token_id] if 0 <= token_id < len(self._table) else None
        if b is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {len(self._table)})")
        return b

    # ---------------------------------------------------------------------------------------- encode/decode
    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of `text`; no BOS/EOS is added.

        With allow_special=False (the default; use it for anything a user wrote) special-token strings such as
        `<|im_end|>` are encoded as ordinary text. With allow_special=True they become their ids (use it for
        rendered chat templates). Long inputs are encoded in pieces (see `_split_for_encode`), as the reference
        tokenizer does, so the result matches it.
        """
        out: list[int] = []
        for piece in _split_for_encode(text):
            if allow_special:
                out.extend(self._enc.encode(piece, allowed_special="all"))
            else:
                out.extend(self._enc.encode_ordinary(piece))
        return out

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on len(self.encode(text)) (allow_special False) in one pass over the text, without
        encoding it: its UTF-8 bytes over the longest ordinary token's bytes (every token of it is one ordinary
        vocabulary entry). Lets the API refuse a huge prompt before spending seconds tokenizing it."""
        longest = self._longest_token_bytes
        if longest is None:
            longest = self._longest_token_bytes = max(len(b) for b in self._ordinary_to_id)
        return -(-len(text.encode("utf-8", "replace")) // max(1, longest))  # a lone surrogate: 1 byte, not more

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`: the tokens' bytes joined and decoded as UTF-8 (invalid bytes become U+FFFD).

        skip_special_tokens drops ids in `special_ids` (tool-call tokens and <think>/</think> are not in it).
        Raises ValueError on an id outside the vocabulary (IncrementalDetokenizer instead treats such an id as
        empty text, because a model with a padded vocabulary can sample one).
        """
        table = self._table
        parts: list[bytes] = []
        for i in ids:
            if skip_special_tokens and i in self.special_ids:
                continue
            b = table[i] if 0 <= i < len(table) else None
            if b is None:
                raise ValueError(f"token id {i} is outside the vocabulary (size {len(table)})")
            parts.append(b)
        return b"".join(parts).decode("utf-8", errors="replace")

    # ------------------------------------------------------------------------------------------ chat template
    @property
    def chat_template(self) -> str | None:
        """Jinja2 source of the chat template (None if the checkpoint has none); assigning recompiles."""
        return self._chat_template

    @chat_template.setter
    def chat_template(self, source: str | None) -> None:
        self._chat_template = source
        self._compiled_template: jinja2.Template | None = None

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render the checkpoint's chat template (docs/model-format.md, Chat and tool-call format) to a prompt string.

        Encode the result with `encode(prompt, allow_special=True)`. The template sees `messages`, `tools`,
        `add_generation_prompt`, `bos_token`, `eos_token` and every extra keyword (e.g. `thinking=False`);
        it runs in a sandboxed Jinja2 environment with a `tojson` filter accepting `indent`, `separators`,
        `sort_keys` and `ensure_ascii`, and a `raise_exception(msg)` global.
        Raises ValueError (message names the template problem) on a missing or failing template; the HTTP
        layer turns it into a 400.
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (no chat_template.jinja or chat_template)")
        if self._compiled_template is None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            try:
                self._compiled_template = env.from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise ValueError(f"chat template does not compile: {e}") from e
        try:
            return self._compiled_template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **template_kwargs,
            )
        except Exception as e:  # a template is user-driven code: any failure is a bad request
            raise ValueError(f"chat template failed to render: {type(e).__name__}: {e}") from e


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character.

    Works on bytes: each `push` feeds the token's bytes to an incremental UTF-8 decoder (errors="replace"),
    which holds back an incomplete trailing character and emits U+FFFD for a sequence as soon as it can no
    longer become valid. O(1) per token. `"".join(pushes) + flush()` equals
    `tokenizer.decode(ids, skip_special_tokens=...)` for in-vocabulary ids. An id outside the vocabulary
    (a padded-vocabulary model can sample one) counts as empty text instead of raising.
    """

    def __init__(self, tokenizer: KimiTokenizer, skip_special_tokens: bool = True):
        self._table = tokenizer._table
        self._skip = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text completed by it (possibly "")."""
        if token_id in self._skip or not (0 <= token_id < len(self._table)):
            return ""
        b = self._table[token_id]
        return self._decoder.decode(b, final=False) if b else ""

    def flush(self) -> str:
        """End of stream: return what is left (an incomplete trailing character becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)


# ------------------------------------------------------------------------------------------------ files
def default_tokenizer_source() -> str | None:
    """Folder with the real Kimi vocabulary: `$KIMI_TOKENIZER_DIR` if set, else `<repo>/../shared/kimi-tokenizer`
    (resolved from this file) if it exists, else None."""
    env = envs.KIMI_TOKENIZER_DIR.get()
    if env:
        return env
    candidate = Path(__file__).resolve().parent.parent.parent / "shared" / "kimi-tokenizer"
    return str(candidate) if (candidate / "tiktoken.model").is_file() else None


def _builtin_ranks() -> dict[bytes, int]:
    """Byte-level vocabulary: ranks 0..255 are the single bytes, 256..163583 are ` tok{rank}`.

    There is no 2-byte token, so BPE never merges and `encode` always yields byte tokens. The fillers mix a
    letter and digits, which no pre-tokenizer piece does (digits only ever form all-digit pieces), so the
    whole-piece shortcut can never produce them either; they exist so that every model id decodes.
    """
    ranks = {bytes([i]): i for i in range(256)}
    for r in range(256, NUM_ORDINARY_TOKENS):
        ranks[f" tok{r}".encode("ascii")] = r
    return ranks


def write_tokenizer_files(dst_dir: str | os.PathLike[str], source_dir: str | os.PathLike[str] | None = None) -> None:
    """Write tiktoken.model, tokenizer_config.json and chat_template.jinja into `dst_dir` (created if needed).

    With `source_dir` (a folder holding `tiktoken.model` and `special_tokens.json` or `tokenizer_config.json`
    with `added_tokens_decoder`, like ../shared/kimi-tokenizer), the real vocabulary and its special tokens
    are copied; otherwise the built-in byte-level vocabulary (`_builtin_ranks`) and the Kimi special tokens
    (DEFAULT_SPECIAL_TOKENS) are written. Every id in 163584..163841 gets an `added_tokens_decoder` entry
    (unnamed ones `<|reserved_token_{id}|>`). The chat template is always kimi/chat_template.jinja.
    Raises FileNotFoundError if `source_dir` lacks the files.
    """
    dst = Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    template = _TEMPLATE_PATH.read_text(encoding="utf-8")
    meta: dict[str, Any] = {
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "model_max_length": 262144,
    }
    if source_dir is not None:
        src = Path(source_dir)
        shutil.copyfile(src / "tiktoken.model", dst / "tiktoken.model")
        cfg_file = src / "special_tokens.json"
        if not cfg_file.is_file():
            cfg_file = src / "tokenizer_config.json"
        with open(cfg_file, encoding="utf-8") as f:
            cfg = json.load(f)
        named = {int(k): (v["content"], bool(v.get("special", True))) for k, v in cfg["added_tokens_decoder"].items()}
        meta.update({k: cfg[k] for k in meta if k in cfg})
    else:
        lines = [base64.b64encode(b) + b" " + str(r).encode() for b, r in _builtin_ranks().items()]
        (dst / "tiktoken.model").write_bytes(b"\n".join(lines) + b"\n")
        named = DEFAULT_SPECIAL_TOKENS
    decoder = {}
    for i in range(SPECIAL_ID_START, SPECIAL_ID_END):
        content, special = named.get(i, (_reserved_name(i), True))
        decoder[str(i)] = {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
    config = {"added_tokens_decoder": decoder, **meta, "chat_template": template}
    with open(dst / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    (dst / "chat_template.jinja").write_text(template, encoding="utf-8")
