"""Loading the official GPT-2 checkpoints (safetensors only) into `GPT2`.

A source is a local folder holding `config.json` + `model.safetensors`, or a
Hugging Face Hub repo id, downloaded once into `weights/` (hub.py).

Two key layouts exist in the wild and both load: the Hub files (`wte.weight`,
`h.0.attn.c_attn.weight`, ..., sometimes with the causal-mask buffers
`h.N.attn.bias` / `h.N.attn.masked_bias`, ignored), and `save_pretrained`
output (the same names under a `transformer.` prefix, plus an `lm_head.weight`
tied to `wte`: ignored, or taken as `wte` where a file holds only the head).
GPT-2's four projections per block (c_attn, c_proj, c_fc, mlp.c_proj) are
Conv1D layers stored (in, out); nn.Linear keeps (out, in), so each is
transposed once here. Every name and shape is checked
against config.json from the safetensors header alone, before the model is
built: a config.json that does not match the weights costs nothing to refuse.
"""

from __future__ import annotations

import errno
import itertools
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from .config import GPT2Config
from .hub import resolve_source
from .model import GPT2
from .fast import accelerate as accelerate_model
from .fast.quantize import quantize_model_int8, resolve_quantize

CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers, not weights

LFS_POINTER = b"version https://git-lfs"  # how a file that git-lfs has not fetched begins
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
        raise ValueError(f"device '{name}' is not available: this PyTorch sees no CUDA GPU; use device 'cpu' "
                         "(--device cpu)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device '{name}' does not exist: {torch.cuda.device_count()} CUDA device(s) found")
    if dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ValueError(f"device '{name}' is not available on this machine; use device 'cpu' (--device cpu)")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"unsupported device '{name}': use auto, cpu, cuda or mps")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """Checks that `dtype` is one of float32/float16/bfloat16 and usable on `device` (a name: `resolve_device`).

    Raises:
        ValueError: unknown dtype, or one the device cannot compute in.
    """
    device = device if isinstance(device, torch.device) else resolve_device(device)
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


@contextmanager
def reading_safetensors(path: Path) -> Iterator[None]:
    """Turns the errors of reading the .safetensors file `path` (within the
    `with` block) into ours.

    Raises:
        FileNotFoundError: the file is missing.
        ValueError: the file cannot be read, is truncated or not safetensors.
    """
    from safetensors import SafetensorError

    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: a model folder needs model.safetensors (pickled .bin checkpoints are not loaded)"
        )
    try:
        with path.open("rb") as f:
            start = f.read(len(LFS_POINTER))
    except OSError as e:
        raise ValueError(f"cannot read {path} ({e.strerror}): check its permissions") from None
    if start == LFS_POINTER:
        raise ValueError(f"{path} is a git-lfs pointer, not the weights (a `git clone` without git-lfs): run `git lfs "
                         "pull` in that folder, or pass the Hub repo id to download it")
    try:
        str(path).encode("utf-8")  # safetensors takes a path as UTF-8 text only; its refusal read as a bad file
    except UnicodeEncodeError:
        raise ValueError(f"{path} has a path that is not valid UTF-8, which safetensors cannot open (the file is not "
                         "at fault): rename the folders on its path, or move the model to a folder named in UTF-8"
                         ) from None
    try:
        yield
    except MemoryError:
        raise ValueError(f"not enough memory to read {path}: close other programs, or load a smaller model") from None
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        if getattr(e, "errno", None) == errno.ENOMEM or "Cannot allocate memory" in str(e):  # an mmap refused
            raise ValueError(
                f"not enough memory to map {path} ({str(e).splitlines()[0][:120]}): the file is not at fault; "
                "free memory, or raise this shell's address-space limit (ulimit -v)"
            ) from None
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


def checkpoint_to_model_keys(state: dict[str, object], *, source: str) -> dict[str, object]:
    """Maps both checkpoint key layouts onto our parameter names, dropping the
    mask buffers and the tied `lm_head.weight`, which stands in for
    `wte.weight` where a file holds only the head (safetensors' `save_model`
    keeps one name of tied tensors). The values (tensors, or shapes) are kept
    as they are.

    Raises:
        ValueError: the file holds an `lm_head.weight` beside its `wte.weight`
            that is not the same matrix: this GPT-2's output layer is the token
            embedding, so dropping the head would compute other logits.
    """
    out, head = {}, None
    for key, value in state.items():
        name = key.removeprefix("transformer.")
        if name == "lm_head.weight":
            head = value
        elif not name.endswith(IGNORED_SUFFIXES):
            out[name] = value
    wte = out.get("wte.weight")
    if wte is None and head is not None:
        out["wte.weight"] = head  # tied: the same matrix
    elif head is not None and not (head == wte if isinstance(head, tuple) else (  # NaNs in both: check_finite's
            (head.shape, head.dtype) == (wte.shape, wte.dtype)
            and torch.equal(widened(head).nan_to_num(), widened(wte).nan_to_num()))):
        raise ValueError(f"{source} holds an lm_head.weight that is not its wte.weight: this hand-written GPT-2 "
                         "ties its output layer to the token embedding, as GPT-2 does; load a checkpoint whose "
                         "head is the embedding")
    return out


def stored_shapes(config: GPT2Config) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """The shape of each tensor a checkpoint of `config` holds, as stored
    (Conv1D weights (in, out)): those outside the blocks (`wte.weight`,
    `wpe.weight`, `ln_f.*`), and those of one block, named without their
    `h.N.` (`ln_1.weight`, `attn.c_attn.weight`, ...).

    Read off a GPT2 with one block on the meta device: no memory and no
    work, however large the config's sizes.

    Raises:
        ValueError: sizes whose tensors would have more elements than torch
            can count.
    """
    try:
        with torch.device("meta"):
            one_block = GPT2(replace(config, n_layer=1))
    except (RuntimeError, OverflowError) as e:  # a tensor of more than 2**63 elements: torch cannot even size it
        raise ValueError(f"config.json's sizes make tensors too large to exist ({type(e).__name__}; n_embd "
                         f"{config.n_embd}, n_ctx {config.n_ctx}, vocab_size {config.vocab_size}): is it the "
                         "checkpoint's own config.json?") from None
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
    layers = {int(m.group(1)) for name in shapes if (m := re.match(r"h\.(\d+)\.", name))}
    if layers and max(layers) >= config.n_layer:
        raise ValueError(f"{source} holds {max(layers) + 1} layers (e.g. 'h.{max(layers)}.*') but config.json says "
                         f"n_layer {config.n_layer}: is config.json from the same checkpoint?")
    if unexpected:
        raise ValueError(f"{source} has tensor(s) GPT-2 does not use, e.g. '{unexpected[0]}': "
                         "is it a GPT-2 checkpoint?")

    for name in needed_names():  # now exactly the checkpoint's names, wte.weight first
        shape, want = tuple(shapes[name]), needed_shape(name)
        if shape != want:
            layout = " (Conv1D layout, in x out)" if name.endswith(CONV1D_SUFFIXES) else ""
            raise ValueError(
                f"tensor '{name}' in {source} has shape {shape} but the config needs "
                f"{want}{layout}: config.json does not match the weights"
            )


def widened(tensor: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as float32 (isfinite and nan_to_num do not take float8); any other tensor itself."""
    return tensor.float() if tensor.is_floating_point() and tensor.element_size() == 1 else tensor


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether a floating-point tensor holds no NaN and no infinity."""
    # The sum is one cheap pass; only a sum that is not finite (or that overflowed) needs the exact check.
    return bool(tensor.sum(dtype=torch.float32).isfinite()) or bool(torch.isfinite(widened(tensor)).all())


def check_in_range(model: GPT2, path: Path) -> None:
    """Raises a ValueError naming the first parameter that is not finite: finite in the checkpoint (and in float32,
    `check_finite`), past the range of the half-precision dtype the model was converted to."""
    for name, param in model.named_parameters():
        if not all_finite(param):
            raise ValueError(f"tensor '{name}' in {path} holds values too large for {param.dtype}: load it in float32")


def check_finite(state: dict[str, torch.Tensor], *, source: str) -> None:
    """Raises a ValueError naming the first tensor that is not floating point
    or holds a NaN or an infinity: a damaged checkpoint, which would decode
    garbage when greedy and fail mid-run when sampling."""
    for name, tensor in state.items():
        if not tensor.is_floating_point():
            raise ValueError(f"tensor '{name}' in {source} holds {tensor.dtype} values, not floating point: the "
                             "checkpoint is damaged or not a GPT-2 checkpoint")
        if not all_finite(tensor):
            raise ValueError(
                f"tensor '{name}' in {source} holds NaN or infinite values: the checkpoint is damaged, "
                "download it again"
            )
        if tensor.element_size() > 4 and not all_finite(tensor.float()):  # float64: the model computes in float32
            raise ValueError(f"tensor '{name}' in {source} holds values too large for torch.float32: the checkpoint "
                             "is damaged")


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
    if not isinstance(accelerate, bool):  # "False" would accelerate
        raise ValueError(f"accelerate must be True or False, got {accelerate!r}")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    quantization = resolve_quantize(quantize, dev, dt)
    folder = resolve_source(source, weights_dir)
    config = GPT2Config.from_hf_config(folder / "config.json")
    path = folder / "model.safetensors"
    # config.json against the file's header first: nothing sized by the config is made before it fits.
    check_fits_config(checkpoint_to_model_keys(read_shapes(path), source=str(path)), config, source=str(path))
    state = checkpoint_to_model_keys(load_state_dict(path), source=str(path))
    check_finite(state, source=str(path))
    with torch.device("meta"):
        model = GPT2(config)  # shapes only: no memory, no random init
    model = model.to_empty(device="cpu")
    load_weights(model, state)
    del state
    model = model.to(device=dev, dtype=dt).eval()
    if dt != torch.float32:
        check_in_range(model, path)
    int8 = quantization == "int8"
    if accelerate and dev.type == "cpu" and dt == torch.float32:
        accelerate_model(model, int8=int8)  # packs the kernels' weight copies now, not at the first pass
    elif int8:
        quantize_model_int8(model)
    return model
