"""Models named by a hub id: checked once, early, with one plain message for each way it can fail.

`from_pretrained` without a network retries every file for half a minute and then blames the repository
("does not appear to have a file named config.json"). Before any long work, `check_hub_model` asks the hub
once, with a short timeout, about the repository, the revision and the files the family needs, and turns
each failure into a message that says what is wrong, where, and what to do:

- the hub cannot be reached (no network, a proxy, a firewall): download the model, or use the hub cache
  offline (`HF_HUB_OFFLINE=1`) when the model is in it;
- `HF_HUB_OFFLINE=1` and the model is not in the hub cache;
- no such repository (or a private one), a gated one, a revision that does not exist;
- a repository without a subfolder the family needs.
"""

from __future__ import annotations

import os
from pathlib import Path

from vidtune.errors import ModelError

# Seconds to wait for the hub's answer: long enough for a slow link, short enough to fail "within seconds".
PROBE_TIMEOUT_S = 8.0


def looks_local(source: str) -> bool:
    """A folder path rather than a hub id: absolute, starting with `.` or `~`, or an existing path."""
    return os.path.isabs(source) or source.startswith((".", "~")) or os.path.exists(source)


def offline_mode() -> bool:
    """`HF_HUB_OFFLINE=1` (read by huggingface_hub when it is imported, as the loaders see it)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def cached_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The folder of `repo_id` at `revision` in this machine's hub cache, or None when it is not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None


def _download_hint(repo_id: str, revision: str | None, setting: str = "model.pretrained") -> str:
    folder = repo_id.rsplit("/", 1)[-1]
    rev = f" --revision {revision}" if revision else ""
    return (f"download it where there is network: `hf download {repo_id}{rev} --local-dir {folder}`, bring the "
            f"folder here and set {setting} to that folder")


def _where(repo_id: str, revision: str | None) -> str:
    return f"{repo_id}" + (f" at revision {revision}" if revision else "")


class HubCheck:
    """`check_hub_model` asked at most once per model by whoever holds this object: a spec holds one for its run,
    so its early checks (the model's files, then each shape check reading a config) make one request, and nothing
    is remembered beyond the run. A failure is not remembered: asking again asks the hub again."""

    def __init__(self) -> None:
        self._passed: set[tuple[str, str | None, str, tuple[str, ...], str | None]] = set()

    def __call__(self, repo_id: str, revision: str | None, family: str, components: tuple[str, ...],
                 folder: str | None = None) -> None:
        key = (repo_id, revision, family, components, folder)
        if key not in self._passed:
            check_hub_model(repo_id, revision, family, components, folder)
            self._passed.add(key)


def check_hub_model(repo_id: str, revision: str | None, family: str, components: tuple[str, ...],
                    folder: str | None = None, setting: str = "model.pretrained") -> None:
    """Raise a ModelError naming what to do when `repo_id` cannot give the family's `components`. `folder`: the
    folder `repo_id` was first looked for as (a relative path), named when the hub has no such model either;
    `setting`: the setting that named it, as the messages name it. Asks every time it is called; `HubCheck` asks
    once."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import (
        DisabledRepoError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = _where(repo_id, revision)
    if offline_mode():
        snapshot = cached_snapshot(repo_id, revision)
        if snapshot is None:
            raise ModelError(
                f"{setting}: {where} is not in this machine's hub cache ({constants.HF_HUB_CACHE}), and "
                f"HF_HUB_OFFLINE=1 forbids downloading it.{_no_folder(folder)}\n"
                "What to do: unset HF_HUB_OFFLINE to let vidtune download it, or "
                f"{_download_hint(repo_id, revision, setting)}."
            )
        present = {name for name in components if (snapshot / name).is_dir()}
        _check_components(repo_id, revision, family, components, present, f"the cached copy in {snapshot}")
        return

    try:
        info = HfApi().model_info(repo_id, revision=revision, timeout=PROBE_TIMEOUT_S)
    except HFValidationError:
        raise ModelError(
            f"{setting}: '{repo_id}' is neither an existing folder nor a valid hub id (owner/name)."
            f"{_no_folder(folder)}\n"
            f"What to do: point {setting} at a model folder in the diffusers layout (relative paths in a "
            "config file are relative to the file's folder), or give a hub id such as Lightricks/LTX-Video."
        ) from None
    except GatedRepoError:
        raise ModelError(
            f"{setting}: {repo_id} is a gated repository on the hub, and this machine has no access to it.\n"
            f"What to do: accept its licence at {constants.ENDPOINT}/{repo_id} (logged in), then log in here with "
            "`hf auth login` (or set HF_TOKEN) and run again."
        ) from None
    except RevisionNotFoundError:
        raise ModelError(
            f"model.revision: {revision!r} is not a branch, tag or commit of {repo_id}.\n"
            f"What to do: pick one listed at {constants.ENDPOINT}/{repo_id}/tree/main (branches and tags) or "
            "remove model.revision to use the main branch."
        ) from None
    except RepositoryNotFoundError:
        raise ModelError(
            f"{setting}: there is no model {repo_id} on the hub (or it is private and this machine is not "
            f"logged in), nor a local folder of that name.{_no_folder(folder)}\n"
            "What to do: check the spelling of the hub id (e.g. Lightricks/LTX-Video); for a private model run "
            "`hf auth login`; for a local folder give its path (relative paths in a config file are relative to "
            "the file's folder)."
        ) from None
    except DisabledRepoError:
        raise ModelError(f"{setting}: {repo_id} has been disabled on the hub by its author.\n"
                         "What to do: use another copy of the model (a local folder or another hub id).") from None
    except HfHubHTTPError as error:
        status = getattr(getattr(error, "response", None), "status_code", "?")
        raise ModelError(
            f"{setting}: the hub ({constants.ENDPOINT}) answered with an error ({status}) about {where}.\n"
            f"What to do: try again in a few minutes, or {_download_hint(repo_id, revision, setting)}."
        ) from None
    except Exception as error:  # no answer at all (DNS, refused, timeout, proxy): the hub is unreachable
        raise ModelError(_unreachable_message(repo_id, revision, error, setting)) from None
    present = {name for name in components
               if any(sibling.rfilename.startswith(f"{name}/") for sibling in info.siblings or [])}
    _check_components(repo_id, revision, family, components, present, f"the hub repository {where}")


def _no_folder(folder: str | None) -> str:
    if folder is None:
        return ""
    return (f" As a folder it was looked for at {folder}, which does not exist (a relative path in a config file is "
            "relative to the file's folder; on the command line, to the current folder).")


def _unreachable_message(repo_id: str, revision: str | None, error: BaseException,
                         setting: str = "model.pretrained") -> str:
    from huggingface_hub import constants

    reason = f"{type(error).__name__}: {error}".strip().rstrip(":")
    snapshot = cached_snapshot(repo_id, revision)
    lines = [f"{setting}: cannot reach the Hugging Face hub ({constants.ENDPOINT}) to get "
             f"{_where(repo_id, revision)} ({reason}). Nothing was started."]
    if snapshot is not None:
        lines.append(f"What to do: the model is in this machine's hub cache ({snapshot}); run again with "
                     "HF_HUB_OFFLINE=1 to use it without the network.")
    else:
        lines.append(f"What to do: check the network (or the proxy settings), or "
                     f"{_download_hint(repo_id, revision, setting)}.")
    return "\n".join(lines)


def _check_components(repo_id: str, revision: str | None, family: str, components: tuple[str, ...],
                      present: set[str], where: str) -> None:
    missing = [name for name in components if name not in present]
    if missing:
        raise ModelError(
            f"model.pretrained: {where} has no {', '.join(missing)} subfolder(s), which a {family} model in the "
            f"diffusers layout has ({', '.join(components)}).\n"
            f"What to do: check that {repo_id} is a {family} model in the diffusers layout and that model.name "
            "is right, or give the missing parts with model.subfolders (e.g. {transformer: /path/to/transformer})."
        )
