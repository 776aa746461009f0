"""Where a model's files come from. `--model` names, in this order:

1. a local folder (a Hugging Face checkpoint: config.json, safetensors, tokenizer);
2. the built-in demo model (config.DEMO_MODEL), which ships inside the package;
3. a Hugging Face model id, fetched with huggingface_hub into its cache
   (HF_HOME; HF_TOKEN for gated or private models; HF_HUB_OFFLINE=1 to use
   only what is cached).

Every failure is a FileNotFoundError (PermissionError for a gated model) that
names the model and says what to do, raised at once: a server that cannot get
its model should not sit in a retry loop before saying so."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from aioserve.config import DEMO_MODEL

logger = logging.getLogger(__name__)

DEMO_MODEL_DIR = Path(__file__).resolve().parents[1] / "demo_model"

# What the engine and tokenizer read. Leaves out other formats' weights
# (*.bin, *.pth, *.gguf, onnx/), which can be many times the model's size.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """The local folder holding `model`'s files (downloading them if needed)."""
    path = Path(model).expanduser()
    if path.is_dir():
        _ignored_revision(model, revision)
        return path
    if model == DEMO_MODEL:
        _ignored_revision(model, revision)
        logger.info(
            "model %s: the built-in demo model (a 260K-parameter TinyStories Llama, MIT) at %s; "
            "pass --model for a real one", model, DEMO_MODEL_DIR,
        )
        return DEMO_MODEL_DIR
    if _looks_like_a_path(model):
        raise FileNotFoundError(f"model {model!r}: no such folder ({path.resolve()})")
    return fetch_from_hub(model, revision)


def _ignored_revision(model: str, revision: str | None) -> None:
    if revision is not None:
        logger.warning("--revision %s ignored: %s is not a Hugging Face id", revision, model)


def _looks_like_a_path(model: str) -> bool:
    """A hub id is `name` or `org/name`; anything else was meant as a folder,
    and asking the hub about it would only give a confusing error."""
    return model.startswith((".", "/", "~")) or model.count("/") > 1 or "\\" in model


class DownloadBar(tqdm):
    """huggingface_hub's own bars hide themselves when stderr is not a
    terminal, which is where a server's output goes (`docker logs`, a log
    file): this one always shows, redrawing every 10 s off a terminal so a
    multi-GB download does not flood the log."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from huggingface_hub import constants

        kwargs.pop("name", None)  # huggingface_hub's bar-group name; plain tqdm rejects it
        kwargs.setdefault("mininterval", 0.5 if sys.stderr.isatty() else 10.0)
        kwargs["disable"] = kwargs.get("disable") or constants.HF_HUB_DISABLE_PROGRESS_BARS is True
        super().__init__(*args, **kwargs)


def fetch_from_hub(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot folder of a Hugging Face model in the hub cache, downloaded
    unless HF_HUB_OFFLINE is set (then it must already be cached)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = bool(constants.HF_HUB_OFFLINE)
    named = f"{repo_id!r}" + (f" (revision {revision})" if revision else "")
    logger.info("model %s: %s the Hugging Face cache at %s", named,
                "looking in (HF_HUB_OFFLINE is set)" if offline else "fetching into", constants.HF_HUB_CACHE)
    try:
        folder = snapshot_download(
            repo_id, revision=revision, allow_patterns=HUB_PATTERNS, local_files_only=offline, tqdm_class=DownloadBar,
        )
    except HFValidationError as exc:
        raise FileNotFoundError(f"model {repo_id!r} is neither a local folder nor a Hugging Face id ({exc})") from None
    except GatedRepoError:  # a RepositoryNotFoundError, so first
        raise PermissionError(
            f"model {named} is gated: accept its terms on https://huggingface.co/{repo_id} and set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"model {repo_id!r} is neither a local folder nor a Hugging Face model (set HF_TOKEN if it is private)"
        ) from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"model {repo_id!r} has no revision {revision!r}") from None
    except LocalEntryNotFoundError as exc:
        reason = "HF_HUB_OFFLINE is set" if offline else f"the Hugging Face hub cannot be reached ({exc.__cause__})"
        raise FileNotFoundError(
            f"model {named} is neither a local folder nor in the Hugging Face cache at {constants.HF_HUB_CACHE}, "
            f"and {reason}. Download it where the hub is reachable (`hf download {repo_id}`, same HF_HOME), "
            "or pass a local folder."
        ) from None
    logger.info("model %s: %s", named, folder)
    return Path(folder)
