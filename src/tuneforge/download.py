"""`tuneforge download REPO_ID --local-dir D`: fetch a model (or dataset) repo from the Hugging Face hub.

A thin wrapper over `huggingface_hub.snapshot_download` (resumable, parallel, cached) that
turns network, offline and not-found failures into one line naming the fix.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tuneforge.errors import ConfigError
from tuneforge.flags import POSITIONAL, add_model_flags, parse_options
from tuneforge.options import PATH


class DownloadOptions(BaseModel):
    """`tuneforge download`'s arguments; their names are `download`'s parameters."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    repo_id: str = Field(description="e.g. sentence-transformers/all-MiniLM-L6-v2", json_schema_extra=POSITIONAL)
    local_dir: str | None = Field(
        None, description="folder to download into (default: the hub cache)", json_schema_extra=PATH
    )
    include: list[str] | None = Field(
        None,
        description="only files matching this glob (repeatable), e.g. '*.safetensors'",
        json_schema_extra={"flag_kwargs": {"metavar": "PATTERN"}},
    )
    exclude: list[str] | None = Field(
        None,
        description="skip files matching this glob (repeatable), e.g. '*.bin'",
        json_schema_extra={"flag_kwargs": {"metavar": "PATTERN"}},
    )
    repo_type: Literal["model", "dataset", "space"] = Field("model", description="what kind of hub repo REPO_ID is")
    revision: str | None = Field(None, description="branch, tag or commit (default: main)")


def check_download_folder(folder: Path) -> None:
    """--local-dir is new, empty, or an earlier download's folder (huggingface_hub keeps its records in
    .cache/huggingface there): a download writes the repo's files over same-named ones, so a folder of the
    user's own files is refused."""
    if not folder.is_dir() or (folder / ".cache" / "huggingface").is_dir():
        return
    held = sorted(p.name for p in folder.iterdir())
    if held:
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise ConfigError(
            f"--local-dir {str(folder)!r} holds files that no download put there ({shown}); the repo's files would "
            "replace same-named ones: choose a new or empty folder"
        )


def check_local_dir(local_dir: str) -> None:
    """--local-dir checked before any network access: a folder (not a file), outside the places tuneforge
    refuses to write into, holding nothing a download did not put there."""
    from tuneforge.paths import check_output_dir

    if Path(local_dir).exists() and not Path(local_dir).is_dir():
        raise ConfigError(f"--local-dir {local_dir!r} is a file; pass a folder")
    check_output_dir(local_dir, "--local-dir", "folder")
    check_download_folder(Path(local_dir))


def download(
    repo_id: str,
    local_dir: str | None = None,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    repo_type: str = "model",
    revision: str | None = None,
) -> Path:
    """Download `repo_id` (only files matching `include`, none matching `exclude`); returns the folder."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if local_dir:
        check_local_dir(local_dir)
    what = f"{repo_type} {repo_id!r}"
    try:
        path = snapshot_download(
            repo_id,
            repo_type=repo_type,
            revision=revision,
            local_dir=local_dir,
            allow_patterns=include or None,
            ignore_patterns=exclude or None,
        )
    except LocalEntryNotFoundError:
        why = "offline mode is on (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else "the hub could not be reached"
        raise ConfigError(
            f"could not download {what}: {why}; connect to the internet (unset HF_HUB_OFFLINE), "
            "or copy the files to this machine and give their folder where the repo id would go (train --model or "
            "--data-dir, predict, serve)"
        ) from None
    except GatedRepoError:
        raise ConfigError(
            f"{what} is gated; accept its terms on huggingface.co and log in with `hf auth login`"
        ) from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"{what} was not found on the hub (or is private); check the name, "
            "use --repo-type dataset for datasets, or log in with `hf auth login`"
        ) from None
    except HFValidationError as err:  # a malformed repo id, checked before any network access
        reason = str(err).strip().splitlines()[0][:200]
        raise ConfigError(
            f"{repo_id!r} is not a hub repo id ({reason}); pass one like sentence-transformers/all-MiniLM-L6-v2"
        ) from None
    except RevisionNotFoundError:
        raise ConfigError(f"{what} has no revision {revision!r}; pass an existing branch, tag or commit") from None
    except (HfHubHTTPError, OSError) as err:
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise ConfigError(f"could not download {what} ({first}); check the network and try again") from None
    return Path(path)


def cmd_download(ns: argparse.Namespace) -> int:
    options = parse_options(DownloadOptions, ns)
    path = download(**options.model_dump())
    print(f"downloaded {options.repo_id} to {path}", file=sys.stderr, flush=True)
    print(path, flush=True)
    return 0


def add_arguments(p) -> None:
    """`tuneforge download`'s arguments: DownloadOptions' fields (the CLI lists the command and its help)."""
    add_model_flags(p, DownloadOptions)
    p.set_defaults(func=cmd_download)
