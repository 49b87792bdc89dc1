"""xgrammar's view of the Kimi vocabulary: one byte string per model token id.

- Ordinary tokens (ids below 163584, tiktoken ranks): their raw bytes (VocabType.RAW: tiktoken BPE tokens are bytes,
  not byte-level-encoded strings).
- The output parser's markers (the five tool-call tokens, `<think>` / `</think>`: kimi.controller.parsers.MARKER_TEXT)
  and any other token the tokenizer marks not special: their text, so a structural tag can name them as tokens
  (kimi.structured_output.request). The markers are read by id whatever the vocabulary calls them (K2-Instruct's
  names 163606 / 163607 `<|reserved_token_...|>`, and `--reasoning on` still reads them as `<think>` / `</think>`).
- Special tokens (`[EOS]`, `<|im_end|>`, reserved ids, ...): empty, which xgrammar treats as never allowed except the
  stop tokens, and only where the grammar may end.
- Ids at or past the tokenizer's vocabulary, up to the model's `vocab_size` (padding rows of the embedding): masked
  off (xgrammar's `vocab_size` is the model's; ids the tokenizer has beyond it are dropped).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable

from kimi.controller.parsers import MARKER_TEXT
from kimi.tokenizer import SPECIAL_ID_START, KimiTokenizer, default_tokenizer_source, write_tokenizer_files


def encoded_vocab(tokenizer: KimiTokenizer, vocab_size: int) -> list[bytes]:
    """The bytes of each id in [0, vocab_size) as xgrammar reads them (module docstring): a list of vocab_size
    bytes objects (b"" for special tokens and ids the tokenizer lacks)."""
    out: list[bytes] = []
    for i in range(vocab_size):
        if i < SPECIAL_ID_START:
            try:
                out.append(tokenizer.id_to_bytes(i))
            except ValueError:  # an id the tokenizer does not have
                out.append(b"")
            continue
        added = tokenizer.added_tokens.get(i)
        if i in MARKER_TEXT:
            out.append(MARKER_TEXT[i].encode("utf-8"))
        else:
            out.append(added[0].encode("utf-8") if added is not None and not added[1] else b"")
    return out


def stop_token_ids(eos_token_ids: Iterable[int], tokenizer: KimiTokenizer) -> list[int]:
    """The ids that may end a constrained output: the checkpoint's EOS ids and `<|im_end|>` (kimi.server's
    `eos_token_ids`), sorted."""
    ids = set(eos_token_ids)
    if tokenizer.im_end_id is not None:
        ids.add(tokenizer.im_end_id)
    return sorted(ids)


def load_tokenizer(model: str) -> KimiTokenizer:
    """The tokenizer a worker guides with: the checkpoint folder's, or for `preset:NAME` models (dummy weights) the
    one the controller uses then (kimi.server.load_model_meta: `default_tokenizer_source()`, else the built-in
    byte-level vocabulary). Raises FileNotFoundError / ValueError as KimiTokenizer.from_dir."""
    if not model.startswith("preset:"):
        return KimiTokenizer.from_dir(model)
    with tempfile.TemporaryDirectory() as d:
        write_tokenizer_files(d, default_tokenizer_source())
        return KimiTokenizer.from_dir(d)
