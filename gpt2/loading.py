"""Loading the official GPT-2 checkpoints (safetensors only) into `GPT2`.

A source is either a local folder holding `config.json` + `model.safetensors`,
or a Hugging Face Hub repo id (`gpt2`, `openai-community/gpt2-large`,
`distilgpt2`, ...). A repo id is downloaded once with `huggingface_hub` into
`weights/<owner>--<name>/` (just the four files below) and read from there on
every later run, with no network.

Two key layouts exist in the wild and both load:
- the Hub files: `wte.weight`, `h.0.attn.c_attn.weight`, ..., sometimes with
  the causal-mask buffers `h.N.attn.bias` / `h.N.attn.masked_bias` (ignored);
- `save_pretrained` output: the same names under a `transformer.` prefix, plus
  an `lm_head.weight` that is tied to `wte` (ignored, or absent).

GPT-2's four projections per block (c_attn, c_proj, c_fc, mlp.c_proj) are
Conv1D layers stored (in, out); our `Linear` keeps (out, in), so each is
transposed once here, after a shape check against the config.
"""

from __future__ import annotations

import inspect
import os
import shutil
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from .config import GPT2Config
from .model import GPT2
from .fast import accelerate as accelerate_model
from .fast.quantize import quantize_model_int8, resolve_quantize

WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "weights"
MODEL_FILES = ("config.json", "model.safetensors")
TOKENIZER_FILES = ("vocab.json", "merges.txt")
CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers, not weights

# The first request of a download: how long it may wait for the Hub before we
# say there is no network (each of connect and read, in seconds).
HUB_PROBE_TIMEOUT_SECONDS = 3.0

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str | torch.device) -> torch.device:
    """Turns "auto"/"cpu"/"cuda"/"cuda:1"/"mps" into an available torch.device.

    Raises:
        ValueError: the name is unknown or the device is not available here.
    """
    name = str(device)
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device '{name}': use auto, cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device '{name}' is not available: this PyTorch sees no CUDA GPU; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device '{name}' does not exist: {torch.cuda.device_count()} CUDA device(s) found")
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ValueError(f"device '{name}' is not available on this machine; use --device cpu")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"unsupported device '{name}': use auto, cpu, cuda or mps")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """Checks that `dtype` is one of float32/float16/bfloat16 and usable on `device`.

    Raises:
        ValueError: unknown dtype, or one the device cannot compute in.
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype '{dtype}': choose float32, float16 or bfloat16")
        dtype = DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ValueError(f"unsupported dtype {dtype}: choose torch.float32, torch.float16 or torch.bfloat16")
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError(f"this GPU ({torch.cuda.get_device_name(device)}) has no bfloat16: use float16 or float32")
    if device.type == "mps" and dtype == torch.bfloat16:
        raise ValueError("bfloat16 is not supported on mps here: use float16 or float32")
    return dtype


def is_model_folder(source: str | Path) -> bool:
    """A local folder counts as a model only if it holds config.json (so the
    `gpt2/` package folder is never mistaken for the `gpt2` checkpoint)."""
    return Path(source).is_dir() and (Path(source) / "config.json").is_file()


def local_folder_for(repo_id: str, weights_dir: str | Path | None = None) -> Path:
    """Where the files of `repo_id` are kept: weights/<owner>--<name>."""
    return Path(weights_dir if weights_dir is not None else WEIGHTS_DIR) / repo_id.replace("/", "--")


def download(repo_id: str, weights_dir: str | Path | None = None) -> Path:
    """Fetches config.json, model.safetensors, vocab.json and merges.txt of a
    Hub repo into `local_folder_for(repo_id)`, unless config.json and
    model.safetensors are already there. A repo without vocab.json/merges.txt
    is fine (the tokenizer falls back to tiktoken's). Returns the folder.

    Says on stderr what it fetches; huggingface_hub draws a progress bar per
    file when stderr is a terminal. Honours HF_ENDPOINT (the tests point it
    at a local server) and HF_HUB_DISABLE_PROGRESS_BARS.

    Raises:
        ValueError: the repo does not exist or has no model.safetensors.
        FileNotFoundError: the Hub cannot be reached and there is no local
            copy (within a few seconds: see `HUB_PROBE_TIMEOUT_SECONDS`).
    """
    folder = local_folder_for(repo_id, weights_dir)
    if all((folder / f).is_file() for f in MODEL_FILES):
        return folder  # downloaded before: no network needed (some repos have no tokenizer files)
    # model.safetensors comes last: once it is there, the tokenizer files were
    # fetched or found absent, so a later run never needs to ask again.
    wanted = ("config.json", *TOKENIZER_FILES, "model.safetensors")

    # Imported here so that loading a local folder never needs the library.
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url

    # huggingface_hub retries a failed request for a file it has no copy of
    # five times, 23 s of backoff with a warning each time. One request of
    # our own first, with no retries, tells a missing network in seconds.
    probe = partial(get_hf_file_metadata, hf_hub_url(repo_id, "config.json"), timeout=HUB_PROBE_TIMEOUT_SECONDS)
    progress = {"tqdm_class": progress_bar_class()} if accepts_tqdm_class(hf_hub_download) else {}
    first_download = not folder.exists()
    try:
        ask_hub(probe, repo_id, "config.json", folder)
        print(f"downloading {repo_id} from {constants.ENDPOINT} into {folder}", file=sys.stderr)
        folder.mkdir(parents=True, exist_ok=True)
        for filename in wanted:
            if not (folder / filename).is_file():
                fetch = partial(hf_hub_download, repo_id, filename, local_dir=folder, **progress)
                ask_hub(fetch, repo_id, filename, folder)
    except Exception:
        if first_download and not any((folder / f).is_file() for f in wanted):
            shutil.rmtree(folder, ignore_errors=True)  # leave no empty folder behind a failed first try
        raise
    return folder


def ask_hub(request: Callable[[], object], repo_id: str, filename: str, folder: Path) -> None:
    """Runs `request` (a call about `filename` of `repo_id`) and turns the Hub's
    errors into ours. A missing tokenizer file is no error: the tokenizer then
    falls back to tiktoken's own GPT-2 files.

    Raises:
        ValueError: a gated or unknown repo, or a missing model file.
        FileNotFoundError: the Hub cannot be reached.
    """
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        request()
    except GatedRepoError:
        raise ValueError(
            f"'{repo_id}' is a gated repo on the Hugging Face Hub: log in with `hf auth login` first"
        ) from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"no model '{repo_id}' on the Hugging Face Hub: check the name (e.g. gpt2, gpt2-large, "
            "distilgpt2, openai-community/gpt2-xl) or pass a local folder with config.json and "
            "model.safetensors"
        ) from None
    except LocalEntryNotFoundError as e:  # no network; it subclasses EntryNotFoundError, so it comes first
        raise cannot_download(repo_id, folder, e) from None
    except EntryNotFoundError:
        if filename in TOKENIZER_FILES:
            return
        raise ValueError(
            f"'{repo_id}' on the Hugging Face Hub has no {filename}; only GPT-2 checkpoints saved as "
            "safetensors can be loaded"
        ) from None
    except OSError as e:
        raise cannot_download(repo_id, folder, e) from None
    except Exception as e:  # httpx errors that are not OSError: the network is the problem
        if type(e).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "httpcore2"):
            raise cannot_download(repo_id, folder, e) from None
        raise


def accepts_tqdm_class(hf_hub_download: Callable) -> bool:
    """Whether this huggingface_hub's `hf_hub_download` takes a progress bar
    class (recent versions; older ones draw their own)."""
    return "tqdm_class" in inspect.signature(hf_hub_download).parameters


def progress_bar_class() -> type:
    """huggingface_hub's progress bar, made to draw in a terminal that reports
    a size of 0 x 0 (a pseudo-terminal opened by `script`, a container or an
    IDE): tqdm hides every bar there. Anywhere else it is huggingface_hub's own
    bar, which is off when stderr is not a terminal."""
    from huggingface_hub.utils import tqdm as hub_tqdm

    class DownloadBar(hub_tqdm):
        def __init__(self, *args, **kwargs) -> None:
            if terminal_without_size(sys.stderr):
                kwargs.setdefault("ncols", 80)
                kwargs.setdefault("nrows", 24)
            super().__init__(*args, **kwargs)

    return DownloadBar


def terminal_without_size(stream) -> bool:
    """True if `stream` is a terminal that reports 0 columns or 0 lines."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return False  # not a terminal
    return size.columns == 0 or size.lines == 0


def cannot_download(repo_id: str, folder: Path, error: Exception) -> FileNotFoundError:
    """The error for a repo that cannot be fetched (no network) and has no local copy."""
    return FileNotFoundError(
        f"cannot download '{repo_id}' (no network? {type(error).__name__}) and there is no local copy in "
        f"{folder}: connect to the internet once, or put config.json and model.safetensors of "
        f"'{repo_id}' into {folder}, or pass a local model folder instead"
    )


def resolve_source(source: str | Path, weights_dir: str | Path | None = None) -> Path:
    """The local folder for `source`: itself if it is a model folder, else the
    download folder of the Hub repo it names (downloading if needed).

    A path written as one (starting with /, . or ~) is never taken for a repo
    id; a bare name such as "gpt2" is a repo id unless it is a folder holding
    config.json.
    """
    if not isinstance(source, (str, Path)) or str(source).strip() == "":
        raise ValueError("the model source is empty: pass a Hub repo id such as 'gpt2' or a local folder")
    if is_model_folder(source):
        return Path(source)
    text = str(source)
    if isinstance(source, Path) or text.startswith(("/", ".", "~")) or text.count("/") > 1:
        folder = Path(text).expanduser()
        if folder.is_dir():
            raise FileNotFoundError(
                f"{folder} has no config.json: a model folder needs config.json and model.safetensors "
                "(as downloaded from the Hugging Face Hub)"
            )
        raise FileNotFoundError(f"model folder {folder} does not exist: check the path, or pass a Hub repo id such as 'gpt2'")
    return download(text, weights_dir)


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Reads a .safetensors file (never pickle).

    Raises:
        FileNotFoundError: the file is missing.
        ValueError: the file is truncated or not safetensors.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: a model folder needs model.safetensors (pickled .bin checkpoints are not loaded)"
        )
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise ValueError(
            f"{path} is corrupt or truncated ({str(e).splitlines()[0][:120]}): delete it and download it again"
        ) from None


def checkpoint_to_model_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Maps both checkpoint key layouts onto our parameter names, dropping the
    mask buffers and the tied `lm_head.weight`."""
    out = {}
    for key, tensor in state.items():
        name = key.removeprefix("transformer.")
        if name == "lm_head.weight" or name.endswith(IGNORED_SUFFIXES):
            continue
        out[name] = tensor
    return out


def load_weights(model: GPT2, state: dict[str, torch.Tensor], *, source: str = "checkpoint") -> None:
    """Copies checkpoint tensors into `model`, transposing the Conv1D weights.

    Raises:
        ValueError: a tensor is missing, unexpected, or of the wrong shape
            (the message names the tensor and both shapes).
    """
    state = checkpoint_to_model_keys(state)
    expected = dict(model.named_parameters())
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(
            f"{source} lacks {len(missing)} tensor(s) the config needs, e.g. '{missing[0]}': "
            "is config.json from the same checkpoint?"
        )
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ValueError(f"{source} has tensor(s) GPT-2 does not use, e.g. '{unexpected[0]}': is it a GPT-2 checkpoint?")

    with torch.no_grad():
        for name, param in expected.items():
            tensor = state[name]
            if name.endswith(CONV1D_SUFFIXES):
                # Conv1D stores (in, out); Linear wants (out, in).
                want = (param.shape[1], param.shape[0])
                if tuple(tensor.shape) != want:
                    raise ValueError(
                        f"tensor '{name}' in {source} has shape {tuple(tensor.shape)} but the config needs "
                        f"{want} (Conv1D layout, in x out): config.json does not match the weights"
                    )
                tensor = tensor.t()  # (in, out) -> (out, in)
            elif tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"tensor '{name}' in {source} has shape {tuple(tensor.shape)} but the config needs "
                    f"{tuple(param.shape)}: config.json does not match the weights"
                )
            assert tuple(tensor.shape) == tuple(param.shape), name
            param.copy_(tensor)


def load_model(
    source: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = torch.float32,
    weights_dir: str | Path | None = None,
    quantize: str | None = None,
    accelerate: bool = True,
) -> GPT2:
    """Loads a GPT-2 checkpoint.

    Args:
        source: a Hub repo id ("gpt2", "openai-community/gpt2-large",
            "distilgpt2", ...) or a local folder with config.json and
            model.safetensors.
        device: "cpu", "cuda", "mps" or "auto".
        dtype: torch.float32 (the CPU default), torch.float16 or torch.bfloat16
            (or their names).
        weights_dir: where Hub downloads go (default: the repository's weights/).
        quantize: None (or "none"), or "int8": every weight matrix rounded
            to int8 with a scale per row (gpt2/fast/quantize.py; CPU and
            float32 only). The model is then the quantised model.
        accelerate: on a CPU in float32, plug in the C fast path
            (`gpt2.fast.accelerate`; where it can run, else the model keeps
            its readable path). False: the readable path.

    Returns:
        The model in eval mode on `device` in `dtype`.

    Raises:
        ValueError, FileNotFoundError: with a message that says how to fix it.
    """
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    quantization = resolve_quantize(quantize, dev, dt)
    folder = resolve_source(source, weights_dir)
    config = GPT2Config.from_hf_config(folder / "config.json")
    state = load_state_dict(folder / "model.safetensors")
    with torch.device("meta"):
        model = GPT2(config)  # shapes only: no memory, no random init
    model = model.to_empty(device="cpu")
    load_weights(model, state, source=str(folder / "model.safetensors"))
    del state
    model = model.to(device=dev, dtype=dt).eval()
    int8 = quantization == "int8"
    if accelerate and dev.type == "cpu" and dt == torch.float32:
        accelerate_model(model, int8=int8)  # packs the kernels' weight copies now, not at the first pass
    elif int8:
        quantize_model_int8(model)
    return model
