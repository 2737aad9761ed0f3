"""The tokenizer of a GGUF file whose `tokenizer.ggml.model` is `llama`: a SentencePiece
vocabulary (Llama, Mistral/Mixtral), run as llama.cpp runs it (`llm_tokenizer_spm`), built
as a `tokenizers` BPE.

llama.cpp splits the text in UTF-8 characters and, again and again, merges the adjacent pair
whose joined text is a token with the highest score (the leftmost on a tie); a character that
is no token becomes its `<0xNN>` byte tokens. A `tokenizers` BPE does the same when its merges
are every pair (a, b) of tokens whose joined text a + b is a token, ranked by that token's
score: it merges the adjacent pair of the lowest rank, the leftmost on a tie. The merges are
derived here from the vocabulary and the scores (docs/design/gguf.md, "Tokenizer").
"""

from __future__ import annotations

from collections import Counter

from ..errors import MoerunError
from ..tokenizer import Tokenizer

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's ▁, which stands for a space in the pieces


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every pair (a, b) of tokens whose joined text is a token, highest score of the joined
    token first (ties: lower token id, then shorter left part, so the order is fixed)."""
    ids: dict[str, int] = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)
    ranked = []
    for i, t in enumerate(tokens):
        if ids[t] != i:
            continue
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in ids and b in ids:
                ranked.append((-scores[i], i, k, a, b))
    ranked.sort()
    return [(a, b) for _, _, _, a, b in ranked]


def spm_tokenizer(f, unsupported):
    """A moerun Tokenizer for the file's SentencePiece (`llama`) vocabulary; `unsupported`
    is the error class for a vocabulary that cannot be built exactly."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, normalizers, processors


    tokens = f.get("tokenizer.ggml.tokens", "list[str]")
    n = len(tokens)
    scores = f.get("tokenizer.ggml.scores", "list[float]", [0.0] * n)  # llama.cpp's default: 0
    types = f.get("tokenizer.ggml.token_type", "list[int]", [NORMAL] * n)
    for key, v in (("scores", scores), ("token_type", types)):
        if len(v) != n:
            raise MoerunError(f"{f.path}: tokenizer.ggml.{key} has {len(v)} entries for {n} tokens")

    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)

    def token(key):
        i = f.get(f"tokenizer.ggml.{key}_token_id", "int", None)
        if i is not None and not 0 <= i < n:
            raise MoerunError(f"{f.path}: tokenizer.ggml.{key}_token_id is {i}, past the {n} tokens")
        return None if i is None else tokens[i]

    merges = spm_merges(tokens, scores)
    joined = {vocab[a + b] for a, b in merges}  # the tokens merges make
    tied = sum(k for k in Counter(scores[i] for i in joined).values() if k > 1)
    if tied * 2 > len(joined):
        # a file converted from a tokenizer.json alone (scores all -1000) or without scores: llama.cpp
        # merges equal scores leftmost first, an order no ranking of merges gives
        raise unsupported(f"{f.path}: the SentencePiece vocabulary's scores do not order its merges ({tied} of "
                          f"{len(joined)} merged tokens share a score), so moerun cannot encode as llama.cpp does")
    unk = token("unknown")
    byte_tokens = all(f"<0x{b:02X}>" in vocab for b in range(256))
    model = models.BPE(vocab, merges, unk_token=unk, fuse_unk=False, byte_fallback=byte_tokens)
    tok = HFTokenizer(model)
    prefix = f.get("tokenizer.ggml.add_space_prefix", "bool", True)
    # llama.cpp writes each piece of text between special or user-defined tokens with a space in
    # front (add_space_prefix) and its spaces as ▁; the normalizer runs on those same pieces
    steps = [normalizers.Prepend(SPACE)] if prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", SPACE)])
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    added = [AddedToken(tokens[i], special=types[i] in (CONTROL, UNKNOWN), normalized=False)
             for i in range(n) if types[i] in (CONTROL, UNKNOWN, USER_DEFINED) and vocab[tokens[i]] == i]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])

    bos, eos = token("bos"), token("eos")
    if f.get("tokenizer.ggml.add_eos_token", "bool", False):
        if eos is None:
            raise MoerunError(f"{f.path}: tokenizer.ggml.add_eos_token is set but the file has no eos token")
        tok.post_processor = processors.TemplateProcessing(single=f"$A:0 {eos}:0", pair=f"$A:0 {eos}:0 $B:1 {eos}:1",
                                                           special_tokens=[(eos, vocab[eos])])
    add_bos = f.get("tokenizer.ggml.add_bos_token", "bool", None)
    if add_bos and bos is None:
        raise MoerunError(f"{f.path}: tokenizer.ggml.add_bos_token is set but the file has no bos token")
    add_bos = (bos is not None) if add_bos is None else add_bos  # llama.cpp's default for SentencePiece: add
    template = f.get("tokenizer.chat_template", "str", None)
    return Tokenizer.from_parts(tok, template, bos=bos, eos=token("eot") or eos, add_bos=add_bos)

