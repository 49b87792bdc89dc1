"""A tiny K2.6 checkpoint whose weights make greedy decoding follow a known token chain (a bigram model).

Why: the tiny random checkpoint's greedy output is noise, so it can never emit a kimi_k2 tool call, a
`<think>` block or a chosen stop string. Faking the output in the server (a scripted mode) would not test
the serving path. Instead this writes *weights*: the real server, real torchrun worker, real forward pass
and real sampler then generate the chain, and every HTTP feature (parsers, stops, logprobs, n, aborts)
runs on genuinely generated tokens.

How (all other tensors are the random tiny checkpoint's):
- each chain token t gets a one-hot embedding `S * e_{d_t}` (its own hidden dimension d_t, S = 1e4). Every
  layer reads the residual through an RMSNorm, so its contribution stays O(1) while the residual is O(S):
  after the final norm the hidden state is `sqrt(H) * w_norm[d_t] * e_{d_t}` to within ~1e-3.
- `lm_head` rows of chain targets s are zero except `W[s, d_t] = c / (sqrt(H) * w_norm[d_t])` for every edge
  t -> s with logit c. So after token t the logit of s is c (60 for the main chain; the random rows give
  logits of about |15| at most), and greedy decoding follows the chain.
- `call_end` has two edges: `<|tool_call_begin|>` (40) and `<|tool_calls_section_end|>` (35). Without a
  bias the section loops (call after call, until max_tokens); `logit_bias {TOOL_CALL_BEGIN: -10}` makes
  the section end after one call (section_begin -> call_begin still wins, 60 - 10 > 15).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil

from safetensors.torch import load_file, save_file

IM_MIDDLE, IM_END = 163601, 163586
THINK, THINK_END = 163606, 163607
SB, SE, CB, AB, CE = 163595, 163596, 163597, 163598, 163599
GT = 29  # ">", the last token of a prompt that ends with the text "<think></think>" (thinking off)

# text tokens (the real Kimi vocabulary, ../shared/kimi-tokenizer)
I_, THINK_W, OK, DONE = 374, 2704, 8145, 25702  # " I", " think", "OK", "Done"
HEADER = [41937, 1150, 21055, 2800, 25, 15]  # "functions.get_weather:0"
ARGS = [8264, 37666, 7471, 113476, 16934]  # '{"city":"Paris"}'

MAIN = [IM_MIDDLE, THINK, I_, THINK_W, THINK_END, OK, SB, CB, *HEADER, AB, *ARGS, CE]
EDGES: list[tuple[int, int, float]] = [(a, b, 60.0) for a, b in itertools.pairwise(MAIN)] + [
    (GT, OK, 60.0),
    (CE, CB, 40.0),
    (CE, SE, 35.0),
    (SE, DONE, 60.0),
    (DONE, IM_END, 60.0),
]
CHAIN_TOKENS = sorted({t for a, b, _ in EDGES for t in (a, b)})
# greedy output after a prompt ending in <|im_middle|>, for reference in tests (the section loops)
ONE_CALL = [CB, *HEADER, AB, *ARGS, CE]
GREEDY_PREFIX = [THINK, I_, THINK_W, THINK_END, OK, SB, *ONE_CALL]

_S = 1.0e4
_PREFIX = "language_model."


def make_chain_checkpoint(src_dir: str, dst_dir: str, edges: list[tuple[int, int, float]] = EDGES) -> str:
    """Copy the tiny K2.6 checkpoint at src_dir to dst_dir and rewrite embed_tokens / lm_head for `edges`.

    edges: (token, next token, logit). At most hidden_size distinct source tokens. Returns dst_dir.
    """
    from kimi.tokenizer import KimiTokenizer

    tok = KimiTokenizer.from_dir(src_dir)
    want = {I_: " I", THINK_W: " think", OK: "OK", DONE: "Done"}
    if any(tok.decode([t]) != s for t, s in want.items()) or tok.decode(HEADER) != "functions.get_weather:0":
        raise RuntimeError(
            "the chain checkpoint needs the real Kimi vocabulary (../shared/kimi-tokenizer or "
            "$KIMI_TOKENIZER_DIR) in the tiny checkpoint; its token ids are hard-coded"
        )
    shutil.copytree(src_dir, dst_dir)
    with open(os.path.join(dst_dir, "model.safetensors.index.json")) as f:
        wmap = json.load(f)["weight_map"]
    names = {k: _PREFIX + k for k in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")}
    files = {n: os.path.join(dst_dir, wmap[n]) for n in names.values()}
    loaded = {p: load_file(p) for p in set(files.values())}
    emb = loaded[files[names["model.embed_tokens.weight"]]][names["model.embed_tokens.weight"]]
    head = loaded[files[names["lm_head.weight"]]][names["lm_head.weight"]]
    w_norm = loaded[files[names["model.norm.weight"]]][names["model.norm.weight"]].float()
    hidden = emb.shape[1]
    sources = list(dict.fromkeys(a for a, _, _ in edges))
    if len(sources) > hidden:
        raise ValueError(f"{len(sources)} source tokens need more than hidden_size={hidden} dimensions")
    dim = {t: i for i, t in enumerate(sources)}
    e = emb.float()
    for t, d in dim.items():
        e[t] = 0.0
        e[t, d] = _S
    h = head.float()
    for s in {b for _, b, _ in edges}:
        h[s] = 0.0
    for a, b, c in edges:
        d = dim[a]
        h[b, d] = c / (math.sqrt(hidden) * float(w_norm[d]))
    loaded[files[names["model.embed_tokens.weight"]]][names["model.embed_tokens.weight"]] = e.to(emb.dtype).contiguous()
    loaded[files[names["lm_head.weight"]]][names["lm_head.weight"]] = h.to(head.dtype).contiguous()
    for path, tensors in loaded.items():
        save_file(tensors, path, metadata={"format": "pt"})
    return dst_dir
