"""A draft with a truncated output layer (FR-Spec): same output, q zero outside the kept tokens."""

import pytest
import torch

from helpers import CHEAP
from specdecode import Engine, SpecDecodeError
from specdecode.drafters import build_datastore, tokenizer_fingerprint
from tiny import byte_tokenizer

TEXT = "def add(a, b):\n    return a + b\n\nhello world, hello there\n" * 4


@pytest.fixture
def engine(tmp_path, make_engine):
    tok = byte_tokenizer()
    build_datastore(
        [tok(TEXT, add_special_tokens=False)["input_ids"]],
        tmp_path / "ds",
        tokenizer_fingerprint(tok),
        vocab_size=len(tok.get_vocab()),
        progress=False,
    )
    return make_engine(tokenizer=tok, datastore=str(tmp_path / "ds"), costs=CHEAP, progress=False)


def test_truncated_draft_keeps_greedy_output_and_proposes_only_kept_tokens(engine):
    prompts = ["def add(a, b):", "hello world", "zzz"]
    plain = {p: engine.generate(p, method="autoregressive", max_new_tokens=40).token_ids for p in prompts}
    full_logits = engine.draft_model.root(engine.encode("hello"))[0]
    engine.draft_model.reset()
    kept = engine.truncate_draft_vocab(12)
    keep = engine.draft_model.keep
    assert kept == len(keep) >= 12 and engine.draft_model.lm.model.get_output_embeddings().weight.shape[0] == kept
    logits = engine.draft_model.root(engine.encode("hello"))[0]
    engine.draft_model.reset()
    assert logits.shape == full_logits.shape
    outside = torch.ones(len(logits), dtype=torch.bool)
    outside[keep] = False
    assert torch.isinf(logits[outside]).all() and (logits[outside] < 0).all()
    assert torch.allclose(logits[keep], full_logits[keep], atol=1e-5)  # the kept rows compute as before
    for method in ("draft", "tree", "auto"):
        for p in prompts:
            out = engine.generate(p, method=method, max_new_tokens=40)
            assert out.token_ids == plain[p], (method, p)
    drafted = engine.generate("zzz", method="draft", gamma=4, max_new_tokens=40)
    assert drafted.stats.drafted > 0
    with pytest.raises(SpecDecodeError, match="truncated already"):
        engine.truncate_draft_vocab(5)


def test_draft_vocab_errors(tmp_path, tiny_dirs, make_engine):
    with pytest.raises(SpecDecodeError, match="needs a draft model"):
        make_engine(draft=None).truncate_draft_vocab(10, str(tmp_path))
    with pytest.raises(SpecDecodeError, match="needs token frequencies"):
        make_engine().truncate_draft_vocab(10)
    from tinygguf import write_tiny_gguf

    target, draft = tiny_dirs
    for kw, msg in (
        (dict(draft_vocab=0, datastore=str(tmp_path)), "positive"),
        (dict(draft_vocab=10), "needs token frequencies"),
    ):
        with pytest.raises(SpecDecodeError, match=msg):
            Engine.load(str(target), str(draft), **kw)
    gguf = str(write_tiny_gguf(tmp_path / "d.gguf", 1))  # a GGUF draft runs on llama.cpp (backend auto)
    with pytest.raises(SpecDecodeError, match="torch backend"):
        Engine.load(gguf, gguf, draft_vocab=10, datastore=str(tmp_path))


def test_llama_draft_cannot_be_truncated():
    from specdecode.backends import LM
    from specdecode.drafters import DraftModel

    class FakeLM(LM):  # an LM with the protocol's defaults: no HF model behind it (as llama.cpp's)
        vocab_size, max_length = 10, 100

        def forward(self, *a, **k):
            pass

        def rollback(self, *a):
            pass

    with pytest.raises(SpecDecodeError, match="torch backend"):
        DraftModel(FakeLM(), 10).truncate([1, 2])


def test_datastore_frequencies(tmp_path):
    from specdecode.drafters import Datastore

    build_datastore([[1, 2, 2, 3, 3, 3], [3, 4]], tmp_path / "ds", "fp", vocab_size=6, progress=False)
    ds = Datastore(tmp_path / "ds", "fp")
    assert ds.frequencies().tolist() == [0, 1, 2, 4, 1, 0]
    assert (tmp_path / "ds" / "frequencies.npy").is_file() and ds.frequencies().tolist() == [0, 1, 2, 4, 1, 0]
    assert ds.top_tokens(3) == [3, 2, 1]
    with pytest.raises(SpecDecodeError):
        ds.top_tokens(0)
