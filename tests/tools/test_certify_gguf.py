"""`specdecode certify` on llama.cpp: tiny random GGUFs of two architectures (Qwen2, Llama) in F32 and four
quantization types. The rollback check compares the engine's own cache after a rollback with the same text written
to the same cells of a fresh cache (LlamaLM.place_chain), bit for bit; a kept entry that is wrong fails it, and the
cells' own layout (a tree rollback leaves holes the next token fills) is reported apart."""

from __future__ import annotations

import ctypes

import pytest
import torch

from specdecode import Engine, certify as cert
from specdecode.sampling import SamplingParams
from tiny import byte_tokenizer

ARCHS = ("qwen2", "llama")
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q4_K_M": 15, "Q8_0": 7}  # name -> llama_ftype
PROMPT = "def binary_search(items, target):\n"


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """{(arch, type): path}: tiny GGUFs (hidden 256: K-quant rows are multiples of 256) in F32 and requantized."""
    pytest.importorskip("llama_cpp")
    from specdecode.backends.llamacpp.lm import _lib
    from tinygguf import write_tiny_gguf

    lc, d, out = _lib(), tmp_path_factory.mktemp("certify-gguf"), {}
    for arch in ARCHS:
        src = out[arch, "F32"] = write_tiny_gguf(d / f"{arch}-F32.gguf", 0, hidden=256, arch=arch)
        for name, ftype in TYPES.items():
            p = lc.llama_model_quantize_default_params()
            p.ftype, p.nthread = ftype, 1
            dst = out[arch, name] = d / f"{arch}-{name}.gguf"
            assert lc.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p)) == 0
    return out


def lm_on(path, exact: bool = False):
    from specdecode.backends.llamacpp import LlamaLM

    return LlamaLM(path, threads=1, exact=exact)


def rollback_checks(lm) -> dict:
    probe = list(PROMPT.encode())
    drafted = lm.forward(probe, last_only=True)[-1].topk(5).indices.tolist()
    return {r["check"]: r for r in cert.check_rollback(lm, probe, drafted)}


@pytest.mark.parametrize("qtype", list(TYPES))
@pytest.mark.parametrize("arch", ARCHS)
def test_certificate_passes_on_quantized_ggufs(ggufs, arch, qtype):
    """The whole certificate (rollbacks of target and draft, the verifier's draws, greedy agreement of three
    methods) on the engine's own contexts; the draft is the same file, so multi-token passes are accepted."""
    path = ggufs[arch, qtype]
    tok = byte_tokenizer()
    engine = Engine(lm_on(path), tok, lm_on(path), tok)
    assert engine.target.meta("general.architecture") == arch and engine.target.dtype == qtype
    report = cert.certify(
        engine,
        methods=["draft", "tree", "pld"],
        prompts=[PROMPT],
        settings=[SamplingParams(1.0, 20, 1.0)],
        draws=20000,
        max_new_tokens=16,
        progress=False,
    )
    assert report["passed"], cert.markdown({**report, "cpu": ""})
    assert len(report["rollback"]) == 4  # chain and tree, target and draft
    assert all(r["bit_identical"] and r["tolerance"] == 0 for r in report["rollback"])
    assert any(r["accepted"] > 0 for r in report["greedy"])
    assert "| layout effect | pass-size noise |" in cert.markdown({**report, "cpu": ""})


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_place_chain_writes_the_cells_a_tree_rollback_keeps(ggufs, arch, exact):
    """After a tree rollback and one more token, the cache serialised (its cells in cache order: positions, sequence
    ids, keys and values) is byte for byte the same-cells reference's: the rollback keeps the right entries. Only
    their cells differ from a contiguous cache's: the default context frees the rejected nodes' cells and the next
    token takes the first hole; exact mode parks them, and the next token goes after the branch."""
    lm = lm_on(ggufs[arch, "Q4_1"], exact=exact)
    P, root, t, nxt = list(b"def f(x):"), ord("\n"), list(b"abcde"), [ord(" ")]

    def state(write) -> tuple[bytes, torch.Tensor]:
        lm.reset()
        lm.forward(P, last_only=True)
        write()
        logits = lm.forward(nxt)[-1]
        return bytes(lm._text_state()), logits

    def tree():
        base = len(lm)
        lm.forward([root] + t, parents=[base - 1, base, base, base + 1, base + 1, base + 4])
        lm.rollback(base + 1, [base + 1, base + 4, base + 5])  # a, d, e: b and c rejected

    def contiguous():  # the same text, its fillers after it
        lm.forward([root, t[0], t[3], t[4], 1, 1])
        lm.rollback(len(P) + 4)

    kept, after = state(tree)
    assert lm.parked == (2 if exact else 0)
    same, same_after = state(lambda: lm.place_chain([root, t[0], t[3], t[4]], [0, 1, 4, 5], 6, 1))
    assert lm.parked == (2 if exact else 0)
    assert same == kept and torch.equal(same_after, after)
    other, _ = state(contiguous)
    assert (other == kept) == exact  # exact mode: the next token after the branch, as in a contiguous cache


def test_the_layout_effect_is_reported_apart(ggufs):
    """F32 models show the cells' layout in the logits (attention sums cells in cache order): the tree rollback
    differs from the same text in contiguous cells, yet equals the same-cells reference bit for bit. The chain
    rollback leaves no hole: no layout effect."""
    effects = []
    for arch in ARCHS:
        checks = rollback_checks(lm_on(ggufs[arch, "F32"]))
        assert all(r["passed"] and r["bit_identical"] for r in checks.values()), checks
        assert checks["chain rollback"]["layout_effect"] == 0
        effects.append(checks["tree branch rollback"]["layout_effect"])
    assert max(effects) > 0, effects  # the contiguous reference alone would have failed these at tolerance 0


def test_a_wrong_kept_entry_fails_the_rollback_check(ggufs, monkeypatch):
    """A rollback that leaves one rejected node visible to the text (it joins sequence 0) keeps a wrong entry: the
    next token attends to it, so the check fails, on a model whose layout and pass sizes move no bit."""
    from specdecode.backends.llamacpp import LlamaLM

    real = LlamaLM.rollback

    def leaky(self, length, path=()):
        if path:
            rejected = next(i for i in range(self.trunk, len(self.ids)) if i not in path)
            p = self._position(rejected)
            self._lc.llama_memory_seq_cp(self._mem, self._seq_of(rejected), self.seq0, p, p + 1)
        real(self, length, path)

    lm = lm_on(ggufs["llama", "Q4_1"])
    assert all(r["passed"] for r in rollback_checks(lm).values())
    monkeypatch.setattr(LlamaLM, "rollback", leaky)
    checks = rollback_checks(lm)
    tree = checks["tree branch rollback"]
    assert checks["chain rollback"]["passed"] and not tree["passed"] and tree["max_abs_diff"] > 0, checks
    assert tree["layout_effect"] == 0 and tree["pass_size_noise"] == 0


def test_certify_command_on_a_llama_q4_1_gguf(ggufs, capsys):
    """As a new user runs it: `specdecode certify --target <a Llama-architecture Q4_1 GGUF>` (no draft model)."""
    from specdecode.cli import main

    code = main(
        [
            "certify",
            "--target",
            str(ggufs["llama", "Q4_1"]),
            "--threads",
            "1",
            "--draws",
            "1000",
            "--max-new-tokens",
            "4",
            "--methods",
            "pld",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("# specdecode certificate: PASSED"), out
    assert "| target | tree branch rollback | 0.00e+00 | 0 |" in out
