"""Where a model's files come from: a local folder, or the Hugging Face Hub.

A source is either a local folder holding `config.json` + `model.safetensors`,
or a Hub repo id (`gpt2`, `openai-community/gpt2-large`, `distilgpt2`, ...).
A repo id is downloaded once with `huggingface_hub` into
`weights/<owner>--<name>/` (the files of MODEL_FILES, and of TOKENIZER_FILES
where the repo has them) and read from there on every later run, with no network.
`loading.py` then reads the folder into a model.
"""

from __future__ import annotations

import errno
import inspect
import os
import shutil
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "weights"
MODEL_FILES = ("config.json", "model.safetensors")
TOKENIZER_FILES = ("vocab.json", "merges.txt")

# The first request of a download: how long it may wait for the Hub before we
# say there is no network (each of connect and read, in seconds).
HUB_PROBE_TIMEOUT_SECONDS = 3.0
HTTP_FIXES = {
    401: "your token was refused: log in again with `hf auth login`, or unset HF_TOKEN",
    403: "access was refused: check that your account may read this repo",
    429: "too many requests: wait a minute and try again",
}
# Errors of writing a downloaded file (disk full, no permission, ...), which are no network's fault
DISK_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG, errno.EACCES, errno.EPERM,
               errno.EROFS, errno.EISDIR}


def is_model_folder(source: str | Path) -> bool:
    """A local folder counts as a model only if it holds config.json (so the
    `gpt2/` package folder is never mistaken for the `gpt2` checkpoint)."""
    return is_folder(source) and (Path(source) / "config.json").is_file()


def is_folder(path: str | Path) -> bool:
    return looked_up(Path(path).is_dir)


def looked_up(check: Callable[[], bool]) -> bool:
    """`check()` (a path's `is_dir` or `is_file`), but False rather than an
    OSError for a name the file system refuses to look up (longer than 255
    bytes, say)."""
    try:
        return check()
    except (OSError, ValueError):
        return False


def local_folder_for(repo_id: str, weights_dir: str | Path | None = None) -> Path:
    """Where the files of `repo_id` are kept: weights/<owner>--<name>."""
    return Path(weights_dir if weights_dir is not None else WEIGHTS_DIR) / repo_id.replace("/", "--")


def download(repo_id: str, weights_dir: str | Path | None = None) -> Path:
    """Fetches config.json, model.safetensors, vocab.json and merges.txt of a
    Hub repo into `local_folder_for(repo_id)`, unless config.json and
    model.safetensors are already there with both tokenizer files or neither
    (one alone was deleted: fetched again). A repo without vocab.json/merges.txt
    is fine (the tokenizer falls back to tiktoken's). Returns the folder.

    Says on stderr what it fetches; huggingface_hub draws a progress bar per
    file when stderr is a terminal. Honours HF_ENDPOINT (the tests point it
    at a local server) and HF_HUB_DISABLE_PROGRESS_BARS.

    Raises:
        ValueError: the repo does not exist or has no model.safetensors, the
            Hub answers with an error (a refused token, too many requests),
            or a file cannot be written.
        FileNotFoundError: the Hub cannot be reached (within a few seconds:
            see `HUB_PROBE_TIMEOUT_SECONDS`) or HF_HUB_OFFLINE is set, and
            there is no local copy.
    """
    folder = local_folder_for(repo_id, weights_dir)
    first_download = not download_folder_exists(folder)
    tokenizer_files = sum((folder / f).is_file() for f in TOKENIZER_FILES)
    if all((folder / f).is_file() for f in MODEL_FILES) and tokenizer_files != 1:
        return folder  # downloaded before: no network needed (some repos have no tokenizer files; one alone: deleted)
    # model.safetensors comes last: once it is there, the tokenizer files were
    # fetched or found absent, so a later run never needs to ask again.
    wanted = ("config.json", *TOKENIZER_FILES, "model.safetensors")

    # Imported here so that loading a local folder never needs the library.
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url

    # huggingface_hub retries a failed request for a file it has no copy of
    # five times, 23 s of backoff with a warning each time. One request of
    # our own first, with no retries, tells a missing network in seconds.
    probe = partial(probe_hub, partial(get_hf_file_metadata, hf_hub_url(repo_id, "config.json"),
                                       timeout=HUB_PROBE_TIMEOUT_SECONDS))
    progress = {"tqdm_class": progress_bar_class()} if accepts_tqdm_class(hf_hub_download) else {}
    try:
        try:
            ask_hub(probe, repo_id, "config.json", folder)
        except FileNotFoundError:  # no network: a tokenizer file that cannot be fetched is no reason to fail
            if all((folder / f).is_file() for f in MODEL_FILES):
                print(f"cannot reach the Hub to complete {repo_id}'s tokenizer files: using {folder} as it is",
                      file=sys.stderr)
                return folder
            raise
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


def probe_hub(request: Callable[[], object]) -> None:
    """Runs the probe `request`; a Hub that answers with a server error or
    slowly is not a missing network: hf_hub_download then retries."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        request()
    except HfHubHTTPError as e:
        if e.response is None or e.response.status_code < 500:
            raise
    except Exception as e:
        if not (type(e).__name__.endswith("Timeout") and "Connect" not in type(e).__name__):  # ReadTimeout: slow
            raise


def download_folder_exists(folder: Path) -> bool:
    """Whether `folder` exists (a file where a folder above it should be: no).

    Raises:
        ValueError: the file system refuses to look it up (a name longer than
            255 bytes, a folder above it that cannot be read).
    """
    try:
        os.stat(folder)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as e:
        raise ValueError(
            f"cannot use the download folder {folder} ({e.strerror or type(e).__name__}): "
            "pass a weights_dir (--weights-dir) that is a writable folder, or a local model folder"
        ) from None
    return True


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
        ValueError: a gated or unknown repo, a missing model file, another
            error answer of the Hub, or a file that cannot be written.
        FileNotFoundError: the Hub cannot be reached, or HF_HUB_OFFLINE is set.
    """
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
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
            f"'{repo_id}' on the Hugging Face Hub has no {filename}; only GPT-2 checkpoints saved as one "
            "safetensors file can be loaded (not pickled .bin files, not shards)"
        ) from None
    except OfflineModeIsEnabled:
        raise FileNotFoundError(f"HF_HUB_OFFLINE is set and there is no local copy of '{repo_id}' in {folder}: "
                                "unset it to download, or pass a local model folder") from None
    except HfHubHTTPError as e:  # the Hub answered, with an error
        status = None if e.response is None else e.response.status_code
        fix = HTTP_FIXES.get(status, "try again later")  # 5xx: the Hub's own trouble
        raise ValueError(f"the Hugging Face Hub answered {status} for {filename} of '{repo_id}': {fix}") from None
    except OSError as e:
        if e.errno in DISK_ERRNOS:  # writing the file failed, not the network
            raise ValueError(f"cannot write {e.filename or folder} ({e.strerror}): free some space, or pass a "
                             "weights_dir (--weights-dir) you can write to") from None
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
        f"cannot download '{repo_id}' (no network? {type(error).__name__}) and there is no complete local copy "
        f"in {folder}: connect to the internet and run again (a broken download resumes), or put config.json and "
        f"model.safetensors of '{repo_id}' into {folder}, or pass a local model folder instead"
    )


def resolve_source(source: str | Path, weights_dir: str | Path | None = None) -> Path:
    """The local folder for `source`: itself if it is a model folder, else the
    download folder of the Hub repo it names (downloading if needed).

    A path written as one (a Path, a str starting with /, . or ~, or one with
    two or more /) is never taken for a repo id, nor is an owner/name that is
    a folder here; a bare name such as "gpt2" is a repo id unless it is a
    folder holding config.json.

    Raises:
        ValueError: `source` is empty, neither a model folder nor a valid Hub
            id, or `source`/`weights_dir` is not a str or Path.
        FileNotFoundError: a path that does not exist, is a file or has no config.json.
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
    if weights_dir is not None and str(weights_dir).strip() == "":
        raise ValueError("weights_dir is empty: pass the folder for downloads, or None for the repository's weights/")
    if weights_dir is not None:
        weights_dir = expand_home(str(weights_dir), "the downloads folder (weights_dir)", "give a folder you can "
                                  "write to")  # as huggingface_hub does with it: both see one folder
    folder = expand_home(text)
    if is_model_folder(folder):
        return folder
    written_as_path = isinstance(source, Path) or text.startswith(("/", ".", "~")) or text.count("/") > 1
    if written_as_path or ("/" in text and is_folder(folder)):  # models/gpt2: a folder here, not a Hub repo
        if is_folder(folder):
            config = folder / "config.json"
            what = ("has a config.json that is not a file" if looked_up(config.exists)
                    else "has a config.json that is a broken link" if looked_up(config.is_symlink)
                    else "has no config.json")
            raise FileNotFoundError(
                f"{folder} {what}: a model folder needs config.json and model.safetensors "
                "(as downloaded from the Hugging Face Hub)"
            )
        if looked_up(folder.is_file):
            raise FileNotFoundError(f"{folder} is a file, not a model folder: pass the folder that holds "
                                    f"config.json and model.safetensors, such as {folder.parent}")
        raise FileNotFoundError(f"model folder {folder} does not exist: check the path, or pass a Hub repo id "
                                "such as 'gpt2'")
    check_repo_id(text)
    return download(text, weights_dir)


def expand_home(text: str, what: str = "model folder",
                fix: str = "check the path, or pass a Hub repo id such as 'gpt2'") -> Path:
    """`text` as a path, with a leading ~ or ~user replaced by that home folder.

    Raises:
        FileNotFoundError: ~user names a user this machine does not have
            (or there is no home folder at all); the message calls the path
            `what` and says `fix`.
    """
    try:
        return Path(text).expanduser()
    except RuntimeError:  # pathlib's "Could not determine home directory"
        home = text.split("/", 1)[0]
        raise FileNotFoundError(
            f"{what} {text} does not exist: '{home}' names no home folder on this machine; {fix}"
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
