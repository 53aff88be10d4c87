"""Load a Hugging Face Llama folder (or hub repo id) into a ``Llama`` model.

Weights come only from safetensors (memory-mapped, converted straight to the target
dtype); pickle checkpoints (``.bin``/``.pth``) are refused, never unpickled. Every
expected key must be present with the expected shape, and nothing unexpected may be
left over; a mismatch names the tensor and both shapes.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minillama.errors import UserError, shown
from minillama.model.config import LlamaConfig
from minillama.model.llama import Llama
from minillama.model.rope import inverse_frequencies
from minillama.model.tokenizer import Tokenizer, load_tokenizer, read_json

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HUB_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


@dataclass
class LoadedModel:
    model: Llama
    tokenizer: Tokenizer
    config: LlamaConfig
    path: Path
    generation_config: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what loading changed, one line each (weights/gguf.py)

    @property
    def name(self) -> str:
        return self.path.name

    def stop_ids(self) -> set[int]:
        """End-of-sequence and end-of-turn ids (generation_config, config, the tokenizer's eos and
        the turn ends of the common templates): where generate and chat stop, as llama.cpp does."""
        ids: set[int] = set()
        for source in (self.generation_config.get("eos_token_id"), self.config.eos_token_id):
            ids |= {
                i
                for i in (source if isinstance(source, list) else [source])
                if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.config.vocab_size
            }
        tok = self.tokenizer
        for name in (tok.eos_token, "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>"):
            if name in tok.specials:
                ids.add(tok.specials[name])
        return ids


def resolve_model_path(name: str) -> Path:
    """A local folder as is; otherwise a hub repo id downloaded into the HF cache."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"{name} is a file: --model takes a model folder or a Hugging Face repo id")
        return path
    if not _REPO_ID.match(name):
        raise UserError(f"no model folder {name!r}: give an existing folder or a Hugging Face repo id like org/name")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, allow_patterns=HUB_FILES, token=os.environ.get("HF_TOKEN")))
    except Exception as e:  # offline, unknown repo, gated repo: all end the same way for the user
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"could not get {name!r} from the Hugging Face hub ({type(e).__name__}: {reason[:160]}); "
            "check the repo id, your network and HF_TOKEN, or pass a local model folder"
        ) from None


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = read_json(index)["weight_map"]
            shards = sorted(set(weight_map.values()))
            if not shards or not all(isinstance(s, str) and s and Path(s).name == s for s in shards):
                raise ValueError("weight_map must map tensor names to shard file names in this folder")
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise UserError(f"{index} is not a valid safetensors index ({type(e).__name__}: {str(e)[:100]})") from None
        return [folder / s for s in shards]
    if (folder / "model.safetensors").exists():
        return [folder / "model.safetensors"]
    pickles = [p.name for p in folder.iterdir() if p.suffix in (".bin", ".pth", ".pt", ".ckpt")]
    if pickles:
        raise UserError(
            f"{folder} only has pickle checkpoints ({', '.join(sorted(pickles))}); minillama never unpickles "
            "weights: convert them to model.safetensors first"
        )
    raise UserError(f"{folder} has no model.safetensors or model.safetensors.index.json")


def header_shapes(files: list[Path]) -> dict[str, list[int]] | None:
    """Every tensor's shape from the safetensors files' headers (no tensor read); None when a file
    cannot be read (read_state_dict then names it)."""
    from safetensors import safe_open

    shapes = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                shapes.update({key: sf.get_slice(key).get_shape() for key in sf.keys()})
        except Exception:
            return None
    return shapes


def check_layer_count(cfg: LlamaConfig, shapes: dict[str, list[int]]) -> None:
    """The layers config.json names are the layers the weights hold, checked from the files' headers
    before any module is built: a config that asks for 100,000 layers is refused at once, not after
    building them."""
    held = {int(m.group(1)) for key in shapes if (m := re.match(r"model\.layers\.(\d+)\.", key))}
    if held and held != set(range(cfg.num_hidden_layers)):
        raise UserError(
            f"config.json has num_hidden_layers={cfg.num_hidden_layers}, the weights hold layers "
            f"{min(held)}..{max(held)} ({len(held)}): the config does not belong to these weights"
        )


def check_weights_fit(shapes: dict[str, list[int]], dtype: torch.dtype, device: str) -> None:
    """The weights as `dtype` against the free memory, from the files' headers: a model too big for
    this machine is refused in one line, not ended by the allocator."""
    from minillama.kv.memory import check_fits

    size = torch.empty((), dtype=dtype).element_size()
    check_fits(sum(map(math.prod, shapes.values())) * size, f"the model's weights in {dtype}".replace("torch.", ""),
               device, "use --dtype bfloat16, a smaller model, or free some memory")  # fmt: skip


def read_state_dict(files: list[Path], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    state = {}
    for f in files:
        if not f.exists():
            raise UserError(f"weight shard {f} is missing")
        try:
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():
                    state[key] = sf.get_tensor(key).to(dtype)
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"{f} is not a readable safetensors file ({str(e).splitlines()[0][:160]})") from None
    return state


def check_state_dict(model: Llama, state: dict[str, torch.Tensor]) -> None:
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
        state.pop("lm_head.weight", None)  # some tied checkpoints carry a redundant copy
    missing = sorted(set(expected) - set(state))
    if missing:
        raise UserError(f"checkpoint is missing {len(missing)} tensor(s), first {missing[0]!r}")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise UserError(f"checkpoint has unexpected tensor {unexpected[0]!r} (and {len(unexpected) - 1} more)")
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            raise UserError(
                f"shape mismatch for {key}: checkpoint has {tuple(state[key].shape)}, config expects {shape}"
            )


def check_device(name: str) -> torch.device:
    """The device `name` names, when torch knows it and this machine has it; a UserError otherwise."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise UserError(f"unknown device {shown(name)}: use cpu, or cuda / cuda:N on a machine with a GPU") from None
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"device {shown(name)} is not supported: minillama runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {shown(name)} was asked for but no CUDA GPU is available: use --device cpu")
    return device


def load_model(name: str, dtype: str | torch.dtype = "float32", device: str = "cpu") -> LoadedModel:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise UserError(f"unknown dtype {shown(dtype)}: choose one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    check_device(str(device))
    folder = resolve_model_path(name)
    cfg = LlamaConfig.from_file(folder / "config.json")
    files = weight_files(folder)
    shapes = header_shapes(files)
    if shapes is not None:  # an unreadable file is named by read_state_dict
        check_layer_count(cfg, shapes)
        check_weights_fit(shapes, dtype, str(device))
    with torch.device("meta"):
        model = Llama(cfg)
    state = read_state_dict(files, dtype)
    check_state_dict(model, state)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.inv_freq = inverse_frequencies(cfg)
    model = model.to(device).eval().requires_grad_(False)
    gen = read_json(folder / "generation_config.json", {})
    return LoadedModel(model, load_tokenizer(folder), cfg, folder, gen)
