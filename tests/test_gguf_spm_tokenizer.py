"""A GGUF file's SentencePiece ('llama') tokenizer (loaders/gguf_tokenizer.py) against the
sentencepiece library: a small BPE model is trained here, its pieces, scores and types written
into a GGUF's tokenizer.ggml.* keys as llama.cpp's converter writes them, and moerun must
encode to sentencepiece's ids and decode back to the text."""

import io
import json

import pytest

spm = pytest.importorskip("sentencepiece")
gguf = pytest.importorskip("gguf")

from moerun.engine.llm import gguf_extras  # noqa: E402
from moerun.loaders.gguf import GGUFFile, UnsupportedTokenizer, tokenizer_from_gguf  # noqa: E402
from moerun.loaders.gguf_tokenizer import spm_merges  # noqa: E402
from moerun.tokenizer import IncrementalDecoder  # noqa: E402

# what the model is trained on: prose in a few scripts, code, whitespace of every kind
CORPUS = """\
The quick brown fox jumps over the lazy dog. A tokenizer splits text into pieces.
Les élèves étudient à l'école; où est la bibliothèque? Ça coûte trente-deux euros.
Der Bär läuft über die Straße, und die Größe des Bären überrascht alle Mädchen.
El niño comió una manzana y la señora leyó el periódico en la mañana.
Быстрая коричневая лиса прыгает через ленивую собаку. Привет, как дела?
東京は日本の首都です。今日はとても良い天気ですね。私は学生です。
我们今天去公园散步，天气很好。中文分词是一个有趣的问题。
서울은 한국의 수도입니다. 오늘 날씨가 좋네요.
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }
\tindented_with_tab = {"key": [1, 2, 3], 'other': None}
    x = y  +  z    # runs of spaces
class Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [self.vocab[t] for t in text.split()]
import numpy as np; arr = np.zeros((3, 4), dtype=np.float32)
SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;
if (x != null && y.length > 0) { console.log(`value: ${x}`); }
The year 2024 had 366 days; 3.14159 is pi and 2.71828 is e.
"""
# what it is asked to encode: the corpus's kinds of text and characters it never saw (byte
# fallback: rare CJK, emoji, symbols), tabs, newlines, runs of spaces, leading and trailing spaces
TEXT = """  Leading spaces, then prose: The naïve café owner said «bonjour» — déjà vu!
Mixed 中文和日本語のテキスト, 한국어도, and Ελληνικά γράμματα plus עברית.
Emoji: 🦊🐶 👩‍💻 ✨ and rare 𝔘𝔫𝔦𝔠𝔬𝔡𝔢, 龘, ∮ E⋅da = Q.
def   spaced(a,\tb):\n\t\treturn a  +   b   \n\n\n
    for (auto& [k, v] : map) { std::cout << k << ":" << v << '\\n'; }
\t\tx=1;\ty=2;\t\tz=\"tab\tinside\"
trailing spaces   """
SYMBOLS = ["<tool>", "</tool>"]  # user-defined pieces


def train(model_type="bpe", vocab_size=700, dummy_prefix=True) -> "spm.SentencePieceProcessor":
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines() * 4), model_writer=out, model_type=model_type,
        vocab_size=vocab_size, byte_fallback=True, user_defined_symbols=SYMBOLS, character_coverage=0.995,
        # as Llama's and Mistral's tokenizer.model: text as it is, spaces kept, a dummy prefix
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=dummy_prefix,
        split_digits=True, allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        minloglevel=2, num_threads=1)
    return spm.SentencePieceProcessor(model_proto=out.getvalue())


def write_gguf(sp, path, *, user_defined=True, add_bos=True, add_eos=False, template=None, scores=True,
               space_prefix=None, arch_keys=False):
    """The tokenizer.ggml.* keys llama.cpp's converter writes for a tokenizer.model
    (_create_vocab_sentencepiece, SpecialVocab): pieces, scores, the piece types, and the
    added tokens of the model's tokenizer_config.json (`user_defined`: ours are listed there,
    not special) as USER_DEFINED."""
    T = gguf.TokenType
    tokens, scores_, types = [], [], []
    for i in range(sp.vocab_size()):
        kind = (T.UNKNOWN if sp.IsUnknown(i) else T.CONTROL if sp.IsControl(i) else T.UNUSED if sp.IsUnused(i)
                else T.BYTE if sp.IsByte(i) else T.NORMAL)
        tokens.append(sp.IdToPiece(i))
        scores_.append(sp.GetScore(i))
        types.append(kind)
        if user_defined and sp.IdToPiece(i) in SYMBOLS:
            tokens[-1], scores_[-1], types[-1] = sp.IdToPiece(i).replace("\u2581", " "), -1000.0, T.USER_DEFINED
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    if scores is not None:  # True: sentencepiece's; a number: every token's
        w.add_token_scores(scores_ if scores is True else [scores] * len(tokens))
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(add_bos)
    w.add_add_eos_token(add_eos)
    if template:
        w.add_chat_template(template)
    if space_prefix is not None:
        w.add_add_space_prefix(space_prefix)
    if arch_keys:  # what llama.cpp reads before the vocabulary (benchmarks/spm_tokenizer_vs_llamacpp.py)
        w.add_context_length(256)
        w.add_embedding_length(64)
        w.add_block_count(1)
        w.add_feed_forward_length(128)
        w.add_head_count(4)
        w.add_head_count_kv(4)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_vocab_size(sp.vocab_size())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load(path):
    f = GGUFFile(path)
    try:
        return tokenizer_from_gguf(f)
    finally:
        f.close()


@pytest.fixture(scope="module")
def sp():
    return train()


@pytest.fixture(scope="module")
def tok(sp, tmp_path_factory):
    return load(write_gguf(sp, tmp_path_factory.mktemp("spm") / "spm.gguf"))


def test_the_text_needs_byte_fallback_and_whitespace_pieces(sp):
    """What the exactness test below rests on: the text has characters outside the vocabulary
    (byte pieces) and the model has pieces of several spaces."""
    pieces = sp.encode(TEXT, out_type=str)
    assert sum(p.startswith("<0x") for p in pieces) > 20
    assert any(set(p) == {"\u2581"} and len(p) > 1 for p in pieces)
    assert "\u2581" not in sp.decode(sp.encode(TEXT)) and sp.decode(sp.encode(TEXT)) == TEXT


@pytest.mark.parametrize("part", ["all", "lines", "edges"])
def test_encodes_as_sentencepiece_and_decodes_back(sp, tok, part):
    texts = {"all": [TEXT], "lines": TEXT.splitlines(keepends=True),
             "edges": ["", " ", "   ", "\n", "\t", "a", " a", "\u2581", "🦊", "  \n  x  ", "<0x41>", "s>"]}[part]
    for text in texts:
        ids = sp.encode(text)
        assert tok.encode(text, add_special_tokens=False) == ids, repr(text)
        assert tok.encode(text) == [sp.bos_id()] + ids, repr(text)  # add_bos_token
        assert tok.decode(ids) == sp.decode(ids), repr(text)
        if text != "\u2581":  # ▁ in a text comes back as a space, as from sentencepiece
            assert tok.decode(ids) == text, repr(text)


def test_streamed_decoding_gives_the_text(sp, tok):
    dec = IncrementalDecoder(tok, [sp.bos_id()])
    assert "".join(dec.push(i) for i in sp.encode(TEXT)) == TEXT


def test_special_and_user_defined_tokens(sp, tok):
    """Control tokens' texts in a prompt are those tokens (llama.cpp's parse_special), skipped
    when decoding. User-defined tokens are matched before the pieces, and the text after one
    gets the space prefix again: llama.cpp splits the text at them and encodes each part as a
    text of its own (sentencepiece itself puts no space after one)."""
    bos, eos = sp.bos_id(), sp.eos_id()
    assert tok.encode("<s>Hello</s>", add_special_tokens=False) == [bos] + sp.encode("Hello") + [eos]
    assert tok.decode([bos] + sp.encode("Hello") + [eos]) == "Hello"
    tool = sp.PieceToId("<tool>")
    parts = ["Call ", " the fox(x=1) ", "\tend"]
    want = sp.encode(parts[0]) + [tool] + sp.encode(parts[1]) + [sp.PieceToId("</tool>")] + sp.encode(parts[2])
    assert tok.encode("<tool>".join(parts[:2]) + "</tool>" + parts[2], add_special_tokens=False) == want
    assert tok.plain.encode("<s>", add_special_tokens=False).ids == sp.encode("<s>")  # chat contents: plain text


def test_add_eos_and_chat_template(sp, tmp_path):
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
    t = load(write_gguf(sp, tmp_path / "chat.gguf", add_eos=True, template=template))
    assert t.encode("Привет") == [sp.bos_id()] + sp.encode("Привет") + [sp.eos_id()]
    assert t.chat_template == template and t.eos_token == "</s>"
    msgs = [{"role": "user", "content": "Say 你好"}, {"role": "assistant", "content": "你好!"},
            {"role": "user", "content": "Again </s>"}]
    # after <s> and </s> the text starts again with the space prefix, as llama.cpp encodes it
    want = ([sp.bos_id()] + sp.encode("[INST] Say 你好 [/INST]你好!") + [sp.eos_id()]
            + sp.encode("[INST] Again </s> [/INST]"))
    assert t.encode_chat(msgs, add_generation_prompt=False) == want


def test_vocabulary_without_the_dummy_prefix(tmp_path):
    """add_space_prefix false (as Gemma's files say): no space in front, none stripped."""
    sp = train(dummy_prefix=False)
    t = load(write_gguf(sp, tmp_path / "noprefix.gguf", space_prefix=False))
    for text in (TEXT, "hello world", " x"):
        assert t.encode(text, add_special_tokens=False) == sp.encode(text)
        assert t.decode(sp.encode(text)) == text
    assert t.encode("<s>x", add_special_tokens=False) == [sp.bos_id()] + sp.encode("x")


def test_merges_are_every_split_ranked_by_the_joined_score():
    tokens = ["a", "b", "c", "ab", "bc", "abc", "ca"]
    scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0, -0.5]
    assert spm_merges(tokens, scores) == [("c", "a"), ("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]


@pytest.mark.parametrize("scores", [None, -1000.0])
def test_scores_that_do_not_order_the_merges_are_refused_in_one_line(sp, tmp_path, scores):
    """No scores (llama.cpp reads 0 for each), or all -1000 (llama.cpp's converter given a
    tokenizer.json alone): llama.cpp merges equal scores leftmost first, which no ranking of
    merges reproduces, so text generation says so in one line."""
    path = write_gguf(sp, tmp_path / "noscores.gguf", scores=scores)
    f = GGUFFile(path)
    try:
        with pytest.raises(UnsupportedTokenizer, match="scores do not order its merges"):
            tokenizer_from_gguf(f)
    finally:
        f.close()
    tok, _, why = gguf_extras(path)
    assert tok is None and "\n" not in why and "share a score" in why


# -- export-gguf of a SentencePiece-style tokenizer.json ----------------------------------------

def hf_tokenizer(sp, kind: str):
    """The tokenizer.json a Llama / Mistral directory holds for sentencepiece model `sp`, built
    with `tokenizers` as transformers' converter builds it: `bpe`, its merges every split of a
    piece into two pieces, by piece score (`unigram`: the pieces with their scores); ▁ for
    spaces and one in front (normalizer), byte fallback, <s> put in front, the control and
    user-defined pieces as added tokens."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, normalizers, processors

    pieces = [sp.IdToPiece(i) for i in range(sp.vocab_size())]
    if kind == "bpe":
        vocab = {p: i for i, p in enumerate(pieces)}
        merges = [(p[:k], p[k:]) for i, p in sorted(enumerate(pieces), key=lambda ip: -sp.GetScore(ip[0]))
                  for k in range(1, len(p)) if p[:k] in vocab and p[k:] in vocab]
        model = models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    else:
        model = models.Unigram([(p, sp.GetScore(i)) for i, p in enumerate(pieces)], unk_id=sp.unk_id(),
                               byte_fallback=True)
    tok = HFTokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.add_tokens([AddedToken(t, normalized=False) for t in SYMBOLS])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", sp.bos_id())])
    return tok


TEMPLATE = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"


def model_dir(path, tok, vocab_size: int, config: dict | None = None):
    """A Mixtral-shaped random checkpoint with tokenizer `tok` and a Llama-style tokenizer_config
    (add_bos_token left out when `config` says nothing: the post-processor says it)."""
    from test_gguf import CONFIGS, random_checkpoint

    random_checkpoint(path, {**CONFIGS["mixtral"], "vocab_size": vocab_size})
    tok.save(str(path / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    return path


def llama_cpp_vocab(path):
    """libllama's tokenizer for the file (benchmarks/llamacpp.py's native build), or None where it is not built."""
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        import llamacpp

        if not llamacpp.is_built():
            return None
        from spm_tokenizer_vs_llamacpp import LlamaVocab
    except Exception:  # noqa: BLE001 - no build: the comparison is skipped
        return None
    return LlamaVocab(path)


@pytest.fixture(scope="module")
def unigram():
    return train("unigram", vocab_size=540)


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_export_writes_a_sentencepiece_tokenizer_that_reads_back(sp, unigram, kind, tmp_path):
    """export-gguf of a directory whose tokenizer.json is SentencePiece-style writes it as
    llama.cpp's converter writes a tokenizer.model (`llama`: pieces, scores, types, the space
    prefix, add_bos from the post-processor): moerun reads it back and encodes as the directory
    does (BPE; sentencepiece's ids too), and llama.cpp, where it is built, as moerun."""
    from moerun.loaders.gguf_write import export
    from moerun.tokenizer import Tokenizer

    model = sp if kind == "bpe" else unigram
    src = model_dir(tmp_path / "src", hf_tokenizer(model, kind), model.vocab_size())
    export(src, tmp_path / "m.gguf", "f32")
    f = GGUFFile(tmp_path / "m.gguf")
    try:
        assert f.get("tokenizer.ggml.model", "str") == "llama"
        tokens = f.get("tokenizer.ggml.tokens", "list[str]")
        types = f.get("tokenizer.ggml.token_type", "list[int]")
        scores = f.get("tokenizer.ggml.scores", "list[float]")
        assert f.get("tokenizer.ggml.add_space_prefix", "bool") and f.get("tokenizer.ggml.add_bos_token", "bool")
        assert f.get("tokenizer.chat_template", "str") == TEMPLATE
        back = tokenizer_from_gguf(f)
    finally:
        f.close()
    T = gguf.TokenType
    assert tokens == [model.IdToPiece(i) for i in range(model.vocab_size())]
    kinds = {"<unk>": T.UNKNOWN, "<s>": T.CONTROL, "</s>": T.CONTROL, "<tool>": T.USER_DEFINED, "<0x41>": T.BYTE,
             "e": T.NORMAL}
    assert {t: types[tokens.index(t)] for t in kinds} == kinds
    normal = [i for i in range(len(tokens)) if types[i] == T.NORMAL]
    if kind == "unigram":
        assert [scores[i] for i in normal] == [model.GetScore(i) for i in normal]
    else:  # the merged pieces in sentencepiece's order
        merged = [i for i in normal if len(tokens[i]) > 1]
        assert sorted(merged, key=lambda i: -scores[i]) == sorted(merged, key=lambda i: -model.GetScore(i))
    src_tok = Tokenizer(src)
    texts = [TEXT, "<s>Hello</s>", "a<tool>b</tool> c"] + TEXT.splitlines(keepends=True) + ["", " ", "\t", "🦊"]
    for text in texts:
        assert back.decode(back.encode(text)) == src_tok.decode(src_tok.encode(text)), repr(text)
    if kind == "bpe":
        for text in texts:
            # (a text that starts with <s> typed out: the directory's post-processor adds a second,
            # moerun's GGUF tokenizer, which adds BOS itself, none)
            assert back.encode(text) == src_tok.encode(text)[text.startswith("<s>"):], repr(text)
            if "<" not in text:
                assert back.encode(text) == [sp.bos_id()] + sp.encode(text), repr(text)
    lv = llama_cpp_vocab(tmp_path / "m.gguf")
    if lv is not None:
        for text in texts[1:]:  # (not a text that starts with <s> typed out: llama.cpp adds a second)
            if not text.startswith("<s>"):
                assert lv.tokenize(text) == back.encode(text), repr(text)


def test_export_refuses_a_bpe_whose_merges_llama_cpp_would_not_make(tmp_path):
    """A BPE merge list that is not every split of its pieces (here 'abc' is made from 'ab' + 'c'
    only, though 'a' + 'bc' are pieces too): llama.cpp, merging by score, would join 'a' 'bc'
    where this BPE never does, so the file would tokenize differently; refused in one line."""
    from tokenizers import Tokenizer as HFTokenizer, models, normalizers

    from moerun.errors import MoerunError
    from moerun.loaders.gguf_write import export

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", "\u2581", "a", "b", "c", "ab", "bc", "abc"])}
    tok = HFTokenizer(models.BPE(vocab, [("a", "b"), ("b", "c"), ("ab", "c")], unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    src = model_dir(tmp_path / "src", tok, 16)
    with pytest.raises(MoerunError, match="'abc' splits into pieces 'a' 'bc' that no merge joins") as e:
        export(src, tmp_path / "m.gguf", "f32")
    assert "\n" not in str(e.value) and not (tmp_path / "m.gguf").exists()


def test_a_unigram_vocabulary_is_tokenized_by_merging_not_by_viterbi(tmp_path):
    """Where moerun's tokenization of a unigram vocabulary differs from sentencepiece's (and the
    directory's `tokenizers` Unigram): a GGUF `llama` vocabulary is tokenized as llama.cpp does,
    by merging the adjacent pair whose joined piece scores highest, where a unigram model takes
    the segmentation of the highest total score (Viterbi). The two part in exactly two ways:
    (1) an early merge of a high-scoring pair blocks the best segmentation ('abc': '▁a' (-1)
    goes first, then '▁ab' (-1.5) beats 'bc' (-2), so merging ends at '▁ab' 'c', -11.5, where
    '▁a' 'bc' scores -3); (2) a piece that no two pieces join is never made by merging ('xyz':
    '▁xyz' has no split into two pieces, so merging leaves '▁' 'x' 'y' 'z'). llama.cpp, where it
    is built, gives moerun's ids."""
    from tokenizers import Tokenizer as HFTokenizer, models, normalizers

    from moerun.loaders.gguf_write import export
    from moerun.tokenizer import Tokenizer

    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0), ("\u2581", -10.0), ("a", -10.0), ("b", -10.0),
              ("c", -10.0), ("x", -10.0), ("y", -10.0), ("z", -10.0), ("\u2581a", -1.0), ("bc", -2.0),
              ("\u2581ab", -1.5), ("\u2581xyz", -1.0)]
    tok = HFTokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=False))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    src = model_dir(tmp_path / "src", tok, 16, {"add_bos_token": False})
    export(src, tmp_path / "u.gguf", "f32")
    f = GGUFFile(tmp_path / "u.gguf")
    try:
        back = tokenizer_from_gguf(f)
    finally:
        f.close()
    ids = {p: i for i, (p, _) in enumerate(pieces)}
    viterbi, merged = Tokenizer(src), {"abc": ["\u2581ab", "c"], "xyz": ["\u2581", "x", "y", "z"]}
    assert viterbi.encode("abc") == [ids["\u2581a"], ids["bc"]] and viterbi.encode("xyz") == [ids["\u2581xyz"]]
    for text, want in merged.items():
        assert back.encode(text) == [ids[p] for p in want]
    assert back.encode("ab xyzbc") == [ids[p] for p in ("\u2581ab", "\u2581", "x", "y", "z", "bc")]
    lv = llama_cpp_vocab(tmp_path / "u.gguf")
    if lv is not None:
        for text in ("abc", "xyz", "ab xyzbc"):
            assert lv.tokenize(text) == back.encode(text), text
