"""GGUF files an engine can read: which tensor types a file holds, and an F16 rewrite of a file whose
quantization an engine's reader refuses (OpenVINO GenAI's GGUF reader takes F32 / F16 / Q8_0 /
Q4_0 / Q4_1 tensors; the embedded Qwen2.5-Coder file is Q4_K_M).

The rewrite keeps every metadata key/value pair (architecture, RoPE, tokenizer vocabulary, merges,
chat template) as the source has it, except `general.file_type` (then MOSTLY_F16), and writes each
tensor de-quantized by the `gguf` package's own reference de-quantizers: F16 for matrices, F32 for
vectors (norm weights, biases), as llama.cpp's converter does. No weight changes beyond the one
F16 rounding of the de-quantized value, and the file is written to a temporary name first and
renamed into place, so an interrupted rewrite leaves no file behind.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize

# Header fields of the reader that the writer writes itself.
_HEADER = ("GGUF.", "general.architecture")


def tensor_types(path: str | Path) -> set[str]:
    """The GGML types of the tensors in the GGUF file `path` (`{"Q4_K", "Q6_K", "F32"}`)."""
    return {t.tensor_type.name for t in GGUFReader(str(path)).tensors}


def field_value(field) -> tuple[object, GGUFValueType, GGUFValueType | None]:
    """(value, type, array item type) of one metadata field of a `GGUFReader`."""
    vtype = field.types[0]
    sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
    return field.contents(), vtype, sub


def metadata(reader: GGUFReader) -> dict[str, tuple[object, GGUFValueType, GGUFValueType | None]]:
    """The key/value pairs of `reader` but the header's, as `field_value` gives them."""
    return {k: field_value(f) for k, f in reader.fields.items() if not k.startswith(_HEADER)}


def copy_metadata(
    source: GGUFReader | dict, writer: GGUFWriter, skip: Iterable[str] = (), **overrides
) -> None:
    """Every key/value pair of `source` (a reader, or `metadata`'s dict) into `writer` but the
    header's and `skip`; `overrides` (key=(value, GGUFValueType)) replace or add pairs."""
    pairs = metadata(source) if isinstance(source, GGUFReader) else source
    skip = set(skip) | set(overrides)
    for key, (value, vtype, sub) in pairs.items():
        if key not in skip:
            writer.add_key_value(key, value, vtype, sub)
    for key, (value, vtype) in overrides.items():
        writer.add_key_value(key, value, vtype)


def architecture(reader: GGUFReader) -> str:
    return str(reader.fields["general.architecture"].contents())


def write_gguf(dst: str | Path, arch: str, fill) -> Path:
    """Write a GGUF file at `dst` through a temporary name: `fill(writer)` adds metadata and tensors."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    os.close(fd)
    try:
        writer = GGUFWriter(tmp, arch)
        fill(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 -> what a plain new file gets
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dst


def rewrite_f16(src: str | Path, dst: str | Path) -> Path:
    """`src` rewritten at `dst` with every tensor de-quantized: matrices as F16, vectors as F32
    (see the module doc); metadata as in `src`, `general.file_type` = MOSTLY_F16."""
    reader = GGUFReader(str(src))

    def fill(writer: GGUFWriter) -> None:
        copy_metadata(
            reader, writer, **{"general.file_type": (int(LlamaFileType.MOSTLY_F16), GGUFValueType.UINT32)}
        )
        for t in reader.tensors:
            # GGUF lists dimensions innermost first; numpy wants them outermost first.
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                values = np.asarray(t.data).reshape(shape)
            else:
                values = dequantize(t.data, t.tensor_type).reshape(shape)
            writer.add_tensor(t.name, values.astype(np.float16 if len(shape) > 1 else np.float32))

    return write_gguf(dst, architecture(reader), fill)
