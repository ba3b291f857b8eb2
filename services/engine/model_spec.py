"""Where a model *spec* (``--model``) lives, without loading torch: a random preset's
name, a shipped model's folder, a checkpoint directory, or a Hugging Face hub id's
snapshot (see :mod:`.checkpoint`, which loads it and re-exports these). ``kvmesh up``
checks its ``--model`` with :func:`resolve_model` before etcd starts; importing torch
there would cost the launcher seconds before anything starts."""

from __future__ import annotations

import os

from .config import PRESETS, SHIPPED_MODELS


class CheckpointError(ValueError):
    """A model directory is missing a file or holds a malformed / unsupported one."""


# what a hub snapshot needs: config, weights (single or sharded + index), tokenizer files
HUB_PATTERNS = ["*.json", "*.safetensors"]


def model_names() -> str:
    """The names ``--model`` knows without a path: the random presets and the shipped models."""
    return ", ".join([*PRESETS, *SHIPPED_MODELS])


def shipped_model_dir(name: str) -> str:
    """The folder of a model shipped with kvmesh (package data beside this module)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), SHIPPED_MODELS[name])


def is_hub_id(spec: str) -> bool:
    """Whether ``spec`` reads as a Hugging Face hub id ``org/name`` (a valid repo id)."""
    if spec.count("/") != 1:
        return False
    try:
        from huggingface_hub.utils import validate_repo_id
    except ImportError:
        return False
    try:
        validate_repo_id(spec)
    except ValueError:  # HFValidationError
        return False
    return True


def resolve_model(spec: str, download: bool = True) -> str | None:
    """Where the model ``spec`` lives: a random preset's name as is, anything else as the
    absolute path of a checkpoint directory (see the module docstring for the order).

    ``download=False`` only looks: a hub id missing from the cache is then ``None`` (to be
    downloaded at load time) unless the hub is offline, where it is an error at once.
    Raises :class:`CheckpointError` with what to fix."""
    if spec in PRESETS:
        return spec
    if spec in SHIPPED_MODELS:
        path = shipped_model_dir(spec)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise CheckpointError(
                f"model: the shipped model {spec!r} is missing from this install ({path}); "
                f"reinstall kvmesh or write it with `python scripts/train_demo.py`"
            )
        return path
    if os.path.isdir(spec):
        return os.path.abspath(spec)
    if not is_hub_id(spec):
        raise CheckpointError(
            f"model: {spec!r} is neither a preset ({model_names()}), a model directory "
            f"nor a Hugging Face hub id (org/name)"
        )
    return hub_snapshot(spec, download)


def hub_snapshot(repo_id: str, download: bool = True) -> str | None:
    """The local snapshot folder of hub id ``repo_id`` (see :func:`resolve_model`)."""
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise CheckpointError(
            f"model: {repo_id!r} is not a local directory, and Hugging Face hub ids need "
            f"huggingface_hub: pip install 'kvmesh[engine]'"
        ) from None
    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        path = snapshot_download(
            repo_id, allow_patterns=HUB_PATTERNS, local_files_only=offline or not download
        )
    except LocalEntryNotFoundError:
        if not download and not offline:
            return None
        cache = constants.HF_HUB_CACHE
        raise CheckpointError(
            f"model: {repo_id!r} is not a local directory, and not in the Hugging Face "
            f"cache {cache}: HF_HUB_OFFLINE is set, so nothing is downloaded; download it "
            f"where the hub is reachable (`hf download {repo_id}` with HF_HOME pointing at "
            f"that cache) or unset HF_HUB_OFFLINE"
            if offline
            else f"model: {repo_id!r} is not a local directory, not in the Hugging Face "
            f"cache {cache}, and could not be downloaded from the hub (is the hub reachable, "
            f"is the id right?)"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise CheckpointError(
            f"model: cannot get {repo_id!r} from the Hugging Face hub: {e}"
        ) from None
    return str(path)
