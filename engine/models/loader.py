"""One loader for every source a user may name: a local Hugging Face directory (safetensors),
a GGUF file, a pack name from ``engine.models.fetch``, or a hub id (when a hub is reachable).

GGUF files are dequantized once by ``transformers``' GGUF reader and the result is cached as an
ordinary Hugging Face directory (fp32 safetensors + config + tokenizer with its chat template), so
a restart loads in seconds.  The cache key is the file's size and a hash of its first and last
megabytes, so a replaced file is converted again while a moved one is not.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.models.config import ModelConfig
from engine.models.llama import LlamaModel, build_model

log = logging.getLogger(__name__)

DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}


class ModelLoadError(RuntimeError):
    """The model source cannot be found, fetched or read."""


@dataclass
class LoadedModel:
    model: LlamaModel
    config: ModelConfig
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    source: str  # what the user asked for
    path: Path  # the local Hugging Face directory the weights came from
    load_seconds: float = 0.0


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of bf16, fp16, fp32") from None


def parse_device(name: str) -> torch.device:
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unsupported device {name!r}; use cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}; use cpu or cuda[:N]")
    return dev


def default_cache_dir() -> Path:
    return Path(os.environ.get("MCSD_CACHE", Path.home() / ".cache" / "mcsd"))


def load_model(source: str, dtype: str | torch.dtype = "bf16", device: str = "cpu",
               cache_dir: str | Path | None = None) -> LoadedModel:
    """Loads weights, config and tokenizer of ``source`` into our runtime."""
    t0 = time.perf_counter()
    torch_dtype, dev = parse_dtype(dtype), parse_device(device)
    path = resolve_source(source, Path(cache_dir) if cache_dir else default_cache_dir())
    from transformers import AutoConfig, AutoTokenizer

    hf_cfg = AutoConfig.from_pretrained(path)
    cfg = ModelConfig.from_hf(hf_cfg)
    model = build_model(cfg, read_state_dict(path, torch_dtype), torch_dtype, dev)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return LoadedModel(model, cfg, tokenizer, source, path, time.perf_counter() - t0)


def resolve_source(source: str, cache_dir: Path) -> Path:
    """Returns a local Hugging Face directory holding ``source``'s weights."""
    p = Path(source).expanduser()
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelLoadError(f"{p} is a file but not a .gguf; pass a GGUF file or a model directory")
        return convert_gguf(p, cache_dir)
    if p.is_dir():
        if (p / "config.json").is_file():
            return p
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return convert_gguf(ggufs[0], cache_dir)
        raise ModelLoadError(
            f"{p} has no config.json and {len(ggufs)} .gguf files; pass a Hugging Face model "
            f"directory or a single GGUF file")
    from engine.models import fetch

    if source in fetch.PACKS:
        return convert_gguf(fetch.fetch_pack(source, cache_dir=cache_dir), cache_dir)
    if source.count("/") == 1 and not source.startswith((".", "/")):
        return download_from_hub(source)
    raise ModelLoadError(
        f"model {source!r} not found: not a local file or directory, not a known pack "
        f"({', '.join(fetch.PACKS)}), and not a hub id of the form org/name")


def download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(
            repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]))
    except Exception as e:  # network, auth, missing repo: all end the same way for the user
        raise ModelLoadError(
            f"could not download {repo_id!r} from the model hub ({type(e).__name__}: {e}). "
            f"Without hub access, pass a local directory, a GGUF file or a pack name") from e


def read_state_dict(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Reads every safetensors shard, casting tensor by tensor to keep peak memory low."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors weights in {path}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                sd[name] = st.get_tensor(name).to(dtype)
    return sd


def gguf_cache_key(gguf: Path) -> str:
    size = gguf.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(gguf, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Dequantizes ``gguf`` into a cached Hugging Face directory (once) and returns it."""
    out = cache_dir / "converted" / f"{gguf.stem}-{gguf_cache_key(gguf)}"
    if (out / "mcsd-complete.json").is_file():
        return out
    log.warning("converting %s once (dequantizing; later loads use %s)", gguf.name, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _convert_into(gguf, tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert_into(gguf: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=gguf.name)
    try:
        hf_cfg = AutoConfig.from_pretrained(gguf.parent, **kw)
        ModelConfig.from_hf(hf_cfg)  # reject unsupported architectures before the slow part
        tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    except (ValueError, OSError, KeyError) as e:
        raise ModelLoadError(f"cannot read GGUF file {gguf}: {e}") from e
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf_cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, str(out / "model.safetensors"))
    hf_cfg.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "mcsd-complete.json").write_text(json.dumps({"source": str(gguf), "key": gguf_cache_key(gguf)}))
