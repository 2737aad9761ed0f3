"""MTP self-speculative decoding: greedy output identical to plain decoding, exact rollback,
the sampling distribution unchanged, and a clear error without an MTP head."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import moerun
from conftest import make_tokenizer, rel_err
from moerun.layers.cache import Cache, RecurrentState
from moerun.engine.generate import Sequence, run
from moerun.engine.sampling import SamplingParams, apply_repetition_penalty, filter_logits
from moerun.engine.speculative import SpeculativeDecoder, SpeculativeStats, run_speculative
from moerun.errors import MoerunError



def build_qwen(path, mtp=True, **overrides):
    """A tiny random qwen3_5_moe checkpoint (DeltaNet + attention) with a random MTP head."""
    from test_qwen3_5_moe import ReferenceMTP, make_reference

    ref = make_reference(**overrides)
    ref.save_pretrained(path)
    if mtp:
        torch.manual_seed(1)
        head = ReferenceMTP(ref.config, ref.config.layer_types.index("full_attention")).eval()
        with torch.no_grad():
            for p in head.parameters():
                p.normal_(0.0, 0.2)
        tensors = load_file(path / "model.safetensors")
        tensors.update({f"mtp.{k}": v.contiguous() for k, v in head.state_dict().items()})
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))
    return path


def load(path):
    llm = moerun.load(path, dtype="float32", threads=1)
    torch.set_num_threads(1)
    return llm


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """vocab 300 with a real tokenizer, so stop strings can be tested too."""
    path = tmp_path_factory.mktemp("qwen_mtp")
    build_qwen(path, vocab_size=300)
    make_tokenizer(path)
    return load(path)


def random_prompts(n, vocab, seed=0, max_len=20):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(1, max_len, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


class Oracle:
    """Replaces the MTP head's draft logits with the plain greedy continuation, wrong at about
    a quarter of the positions: acceptance runs long and rejections still happen, so EOS,
    stop strings and rollback land in the middle of accepted drafts."""

    def __init__(self, monkeypatch, sequences: dict[int, list[int]], vocab: int):
        self.sequences, self.vocab = sequences, vocab
        original = SpeculativeDecoder._mtp

        def _mtp(dec, hidden, tokens, slots):
            start = dec.mtp_cache.lengths[slots].clone()
            logits, h = original(dec, hidden, tokens, slots)
            logits = logits.clone()
            T, rows = tokens.shape[1], logits.shape[1]  # the last `rows` positions' logits
            for i, slot in enumerate(slots.tolist()):
                seq = self.sequences.get(slot, [])
                for t in range(T - rows, T):
                    pos = int(start[i]) + t + 2  # the position row t predicts
                    if pos < len(seq):
                        want = seq[pos] if (pos * 7 + slot) % 4 else (seq[pos] + 1) % self.vocab
                        logits[i, t - (T - rows)] = 0.0
                        logits[i, t - (T - rows), want] = 50.0
            return logits, h

        monkeypatch.setattr(SpeculativeDecoder, "_mtp", _mtp)


@pytest.mark.parametrize("draft_tokens,oracle", [(1, False), (3, False), (2, True), (4, True), ("auto", True)])
def test_greedy_identical(qwen, monkeypatch, draft_tokens, oracle):
    prompts = random_prompts(6, 300)
    plain = qwen.generate_ids(prompts, max_tokens=16, temperature=0.0)
    generated = qwen.last_stats.generated_tokens  # EOS included
    single = random_prompts(1, 300, seed=5)[0]
    plain_single = qwen.generate_ids([single], max_tokens=16, temperature=0.0)[0]
    if oracle:
        Oracle(monkeypatch, {b: p + o for b, (p, o) in enumerate(zip(prompts, plain))}, 300)
    spec = qwen.generate_ids(prompts, max_tokens=16, temperature=0.0, speculative="mtp", draft_tokens=draft_tokens)
    assert spec == plain
    stats = qwen.last_stats
    assert isinstance(stats, SpeculativeStats) and stats.generated_tokens == generated
    if oracle and draft_tokens != "auto":  # auto may choose plain steps on this model
        assert 0.4 < stats.acceptance_rate < 0.95 and stats.accepted_tokens_per_step > 1.5
    if oracle:
        Oracle(monkeypatch, {0: single + plain_single}, 300)
    assert qwen.generate_ids([single], max_tokens=16, temperature=0.0, speculative="mtp", draft_tokens=draft_tokens)[0] == plain_single


def test_eos_and_stop_strings_mid_draft(qwen, monkeypatch):
    prompts = random_prompts(4, 300, seed=1)
    plain = qwen.generate_ids(prompts, max_tokens=20, temperature=0.0)
    Oracle(monkeypatch, {b: p + o for b, (p, o) in enumerate(zip(prompts, plain))}, 300)
    # EOS: a token each plain continuation produces somewhere in its middle
    gen = dict(qwen.generation_config)
    try:
        tried = 0
        for b, out in enumerate(plain):
            if len(out) < 6:
                continue
            tried += 1
            qwen.generation_config = {**gen, "eos_token_id": out[len(out) // 2 + b % 2]}
            want = qwen.generate_ids([prompts[b]], max_tokens=20, temperature=0.0)[0]
            Oracle(monkeypatch, {0: prompts[b] + plain[b]}, 300)
            for n in (2, 4):
                got = qwen.generate_ids([prompts[b]], max_tokens=20, temperature=0.0, speculative="mtp", draft_tokens=n)[0]
                assert got == want and len(got) < len(out)
        assert tried >= 2
    finally:
        qwen.generation_config = gen
    # stop strings: text cut in the middle of the plain text
    for text in ["The quick brown", "def add(a, b):", "héllo"]:
        full = "".join(qwen.generate(text, max_tokens=24, temperature=0.0))
        ids = qwen.encode_prompt(text)
        Oracle(monkeypatch, {0: ids + qwen.tokenizer.encode(full)}, 300)
        stop = full[len(full) // 2 : len(full) // 2 + 2]
        if not stop.strip():
            continue
        want = "".join(qwen.generate(text, max_tokens=24, temperature=0.0, stop=[stop]))
        got = "".join(qwen.generate(text, max_tokens=24, temperature=0.0, stop=[stop], speculative="mtp", draft_tokens=3))
        assert got == want and len(want) < len(full)
        assert qwen.generate_batch([text], max_tokens=24, temperature=0.0, stop=[stop], speculative="mtp", draft_tokens=2) == [want]


def plain_cache(net, ids, max_len):
    """The cache a plain run leaves after `ids`: prefill the prompt part, then one token at a time."""
    cache = Cache(net.cache_spec(), 1, max_len, torch.float32)
    net(torch.tensor([ids[:3]]), cache)
    for t in ids[3:]:
        net(torch.tensor([[t]]), cache)
    return cache


@pytest.mark.parametrize("dtype,quant", [("bfloat16", None), ("float32", None), ("float32", "int4")])
def test_verification_pass_is_decode_steps_bit_for_bit(qwen, dtype, quant):
    """A pass over a few tokens gives at each position exactly the logits of decoding them one
    at a time (attention query by query, DeltaNet token by token, the native kernels row by
    row, float weights as packed ones), so greedy verification cannot flip a near-tie, in
    bf16 (the demo model's dtype), float32 and with the int4 kernels; greedy speculative
    output equals plain there too."""
    from moerun import kernels

    if dtype == "float32" and quant is None and not kernels.native():
        pytest.skip("float32 products are torch's without the native kernels (a row alone rounds differently)")
    llm = moerun.load(qwen.path, dtype=dtype, threads=1, quant=quant)
    torch.set_num_threads(1)
    net = llm.net
    ids = random_prompts(1, 300, seed=11, max_len=2)[0] + list(range(40, 50))
    with torch.inference_mode():
        one = Cache(net.cache_spec(), 1, 32, llm.dtype)
        net(torch.tensor([ids[:6]]), one)
        steps = torch.cat([net(torch.tensor([[t]]), one)[0] for t in ids[6:11]])
        many = Cache(net.cache_spec(), 1, 32, llm.dtype)
        for layer in many.layers:
            if isinstance(layer, RecurrentState):
                layer.positions = {}  # as verification runs: every token's state kept
        net(torch.tensor([ids[:6]]), many)
        passed = net(torch.tensor([ids[6:11]]), many)[0]
    assert torch.equal(passed, steps)
    prompts = random_prompts(6, 300, seed=12)
    plain = llm.generate_ids(prompts, max_tokens=16, temperature=0.0)
    assert llm.generate_ids(prompts, max_tokens=16, temperature=0.0, speculative="mtp", draft_tokens=3) == plain


def test_rollback_restores_plain_state(qwen, monkeypatch):
    """After speculation (with rejections) the trunk's KV and DeltaNet states, and the MTP
    head's cache, are those of a plain run over the same tokens."""
    net = qwen.net
    prompts = [p for p in random_prompts(8, 300, seed=2) if len(p) >= 3][:2]
    plain = qwen.generate_ids(prompts, max_tokens=13, temperature=0.0)
    Oracle(monkeypatch, {b: p + o for b, (p, o) in enumerate(zip(prompts, plain))}, 300)
    seqs = [Sequence(list(p), SamplingParams(max_tokens=13)) for p in prompts]
    dec = SpeculativeDecoder(net, torch.float32, draft_tokens=3)
    stats = SpeculativeStats()
    list(dec.run(seqs, set(), stats))
    assert [s.out_ids for s in seqs] == plain and 0 < stats.accepted < stats.drafted
    with torch.inference_mode():
        for b, s in enumerate(seqs):
            seq = s.prompt_ids + s.out_ids
            n = int(dec.cache.lengths[b])
            assert n in (len(seq) - 1, len(seq))
            ref = plain_cache(net, seq[:n], dec.cache.max_len)
            for i, layer in enumerate(ref.layers):
                if isinstance(layer, RecurrentState):
                    for name, t in layer.tensors.items():
                        assert rel_err(dec.cache.layers[i].tensors[name][b], t[0]) < 1e-5, (i, name)
            nxt = torch.tensor([[seq[n] if n < len(seq) else 0]])
            ours = net(nxt, dec.cache, torch.tensor([b]))
            assert rel_err(ours, net(nxt, ref)) < 1e-4
            # the MTP head: its cache plus the pending pairs give the uncached head's output
            hidden = net(torch.tensor([seq[:n]]), return_hidden=True)[1]
            want = net.mtp_logits(hidden, torch.tensor([seq[1:n] + [dec.pend_t[b][-1]]]))[:, -1]
            k = dec.pend_h[b].shape[0]
            dec.mtp_cache.lengths[b] = n - k
            got = dec._mtp(dec.pend_h[b][None], torch.tensor([dec.pend_t[b]]), torch.tensor([b]))[0][:, -1]
            assert rel_err(got, want) < 1e-4


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness-of-fit p-value; cells expected below 5 are pooled."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]).double()
    exp = torch.cat([expected[~small], expected[small].sum()[None]]).double()
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def _probs(logits: torch.Tensor, p: SamplingParams, history: list[int]) -> torch.Tensor:
    """The plain sampler's law for one row, from the torch reference ops."""
    return filter_logits(apply_repetition_penalty(logits.float()[None], [history], p.repetition_penalty), p).softmax(-1)[0]


@pytest.mark.parametrize("draft_vocab", [None, 9])
def test_sampling_distribution_unchanged(tmp_path, draft_vocab):
    """Tokens 2 and 3 (the first that speculation decides) follow the plain sampler's law,
    also when the drafter sees only part of the vocabulary."""
    params = dict(temperature=0.8, top_k=10, repetition_penalty=1.3)  # every part of the plain sampler
    V, R, prompt = 16, 800, [3, 5, 7]
    llm = load(build_qwen(tmp_path, vocab_size=V))
    net = llm.net
    p = SamplingParams(max_tokens=3, **params)
    # the exact distribution of tokens 2 and 3 under plain sampling, by enumeration
    with torch.inference_mode():
        first = net(torch.tensor([prompt]))[0, -1]
        p1 = _probs(first, p, prompt)
        two = torch.tensor([prompt + [a] for a in range(V)])
        p2_given = torch.stack([_probs(net(two[a : a + 1])[0, -1], p, two[a].tolist()) for a in range(V)])  # [a, b]
        p2 = p1 @ p2_given
        three = [prompt + [a, b] for a in range(V) for b in range(V)]
        logits3 = net(torch.tensor(three))[:, -1]
        p3_given = torch.stack([_probs(logits3[i], p, three[i]) for i in range(V * V)]).view(V, V, V)
        p3 = torch.einsum("a,ab,abc->c", p1, p2_given, p3_given)
    seqs = [Sequence(list(prompt), SamplingParams(max_tokens=3, seed=1000 + r, **params)) for r in range(R)]
    stats = SpeculativeStats()
    list(SpeculativeDecoder(net, torch.float32, draft_tokens=2, draft_vocab=draft_vocab).run(seqs, set(), stats))
    assert 0.05 < stats.acceptance_rate < 0.95  # both branches of the test ran
    outs = torch.tensor([s.out_ids for s in seqs])
    assert chi_square_p(torch.bincount(outs[:, 1], minlength=V).float(), p2) > 1e-3
    assert chi_square_p(torch.bincount(outs[:, 2], minlength=V).float(), p3) > 1e-3


@pytest.mark.parametrize("quant", [None, "int8"])
def test_draft_vocabulary_rows_and_output(qwen, monkeypatch, quant):
    """draft_vocab N: the draft head is the LM head's first N rows (views; its logits the full
    head's first N, bit for bit), drafts come from them only, and greedy output is the plain
    output; bad values are refused."""
    from moerun.engine.draft_extras import draft_head

    llm = qwen if quant is None else moerun.load(qwen.path, dtype="float32", threads=1, quant=quant)
    torch.set_num_threads(1)
    net = llm.net
    head = draft_head(net.lm_head, 120)
    h = torch.randn(3, net.args.hidden_size)
    with torch.inference_mode():
        assert torch.equal(head(h), net.lm_head(h)[:, :120])
    assert all(t.untyped_storage().data_ptr() == net.lm_head.state_dict()[k].untyped_storage().data_ptr()
               for k, t in head.state_dict().items() if t is not None)
    prompts = random_prompts(5, 300, seed=21)
    plain = llm.generate_ids(prompts, max_tokens=14, temperature=0.0)
    drafted = []
    original = SpeculativeDecoder._draft

    def spy(dec, *a, **k):
        out = original(dec, *a, **k)
        drafted.extend(t for row in out[0] for t in row)
        return out

    monkeypatch.setattr(SpeculativeDecoder, "_draft", spy)
    for n in (2, "auto"):
        assert llm.generate_ids(prompts, max_tokens=14, temperature=0.0, speculative="mtp", draft_tokens=n,
                                draft_vocab=120) == plain
        assert llm.last_stats.as_dict()["draft_vocab"] == 120
    assert drafted and max(drafted) < 120
    for bad in (0, 301, 2.5):
        with pytest.raises(MoerunError, match="draft_vocab must be 1..300"):
            llm.generate_ids(prompts[:1], max_tokens=2, speculative="mtp", draft_vocab=bad)


def test_without_mtp_head_is_a_clear_error(tmp_path, qwen):
    llm = load(build_qwen(tmp_path, mtp=False))
    with pytest.raises(MoerunError, match="multi-token-prediction head"):
        llm.generate_ids([[1, 2, 3]], max_tokens=4, speculative="mtp")
    with pytest.raises(MoerunError, match="unknown speculative"):
        qwen.generate_ids([[1, 2, 3]], max_tokens=4, speculative="ngram")
    with pytest.raises(MoerunError, match="draft_tokens"):
        qwen.generate_ids([[1, 2, 3]], max_tokens=4, speculative="mtp", draft_tokens=5)


def assert_last_only_is_the_last_row(net):
    """mtp_logits(last_only=True): the last position's logits and hidden state (its MoE run on
    that position alone; float32 matmuls of 2 and of 6 rows round apart: 1e-6), and the
    same cache entries for every position."""
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 3, net.args.hidden_size, generator=g)
    tokens = torch.randint(0, net.args.vocab_size, (2, 3), generator=g)
    caches = [Cache(net.mtp_cache_spec(), 2, 8, torch.float32) for _ in range(2)]
    with torch.inference_mode():
        full, h = net.mtp_logits(hidden, tokens, caches[0], return_hidden=True)
        last, h_last = net.mtp_logits(hidden, tokens, caches[1], return_hidden=True, last_only=True)
    assert last.shape == (2, 1, net.args.vocab_size) and h_last.shape == (2, 1, net.args.hidden_size)
    assert rel_err(last, full[:, -1:]) < 1e-6 and rel_err(h_last, h[:, -1:]) < 1e-6
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert all(torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values()) if torch.is_tensor(x))


def test_mtp_logits_last_only(qwen):
    assert_last_only_is_the_last_row(qwen.net)


def test_deepseek_v3_greedy_identical(tmp_path, monkeypatch):
    from test_deepseek_v3 import BASE, make_reference, randomize_routers, write_mtp_weights
    from transformers.modeling_layers import MtpModel

    ref = make_reference(num_mtp_layers=1)
    torch.manual_seed(1)
    mtp = MtpModel(ref, 1).eval()
    with torch.no_grad():
        for name, p in mtp.layers.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    randomize_routers(mtp)
    ref.save_pretrained(tmp_path)
    write_mtp_weights(mtp, tmp_path, BASE["num_hidden_layers"])
    llm = load(tmp_path)
    V = BASE["vocab_size"]
    assert_last_only_is_the_last_row(llm.net)
    prompts = random_prompts(5, V, seed=3)
    plain = llm.generate_ids(prompts, max_tokens=14, temperature=0.0)
    assert llm.generate_ids(prompts, max_tokens=14, temperature=0.0, speculative="mtp", draft_tokens=2) == plain
    Oracle(monkeypatch, {b: p + o for b, (p, o) in enumerate(zip(prompts, plain))}, V)
    assert llm.generate_ids(prompts, max_tokens=14, temperature=0.0, speculative="mtp", draft_tokens=3) == plain
    assert llm.last_stats.acceptance_rate > 0.4


@pytest.mark.parametrize("rows", [3, 1])
def test_plain_steps_backlog_fed_before_drafting(qwen, monkeypatch, rows):
    """A run of plain steps ("auto" choosing N=0) leaves the MTP head its pending pairs;
    before the next drafting step the backlog is fed apart (`_feed_backlog`), all but its
    last pair, so the drafting step's own catch-up is at most a drafting step's pairs. The
    output stays plain greedy's."""
    from moerun.engine import speculative
    from moerun.engine.speculative import DraftLength

    class PlainThenTwo(DraftLength):  # 12 plain steps, then two drafts a step
        def choose(self):
            self.steps += 1
            return 0 if self.steps <= 12 else 2

    fed = []  # (pairs a row gave the head in one call, whether it was a backlog's)
    original = SpeculativeDecoder._feed

    def _feed(dec, rows_, pend_h, pend_t, keep=0):
        fed.extend((pend_h[b].shape[0] - keep, keep == 1) for b in rows_)
        return original(dec, rows_, pend_h, pend_t, keep)

    monkeypatch.setattr(SpeculativeDecoder, "_feed", _feed)
    prompts = random_prompts(rows, 300, seed=3, max_len=4)
    plain = [Sequence(p, SamplingParams(max_tokens=24, temperature=0.0)) for p in prompts]
    list(run(qwen.net, plain, set(), qwen.dtype))  # no EOS: every row runs all 24 steps
    seqs = [Sequence(p, SamplingParams(max_tokens=24, temperature=0.0)) for p in prompts]
    list(run_speculative(qwen.net, seqs, set(), qwen.dtype, draft_tokens="auto", chooser=PlainThenTwo()))
    assert [s.out_ids for s in seqs] == [s.out_ids for s in plain]
    most = speculative.MAX_DRAFT_TOKENS + 1  # what a drafting step leaves pending
    assert all(c <= most for c, backlog in fed if not backlog)
    assert any(backlog and c >= 12 for c, backlog in fed)  # the plain run's backlog, fed apart


def test_a_rows_plain_steps_count_its_experts_and_steps(qwen):
    """One row's plain steps ("auto" choosing N=0 throughout): each counted as a step of its
    own, one token's expert bytes each, and priced by its own time."""
    from moerun.engine.speculative import DraftLength

    class Plain(DraftLength):
        def choose(self):
            self.steps += 1
            return 0

    prompt = random_prompts(1, 300, seed=4, max_len=4)
    plain = [Sequence(prompt[0], SamplingParams(max_tokens=40, temperature=0.0))]
    list(run(qwen.net, plain, set(), qwen.dtype))
    seq = Sequence(prompt[0], SamplingParams(max_tokens=40, temperature=0.0))
    stats, chooser = SpeculativeStats(), Plain()
    list(run_speculative(qwen.net, [seq], set(), qwen.dtype, stats, draft_tokens="auto", chooser=chooser))
    assert seq.out_ids == plain[0].out_ids
    steps = 40 - 1  # the first token comes from the prompt's pass
    assert stats.draft_hist == {0: steps} and stats.decode_steps == steps and chooser.steps == steps
    assert stats.single_token_expert_bytes > 0
    assert stats.verify_expert_bytes == steps * stats.single_token_expert_bytes
    assert 0 in chooser.step_s  # priced by its own steps


def test_auto_draft_length_shrugs_off_a_preempted_step():
    """Step times are priced by the median of the last few: one step that a shared machine
    stalled for 10x its time does not move the choice (an average carried it for many steps)."""
    from moerun.engine.speculative import DraftLength

    d = DraftLength(explore_every=10**9)
    d.accept = [0.9, 0.8, 0.3, 0.2]
    for _ in range(5):
        for n in range(5):
            d.observe_time(n, 1.0 + 0.1 * n)
    assert d.best() == 2
    d.observe_time(2, 12.0)  # preempted
    assert d.best() == 2 and d.step_s[2] == pytest.approx(1.2)
    for _ in range(DraftLength.TIME_WINDOW):  # a lasting change does move it, within a window
        d.observe_time(2, 12.0)
    assert d.best() != 2


def test_auto_draft_length_follows_acceptance_and_cost():
    from moerun.engine.speculative import DraftLength

    d = DraftLength(explore_every=10**9)
    chosen = []
    for _ in range(2):  # N = 0 and 1 are measured first; each draft adds a tenth of a plain step
        chosen.append(d.choose())
        d.observe_time(chosen[-1], 1.0 + 0.1 * chosen[-1])
    assert chosen == [0, 1]
    assert d.step_time(3) == pytest.approx(1.3)  # unmeasured: along the line through N = 0 and 1
    for _ in range(200):  # (the acceptance EMAs average ~30 drafts)
        d.update(4, 4)
    assert d.choose() == 4
    for _ in range(200):
        d.update(4, 0)
    assert d.choose() == 0  # drafts never accepted: plain steps
    for _ in range(200):
        d.update(4, 2)  # drafts 1 and 2 accepted, 3 rejected
    assert d.choose() == 2
    for _ in range(20):  # experts far away (waits included in the times): a long pass costs more than it returns
        for n in (2, 3, 4):
            d.observe_time(n, 4.0)
        d.observe_time(1, 1.5)
    assert d.choose() == 1


def test_auto_explores_the_neighbours_of_the_best():
    """Every `explore_every` steps "auto" tries a neighbour of its best N, alternately above
    and below (above only from plain steps), so that their figures stay current."""
    from moerun.engine.speculative import DraftLength

    d = DraftLength(explore_every=4)
    for n in range(5):
        d.observe_time(n, 1.0 + 0.1 * n)
    for _ in range(200):
        d.update(4, 2)
    chosen = [d.choose() for _ in range(16)]
    assert chosen == [2, 2, 2, 1, 2, 2, 2, 3, 2, 2, 2, 1, 2, 2, 2, 3]
    for _ in range(200):
        d.update(4, 0)
    assert {d.choose() for _ in range(8)} == {0, 1}


def test_short_conv_and_delta_rule_passes_match_long_ones():
    """Verification runs DeltaNet on 2..5 tokens at a time (conv by windows, the delta rule
    token by token) and keeps the state after every token for rollback."""
    from moerun.kernels import reference
    from moerun.layers import deltanet

    torch.manual_seed(0)
    x, w = torch.randn(2, 23, 10), torch.randn(10, 1, 4)
    want, _ = reference.causal_conv1d(x, w)
    cuts = [(0, 3), (3, 8), (8, 9), (9, 13), (13, 23)]
    ys, state = [], None
    for a, b in cuts:
        y, every = reference.causal_conv1d(x[:, a:b], w, state, every_state=True)
        for t in range(b - a):  # the state after token t is what a pass ending there leaves
            assert torch.equal(every[:, t], reference.causal_conv1d(x[:, a : a + t + 1], w, state)[1])
        ys.append(y)
        state = every[:, -1]
    assert rel_err(torch.cat(ys, 1), want) < 1e-6
    q, k = torch.randn(2, 23, 2, 8), torch.randn(2, 23, 2, 8)
    v, g, beta = torch.randn(2, 23, 4, 6), -torch.rand(2, 23, 4), torch.rand(2, 23, 4)
    o_want, s_want = deltanet.chunk_gated_delta_rule(q, k, v, g, beta)
    outs, s = [], torch.zeros(2, 4, 8, 6)
    for a, b in cuts:
        part = [t[:, a:b] for t in (q, k, v, g, beta)]
        if b - a > reference.FEW:
            o, s = deltanet.chunk_gated_delta_rule(*part, s)
        else:
            o, states = reference.recurrent_gated_delta_steps(*part, s)
            one = s.clone()
            for t in range(b - a):  # bit for bit the one-token decode step, state by state
                o1, one = reference.recurrent_gated_delta_step(*[p[:, t : t + 1] for p in part], one)
                assert torch.equal(o1[:, 0], o[:, t]) and torch.equal(one, states[:, t])
            s = states[:, -1]
        outs.append(o)
    assert rel_err(torch.cat(outs, 1), o_want) < 1e-5 and rel_err(s, s_want) < 1e-5


def test_with_expert_store_at_half_the_experts(qwen, monkeypatch):
    """Experts behind the store (half of them in RAM): same greedy text, expert bytes still counted."""
    from moerun.experts import StoreOptions
    from moerun.experts import load as load_with_store

    llm = load_with_store(qwen.path, dtype="float32", threads=1, options=StoreOptions(ram_budget="50%"))
    torch.set_num_threads(1)
    try:
        prompts = random_prompts(3, 300, seed=4)
        plain = qwen.generate_ids(prompts, max_tokens=12, temperature=0.0)
        Oracle(monkeypatch, {b: p + o for b, (p, o) in enumerate(zip(prompts, plain))}, 300)
        before = llm.store.stats()
        assert llm.generate_ids(prompts, max_tokens=12, temperature=0.0, speculative="mtp", draft_tokens=3) == plain
        stats, after = llm.last_stats, llm.store.stats()
        qwen.generate_ids(prompts[:1], max_tokens=4, temperature=0.0, speculative="mtp", draft_tokens=3)
        assert stats.single_token_expert_bytes == qwen.last_stats.single_token_expert_bytes > 0  # as with experts in RAM
        assert stats.verify_expert_bytes > 0
        # expert-aware drafting: the drafts' layer-0 experts were hinted and some of them used
        assert stats.prefetch and after["prefetch_issued"] > before["prefetch_issued"]
        assert after["prefetch_used"] > before["prefetch_used"]
        moved = after["tiers"]["disk"]["bytes_read"] - before["tiers"]["disk"]["bytes_read"]
        assert 0 < stats.moved_expert_bytes <= moved and stats.as_dict()["moved_expert_bytes_per_token"] > 0  # decode only
        # without the hints: same text, nothing hinted
        before = llm.store.stats()
        seqs = [Sequence(list(p), llm.sampling_params(max_tokens=12, temperature=0.0)) for p in prompts]
        stats = SpeculativeStats()
        list(run_speculative(llm.net, seqs, llm.eos_ids(), llm.dtype, stats, draft_tokens="auto", prefetch=False))
        assert [s.out_ids for s in seqs] == plain and not stats.prefetch
        assert llm.store.stats()["prefetch_issued"] == before["prefetch_issued"]
    finally:
        llm.store.close()


def test_int4_experts_greedy_identical_and_counted(tmp_path, qwen):
    """Quantized routed experts (QuantizedExperts, native kernels) are drop-ins the tracker counts."""
    llm = moerun.load(qwen.path, dtype="float32", threads=1, quant="int4")
    torch.set_num_threads(1)
    prompts = random_prompts(3, 300, seed=6)
    plain = llm.generate_ids(prompts, max_tokens=10, temperature=0.0)
    assert llm.generate_ids(prompts, max_tokens=10, temperature=0.0, speculative="mtp", draft_tokens=2) == plain
    stats = llm.last_stats
    assert stats.single_token_expert_bytes > 0 and stats.verify_expert_bytes >= stats.single_token_expert_bytes


def test_expert_tracker_counts_the_union_per_module():
    """A pass's routed-expert bytes are each Experts module's union of ids times one expert's
    bytes; one token's are K experts per module; a draft pass counts apart, and calls outside
    a pass count nowhere."""
    from moerun.engine.draft_extras import ExpertTracker
    from moerun.layers.moe import Experts

    net = torch.nn.ModuleList([Experts(8, 4, 2), Experts(8, 4, 2)])
    for p in net.parameters():
        torch.nn.init.normal_(p)
    per = 3 * 4 * 2 * 4  # gate, up, down of [2, 4] float32
    tracker = ExpertTracker(net)
    x, w = torch.randn(3, 4), torch.full((3, 2), 0.5)
    try:
        net[0](x, torch.tensor([[0, 1], [1, 2], [2, 0]]), w)  # not in a pass
        tracker.start_pass("verify")
        net[0](x, torch.tensor([[0, 1], [1, 2], [2, 0]]), w)  # union {0, 1, 2}
        net[1](x, ids=torch.tensor([[5, 5], [5, 5], [7, 5]]), weights=w)  # {5, 7}
        tracker.end_pass()
        assert tracker.pass_bytes == 5 * per and tracker.token_bytes == 2 * 2 * per
        tracker.start_pass("draft")
        net[1](x[:1], torch.tensor([[3, 4]]), w[:1])
        tracker.end_pass()
        assert tracker.bytes == {"verify": 5 * per, "draft": 2 * per} and tracker.pass_bytes == 5 * per
        # a new tracker while this one lingers (a run dropped unfinished): closing the old one
        # leaves the new one counting
        newer = ExpertTracker(net)
        tracker.close()
        newer.start_pass("verify")
        net[0](x, torch.tensor([[3, 4], [3, 4], [3, 4]]), w)
        newer.end_pass()
        assert newer.pass_bytes == 2 * per
        newer.close()
        assert not any("routes_seen" in m.__dict__ for m in net)
    finally:
        tracker.close()
    bare = ExpertTracker(torch.nn.Linear(4, 4))  # no experts at all: passes count nothing
    bare.start_pass("verify")
    bare.end_pass()
    assert bare.pass_bytes == bare.token_bytes == 0 and bare.bytes == {"verify": 0, "draft": 0}


def test_roll_back_restores_the_kept_state_of_a_slot():
    """RecurrentState.roll_back: slot <- the state kept after token keep - 1 of a row, as numpy
    copies for float32 states and through set_slot for others (a bf16 one here); other slots
    and the kept states untouched."""
    from moerun.layers.cache import StateSpec

    spec = StateSpec(shapes=(("a", (2, 3)), ("b", (4,))), dtypes=(("a", torch.float32),))
    st = RecurrentState(spec, 3, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for t in st.tensors.values():
        t.copy_(torch.randn(t.shape, generator=g))
    before = {n: t.clone() for n, t in st.tensors.items()}
    every = {"a": torch.randn(2, 4, 2, 3, generator=g), "b": torch.randn(2, 4, 4, generator=g).to(torch.bfloat16)}
    st.positions = {n: t.clone() for n, t in every.items()}
    st.roll_back(slot=2, row=1, keep=3)
    for n, t in st.tensors.items():
        assert torch.equal(t[2], every[n][1, 2])
        assert torch.equal(t[:2], before[n][:2])
        assert torch.equal(st.positions[n], every[n])


def test_bf16_batch_of_many_rows_greedy_identical():
    """The demo model in bf16, ten rows verified together (more than 16 tokens a pass): each
    verification pass's MoE half runs natively as a decode step does, so greedy speculative
    output equals plain batched decoding, which equals each row alone (in bf16 a near-tie
    flipped two rows when such a pass fell to torch's ops)."""
    llm = moerun.load(None, threads=1)  # the demo model, bf16
    assert llm.dtype == torch.bfloat16
    prompts = [torch.randint(0, llm.args.vocab_size, (20 + 7 * i,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(10)]
    kw = dict(max_tokens=24, temperature=0.0, repetition_penalty=1.0)
    plain = llm.generate_ids(prompts, **kw)
    assert plain == [llm.generate_ids([p], **kw)[0] for p in prompts]
    assert llm.generate_ids(prompts, speculative="mtp", draft_tokens=1, **kw) == plain
