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
transposed once here. Every tensor's name and shape is checked against
config.json from the safetensors header alone, before the model is built:
a config.json that does not match the weights costs nothing to refuse.
"""

from __future__ import annotations

import inspect
import itertools
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
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
    return is_folder(source) and (Path(source) / "config.json").is_file()


def is_folder(path: str | Path) -> bool:
    """`Path.is_dir`, but False rather than an OSError for a name the file
    system refuses to look up (longer than 255 bytes, say)."""
    try:
        return Path(path).is_dir()
    except (OSError, ValueError):
        return False


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
        make_download_folder(folder)
        for filename in wanted:
            if not (folder / filename).is_file():
                fetch = partial(hf_hub_download, repo_id, filename, local_dir=folder, **progress)
                ask_hub(fetch, repo_id, filename, folder)
    except Exception:
        if first_download and not any((folder / f).is_file() for f in wanted):
            shutil.rmtree(folder, ignore_errors=True)  # leave no empty folder behind a failed first try
        raise
    return folder


def make_download_folder(folder: Path) -> None:
    """Creates `folder` (and the weights folder above it) for a download.

    Raises:
        ValueError: it cannot be created (the weights folder is a file, or
            not writable).
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"cannot create the download folder {folder} ({e.strerror or type(e).__name__}): "
            "pass a weights_dir (--weights-dir) that is a writable folder, or a local model folder"
        ) from None


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

    A path written as one (a Path, or a str starting with /, . or ~) is never
    taken for a repo id; a bare name such as "gpt2" is a repo id unless it is
    a folder holding config.json.

    Raises:
        ValueError: `source` is empty, neither a model folder nor a valid Hub
            id, or `source`/`weights_dir` is not a str or Path.
        FileNotFoundError: a path that does not exist or has no config.json.
    """
    if not isinstance(source, (str, Path)):
        raise ValueError(
            f"the model source must be a Hub repo id such as 'gpt2' or a local folder (a str or Path), "
            f"not {type(source).__name__} {source!r}"
        )
    text = str(source)
    if text.strip() == "":
        raise ValueError("the model source is empty: pass a Hub repo id such as 'gpt2' or a local folder")
    if weights_dir is not None and not isinstance(weights_dir, (str, Path)):
        raise ValueError(
            f"weights_dir must be the folder for downloads (a str or Path) or None for the repository's "
            f"weights/, not {type(weights_dir).__name__} {weights_dir!r}"
        )
    folder = expand_home(text)
    if is_model_folder(folder):
        return folder
    if isinstance(source, Path) or text.startswith(("/", ".", "~")) or text.count("/") > 1:
        if is_folder(folder):
            raise FileNotFoundError(
                f"{folder} has no config.json: a model folder needs config.json and model.safetensors "
                "(as downloaded from the Hugging Face Hub)"
            )
        raise FileNotFoundError(f"model folder {folder} does not exist: check the path, or pass a Hub repo id such as 'gpt2'")
    check_repo_id(text)
    return download(text, weights_dir)


def expand_home(text: str) -> Path:
    """`text` as a path, with a leading ~ or ~user replaced by that home folder.

    Raises:
        FileNotFoundError: ~user names a user this machine does not have
            (or there is no home folder at all).
    """
    try:
        return Path(text).expanduser()
    except RuntimeError:  # pathlib's "Could not determine home directory"
        home = text.split("/", 1)[0]
        raise FileNotFoundError(
            f"model folder {text} does not exist: '{home}' names no home folder on this machine; "
            "check the path, or pass a Hub repo id such as 'gpt2'"
        ) from None


def check_repo_id(text: str) -> None:
    """Checks that `text`, which is no local model folder, can name a Hub repo.

    Raises:
        ValueError: it cannot (spaces, a ':', too long, ...): the message says
            that it was taken for a Hub id, since it is no folder.
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        shown = text if len(text) <= 100 else text[:97] + "..."
        raise ValueError(
            f"'{shown}' is neither a local folder with config.json nor a valid Hub id such as 'gpt2' or "
            "'openai-community/gpt2-large' (a Hub id is letters, digits, '-', '_' and '.', at most 96 "
            "characters, with one '/' at most): check the spelling, or write a local folder as ./name"
        ) from None


@contextmanager
def reading_safetensors(path: Path) -> Iterator[None]:
    """Turns the errors of reading the .safetensors file `path` (within the
    `with` block) into ours.

    Raises:
        FileNotFoundError: the file is missing.
        ValueError: the file is truncated or not safetensors.
    """
    from safetensors import SafetensorError

    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: a model folder needs model.safetensors (pickled .bin checkpoints are not loaded)"
        )
    try:
        yield
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise ValueError(
            f"{path} is corrupt or truncated ({str(e).splitlines()[0][:120]}): delete it and download it again"
        ) from None


def read_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The name and shape of every tensor in a .safetensors file, read from its
    header alone (no weight is read; safetensors checks that the header and the
    file's size agree).

    Raises:
        FileNotFoundError: the file is missing.
        ValueError: the file is truncated or not safetensors.
    """
    from safetensors import safe_open

    with reading_safetensors(path), safe_open(str(path), framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Reads a .safetensors file (never pickle).

    Raises:
        FileNotFoundError: the file is missing.
        ValueError: the file is truncated or not safetensors.
    """
    from safetensors.torch import load_file

    with reading_safetensors(path):
        return load_file(str(path), device="cpu")


def checkpoint_to_model_keys(state: dict[str, object]) -> dict[str, object]:
    """Maps both checkpoint key layouts onto our parameter names, dropping the
    mask buffers and the tied `lm_head.weight`. The values (tensors, or
    shapes) are kept as they are."""
    out = {}
    for key, value in state.items():
        name = key.removeprefix("transformer.")
        if name == "lm_head.weight" or name.endswith(IGNORED_SUFFIXES):
            continue
        out[name] = value
    return out


def stored_shapes(config: GPT2Config) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """The shape of each tensor a checkpoint of `config` holds, as stored
    (Conv1D weights (in, out)): those outside the blocks (`wte.weight`,
    `wpe.weight`, `ln_f.*`), and those of one block, named without their
    `h.N.` (`ln_1.weight`, `attn.c_attn.weight`, ...).

    Read off a GPT2 with one block on the meta device: no memory and no
    work, however large the config's sizes.
    """
    with torch.device("meta"):
        one_block = GPT2(replace(config, n_layer=1))
    outside, block = {}, {}
    for name, param in one_block.named_parameters():
        shape = tuple(param.shape)
        if name.endswith(CONV1D_SUFFIXES):
            shape = shape[::-1]  # Linear (out, in) -> Conv1D (in, out)
        if name.startswith("h.0."):
            block[name.removeprefix("h.0.")] = shape
        else:
            outside[name] = shape
    return outside, block


def check_fits_config(shapes: dict[str, tuple[int, ...]], config: GPT2Config, *, source: str) -> None:
    """Checks that a checkpoint holds exactly the tensors `config` needs, each
    of the shape it needs, from their names and shapes alone (`read_shapes`).

    Run before the model is built, so that a config.json that does not match
    the weights (n_embd 2**20, vocab_size 10**9, n_layer 10**6) is refused at
    once rather than after allocating terabytes or building a million blocks:
    the work is bounded by the checkpoint's tensors, never by config.n_layer.

    Args:
        shapes: tensor name (our names: `checkpoint_to_model_keys`) -> shape as stored.
        config: the model's config (from config.json).
        source: the checkpoint's name for messages.

    Raises:
        ValueError: a tensor is missing, unexpected, or of the wrong shape
            (the message names the tensor and both shapes).
    """
    outside, block = stored_shapes(config)

    def needed_shape(name: str) -> tuple[int, ...] | None:
        """The shape `config` needs for tensor `name`, or None if it has no such tensor."""
        in_block = re.fullmatch(r"h\.(0|[1-9][0-9]*)\.(.+)", name)  # h.<layer>.<name in the block>
        if in_block is None:
            return outside.get(name)
        layer, name_in_block = int(in_block[1]), in_block[2]
        return block.get(name_in_block) if layer < config.n_layer else None

    def needed_names() -> Iterator[str]:
        """Every name the config needs, in the model's order, made one at a
        time: the first missing one ends the search, so a config.json with a
        million layers costs nothing."""
        return itertools.chain(outside, (f"h.{i}.{name}" for i in range(config.n_layer) for name in block))

    first_missing = next((name for name in needed_names() if name not in shapes), None)
    if first_missing is not None:
        n_needed = len(outside) + config.n_layer * len(block)
        n_missing = n_needed - sum(needed_shape(name) is not None for name in shapes)
        raise ValueError(
            f"{source} lacks {n_missing} tensor(s) the config needs, e.g. '{first_missing}': "
            "is config.json from the same checkpoint?"
        )
    unexpected = sorted(name for name in shapes if needed_shape(name) is None)
    if unexpected:
        raise ValueError(f"{source} has tensor(s) GPT-2 does not use, e.g. '{unexpected[0]}': is it a GPT-2 checkpoint?")

    for name in needed_names():  # now exactly the checkpoint's names, wte.weight first
        shape, want = tuple(shapes[name]), needed_shape(name)
        if shape != want:
            layout = " (Conv1D layout, in x out)" if name.endswith(CONV1D_SUFFIXES) else ""
            raise ValueError(
                f"tensor '{name}' in {source} has shape {shape} but the config needs "
                f"{want}{layout}: config.json does not match the weights"
            )


def load_weights(model: GPT2, state: dict[str, torch.Tensor]) -> None:
    """Copies checkpoint tensors into `model`, transposing the Conv1D weights.
    `state` (our names: `checkpoint_to_model_keys`) must have passed
    `check_fits_config` for `model.config`."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            tensor = state[name]
            if name.endswith(CONV1D_SUFFIXES):
                tensor = tensor.t()  # Conv1D (in, out) -> Linear (out, in)
            assert tuple(tensor.shape) == tuple(param.shape), f"{name}: {tuple(tensor.shape)} vs {tuple(param.shape)}"
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
    path = folder / "model.safetensors"
    # config.json against the file's header first: nothing sized by the config is made before it fits.
    check_fits_config(checkpoint_to_model_keys(read_shapes(path)), config, source=str(path))
    state = checkpoint_to_model_keys(load_state_dict(path))
    with torch.device("meta"):
        model = GPT2(config)  # shapes only: no memory, no random init
    model = model.to_empty(device="cpu")
    load_weights(model, state)
    del state
    model = model.to(device=dev, dtype=dt).eval()
    int8 = quantization == "int8"
    if accelerate and dev.type == "cpu" and dt == torch.float32:
        accelerate_model(model, int8=int8)  # packs the kernels' weight copies now, not at the first pass
    elif int8:
        quantize_model_int8(model)
    return model
