"""`specdecode certify` on tiny fp32 models: it passes on a correct engine and fails (exit 1) when the
verifier, the rollback or greedy agreement is broken."""

import json

import pytest
import torch

from specdecode import certify as cert
from specdecode.cli import main
from specdecode.sampling import SamplingParams


def run(tiny_dirs, capsys, *extra):
    target, draft = tiny_dirs
    code = main(
        [
            "certify",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--draws",
            "50000",
            "--max-new-tokens",
            "24",
            "--dtype",
            "fp32",
            "--json",
            *extra,
        ]
    )
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_certificate_passes_on_a_correct_engine(tiny_dirs, capsys, tmp_path):
    code, report = run(tiny_dirs, capsys, "--out", str(tmp_path / "cert"))
    assert code == 0 and report["passed"], json.dumps(report, indent=1)[:2000]
    assert {r["check"] for r in report["rollback"]} == {"chain rollback", "tree branch rollback"}
    assert all(r["max_abs_diff"] <= 1e-4 for r in report["rollback"])  # fp32: the bookkeeping is exact
    assert len(report["verifier"]) == len(cert.PROMPTS) * len(cert.SETTINGS)
    assert all(r["draws"] == 50000 for r in report["verifier"])
    # the controls have power on these rows: accepting every draft token is seen as wrong
    assert sum(r["control_informative"] for r in report["verifier"]) >= len(report["verifier"]) // 2
    assert {r["method"] for r in report["greedy"]} == {"draft", "pld", "tree", "auto"}
    assert (tmp_path / "cert" / "certificate.md").read_text().startswith("# specdecode certificate: PASSED")


def test_a_wrong_verifier_fails_the_certificate(tiny_dirs, capsys, monkeypatch):
    def accept_all(p, q, draft_tokens, generator=None):
        B, gamma = draft_tokens.shape
        return torch.full((B,), gamma), draft_tokens[:, -1]

    monkeypatch.setattr(cert, "verify", accept_all)
    code, report = run(tiny_dirs, capsys, "--methods", "pld")
    assert code == 1 and not report["passed"]
    assert any(not r["passed"] for r in report["verifier"])


def test_a_broken_rollback_fails_the_certificate(tiny_dirs, capsys, monkeypatch):
    from specdecode.backends import CachedLM

    real = CachedLM.rollback

    def sloppy(self, length, path=()):  # keeps the branch's tokens but not at their places
        real(self, length, sorted(path)[:1])
        if len(path) > 1:
            self.forward([self.ids[-1]] * (len(path) - 1))

    monkeypatch.setattr(CachedLM, "rollback", sloppy)
    code, report = run(tiny_dirs, capsys, "--methods", "pld")
    assert code == 1 and any(not r["passed"] for r in report["rollback"]), report["rollback"]


def test_chi_square_pools_rare_categories():
    probs = torch.tensor([0.5, 0.3, 0.2 - 1e-7, 1e-7])
    counts = torch.tensor([5000, 3000, 2000, 0])
    p, dof = cert.chi_square(counts, probs)
    assert p > 0.5 and dof == 2


def test_verifier_check_needs_bounded_support():
    from specdecode.errors import SpecDecodeError

    p = torch.full((cert.MAX_SUPPORT + 1,), 1.0 / (cert.MAX_SUPPORT + 1))
    with pytest.raises(SpecDecodeError, match="bounded support"):
        cert.check_verifier(p, p, 1000, torch.Generator().manual_seed(0))


def test_bad_methods_are_exit_2(tiny_dirs, capsys):
    target, draft = tiny_dirs
    assert main(["certify", "--target", str(target), "--methods", "autoregressive"]) == 2
    assert "unknown method" in capsys.readouterr().err


def test_settings_are_bounded():
    for s in cert.SETTINGS:
        assert isinstance(s, SamplingParams) and (s.top_k or s.top_p < 1)
