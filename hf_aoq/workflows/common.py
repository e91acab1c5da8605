"""What every workflow shares: the one-line error, progress and log lines, sizes, and telling a
local folder from a Hub id before anything slow happens."""
from __future__ import annotations

import os
from pathlib import Path

from ..core.errors import AOQError


class UsageError(AOQError):
    """A failure to report as one line that says what to do (the command line prints it so)."""


SIZE_FORM = "an integer number of bytes, or a number with KB, MB, GB or TB like 500MB or 5GB"


def log(message: str) -> None:
    print(f"[hf-aoq] {message}", flush=True)


def progress(iterable=None, **kwargs):
    """A progress bar in transformers' style (its tqdm, which honours disable_progress_bar() and
    HF_HUB_DISABLE_PROGRESS_BARS)."""
    from transformers.utils import logging as hf_logging

    return hf_logging.tqdm(iterable, **kwargs)


def parse_size(value, option: str = "--max-shard-size") -> int:
    """`value` (an int, digits for bytes, or "5GB", "500MB", "1.5GB", "100KB" as save_pretrained's
    `max_shard_size` takes it) as a positive number of bytes. The units are huggingface_hub's own
    parser (`parse_size_to_int`, what save_pretrained's shard splitter calls): powers of 1000."""
    try:  # private, but it is exactly what save_pretrained's shard splitter reads the size with
        from huggingface_hub.serialization._base import parse_size_to_int
    except ImportError:  # renamed in some release: transformers' public parser (integer sizes only)
        from transformers.utils.hub import convert_file_size_to_int as parse_size_to_int

    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        text = str(value).strip()
        try:
            size = int(text) if text.isdigit() else parse_size_to_int(text)
        except (ValueError, OverflowError):
            size = None
    if size is None or size <= 0:
        raise UsageError(f"{option} {value}: not a size; give {SIZE_FORM}")
    return size


def looks_like_a_path(name: str) -> bool:
    """What the user most likely meant as a folder on this machine: it exists, it starts with
    ./ ../ / ~ (or a drive), it is not a valid Hub id, or its first part is an existing folder."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if os.path.exists(name) or name.startswith((".", "/", "~", "\\")) or (len(name) > 1 and name[1] == ":"):
        return True
    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    head = name.replace("\\", "/").split("/")[0]
    return "/" in name and os.path.isdir(head)


def check_model_source(model: str, *, revision: str | None = None, token: str | None = None) -> str:
    """Say at once what is wrong with MODEL (a checkpoint folder or a Hub model id) instead of a
    long network wait: a path that does not exist, a folder without config.json, a Hub id that
    the Hub does not have, or a Hub that cannot be reached (and no copy in the cache). Returns
    "folder" or "hub"."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"{model} has no config.json; give a checkpoint folder written by save_pretrained, "
                             f"or a Hub id")
        return "folder"
    if looks_like_a_path(model):
        where = "a file, not a folder" if path.is_file() else "no such folder"
        parent = path.parent if str(path.parent) not in ("", ".") else Path(".")
        hint = "" if parent.is_dir() else f" ({parent} does not exist either)"
        raise UsageError(f"{model}: {where}{hint}; give a checkpoint folder or a Hub id (owner/name)")
    check_hub_model(model, revision=revision, token=token)
    return "hub"


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def check_hub_model(repo_id: str, *, revision: str | None = None, token: str | None = None) -> None:
    """The Hub has `repo_id` at `revision` and this token may read it; or it is in the local cache
    when the Hub is offline or cannot be reached."""
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    def cached() -> bool:
        try:
            snapshot_download(repo_id, revision=revision, local_files_only=True, token=token)
            return True
        except Exception:  # not (fully) cached
            return False

    if constants.HF_HUB_OFFLINE:
        if not cached():
            raise UsageError(f"{repo_id}: not in the local Hub cache, and HF_HUB_OFFLINE is set; unset it, or "
                             f"give a local folder")
        return
    try:
        HfApi(token=token).model_info(repo_id, revision=revision, timeout=10)
    except GatedRepoError:
        raise UsageError(f"{repo_id} is gated: accept its terms on {hub_endpoint()}/{repo_id}, then log in "
                         f"(`hf auth login`, HF_TOKEN or --token)") from None
    except RevisionNotFoundError:
        raise UsageError(f"{repo_id} has no revision {revision!r}; give a branch, tag or commit of it") from None
    except RepositoryNotFoundError:
        hint = "" if (token or _token()) else "; for a private repo log in (`hf auth login`, HF_TOKEN or --token)"
        raise UsageError(f"{repo_id}: no such model on {hub_endpoint()} (check the spelling){hint}") from None
    except Exception as e:
        if not is_connection_error(e):
            raise
        if cached():
            log(f"cannot reach {hub_endpoint()} ({_reason(e)}); using the copy of {repo_id} in the local cache")
            return
        raise UsageError(f"cannot reach the Hub at {hub_endpoint()} ({_reason(e)}) to get {repo_id}, and it is "
                         f"not in the local cache; check the network, or give a local folder") from None


def is_connection_error(e: BaseException) -> bool:
    """No answer at all (refused, name lookup, timeout), as opposed to an HTTP error status.
    huggingface_hub's HTTP client (httpx, or its fork) raises TransportError subclasses, which
    are not OSErrors; they are matched by name so as not to import the client."""
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(e, HfHubHTTPError):  # an OSError too, but the Hub did answer
        return False
    names = {c.__name__ for c in type(e).__mro__}
    return isinstance(e, OSError) or bool(names & {"TransportError", "ConnectionError", "TimeoutException"})


def _token() -> str | None:
    from huggingface_hub import get_token

    return get_token()


def _reason(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."
