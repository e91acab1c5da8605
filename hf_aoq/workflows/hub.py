"""Pushing a saved checkpoint folder to the Hub (`hf-aoq push`, `quantize --push-to-hub`): the
token and repo are checked before any slow work, the card is merged with the one on the Hub,
and the folder goes up in one commit through huggingface_hub's `upload_folder`."""
from __future__ import annotations

import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .common import UsageError, _reason, hub_endpoint, is_connection_error, log

# Never uploaded: hidden files (.cache/, editor files) and hf_aoq's own temporary files.
IGNORE_PATTERNS = [".*", "**/.*", "*.tmp"]


@dataclass
class PushTarget:
    """Where a push goes, checked: `repo_id` as the Hub spells it (owner/name)."""

    repo_id: str
    token: str | None = None
    private: bool | None = None
    revision: str | None = None
    create_pr: bool = False

    def command(self, folder) -> str:
        """The `hf-aoq push` command that pushes `folder` here (to retry a failed push)."""
        parts = ["hf-aoq", "push", str(folder), self.repo_id]
        parts += ["--private"] if self.private else []
        parts += ["--revision", self.revision] if self.revision else []
        parts += ["--create-pr"] if self.create_pr else []
        return shlex.join(parts)


def check_push_target(repo_id: str, *, token: str | None = None, private: bool | None = None,
                      revision: str | None = None, create_pr: bool = False) -> PushTarget:
    """Check everything a push needs before the slow part: a valid repo id, a token the Hub
    accepts, and a repo this token may write (created now if it does not exist, as
    push_to_hub does). Raises UsageError saying what to fix."""
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise UsageError(f"{repo_id}: not a Hub repo id ({e}); give owner/name") from None
    token = token or get_token()
    if not token:
        raise UsageError("pushing needs a Hub token with write access: run `hf auth login`, set HF_TOKEN, or pass "
                         "--token")
    api = HfApi(token=token)
    user = None
    try:
        user = api.whoami()
        repo = api.create_repo(repo_id, exist_ok=True, private=private).repo_id
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", None)
        if status == 401:
            raise UsageError(f"{hub_endpoint()} does not accept this token (401); log in again (`hf auth login`) "
                             f"or pass another --token") from None
        if status == 403:
            raise UsageError(f"the token of {_name(user)} may not create or write {repo_id} (403); "
                             f"use a token with write access to its owner") from None
        raise UsageError(f"the Hub refused {repo_id}: {_reason(e)}") from None
    except Exception as e:
        if not is_connection_error(e):
            raise
        raise UsageError(f"cannot reach the Hub at {hub_endpoint()} ({_reason(e)}); nothing was done. Check the "
                         f"network, or quantize without --push-to-hub and run `hf-aoq push` later") from None
    return PushTarget(repo, token, private, revision, create_pr)


def _name(user) -> str:
    return user.get("name", "this user") if isinstance(user, dict) else "this user"


def push_folder(folder, target: PushTarget | str, *, base_model: str | None = None, quality=None,
                commit_message: str = "Upload hf_aoq quantized model") -> str:
    """Upload the checkpoint folder to the Hub in one commit. The folder's card is merged with
    the card already on the Hub (kept; the quantization section added or replaced) and written
    back to the folder first, so the folder is what the repo then holds. Returns the commit URL,
    or the pull request's with `create_pr`."""
    from huggingface_hub import HfApi, ModelCard, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    from .. import model_card
    from ..checkpoint import read_checkpoint

    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"{folder}: no such folder")
    target = target if isinstance(target, PushTarget) else check_push_target(target)
    info = read_checkpoint(folder, build=False)
    if not info.quantized:
        raise UsageError(f"{folder} holds no hf_aoq quantized tensor; quantize it first (`hf-aoq quantize`)")
    api = HfApi(token=target.token)
    local = folder / model_card.CARD_NAME
    existing = local.read_text(encoding="utf-8") if local.is_file() else ""
    if model_card.START in existing and model_card.END in existing:
        # The card hf-aoq quantize wrote (base model, quality figures): only the name to load changes.
        card = model_card.with_load_name(existing, target.repo_id)
    else:
        card = model_card.render_card(info, base_model=base_model, load_name=target.repo_id, quality=quality)
        card = model_card.merge(existing, card)
    with tempfile.TemporaryDirectory(prefix="hf_aoq_card_") as tmp:
        try:
            hub_card = hf_hub_download(target.repo_id, model_card.CARD_NAME, revision=target.revision,
                                       cache_dir=tmp, token=target.token)
            card = model_card.merge(Path(hub_card).read_text(encoding="utf-8"), card)
        except EntryNotFoundError:
            pass
        except Exception as e:  # a new branch has no card yet; any other answer is reported below
            if "RevisionNotFound" not in type(e).__name__:
                raise
    from ..serialization import write_atomic

    ModelCard(card).validate()  # the Hub's own check of the front matter; ValueError says what is wrong
    write_atomic(local, card)
    if target.revision and not target.create_pr:
        api.create_branch(target.repo_id, branch=target.revision, exist_ok=True)
    files = sum(1 for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    log(f"uploading {files} files from {folder} to {target.repo_id}"
        + (f" (branch {target.revision})" if target.revision else "") + (" as a pull request" if target.create_pr else ""))
    # upload_folder makes one commit and skips what the Hub already has. (huggingface_hub's
    # upload_large_folder, resumable over many commits, is not in every version it supports.)
    info = api.upload_folder(folder_path=str(folder), repo_id=target.repo_id, revision=target.revision,
                             create_pr=target.create_pr, commit_message=commit_message,
                             ignore_patterns=IGNORE_PATTERNS)
    return info.pr_url if target.create_pr and getattr(info, "pr_url", None) else info.commit_url


def push_failed(folder, target: PushTarget, error: BaseException) -> UsageError:
    """The error for a push that failed after the checkpoint was saved: what is where, and the
    command that retries."""
    return UsageError(f"the checkpoint is saved in {folder}, but pushing it to {target.repo_id} failed "
                      f"({type(error).__name__}: {_reason(error)}); retry with: {target.command(folder)}")
