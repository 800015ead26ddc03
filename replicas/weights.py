"""Where a model's weights come from, and what that source holds.

A catalog entry's ``source`` is one of:

- ``{"kind": "hf", "repo": "org/name", "revision": "<commit, tag or branch>",
  "endpoint": "https://mirror.internal"}``: a Hugging Face repository, read
  through ``huggingface_hub`` at ``endpoint`` (default
  ``LLMGW_HF_ENDPOINT``: the hub, or a mirror inside the cluster);
- ``{"kind": "http", "url": "https://files.internal/llama-70b/",
  "manifest": "<url of manifest.json>"}``: files under ``url`` listed by a
  manifest (``{"files": [{"name", "size", "sha256"}], "revision"?}``, by
  default ``<url>/manifest.json``);
- ``{"kind": "path", "path": "/shared/models/llama-70b"}``: a shared
  filesystem mounted on the nodes, used in place, never copied;
- ``{"kind": "none"}``: no source; the weights were placed by hand at the
  entry's ``weights`` path, and the model goes only to nodes that report them
  (an air-gapped cluster);
- ``{}``: not managed: every node is taken to hold the weights (as before
  sources existed).

``source_problems`` checks the shape (pure; ``source_unknown_keys`` names a
key it does not know for the kind, with the close known one suggested, as
``core.strict`` does for every other key of a catalog entry); ``source_resolve`` turns a source
into a manifest once, when the catalog is applied, so that a source that
cannot be resolved is refused then (``SourceUnresolvable``), not found out
when a node starts to fetch. It does network I/O: call it outside any
transaction.
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from django.conf import settings

from core.strict import unknown_keys

logger = logging.getLogger(__name__)

KINDS = ("hf", "http", "path", "none")
KEYS = {
    "hf": ({"kind", "repo", "revision"}, {"endpoint"}),
    "http": ({"kind", "url"}, {"manifest"}),
    "path": ({"kind", "path"}, set()),
    "none": ({"kind"}, set()),
}
# Copied into a node's cache (the others are read where they are).
FETCHED = frozenset({"hf", "http"})
HF_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
REVISION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
# A file of a manifest: a relative POSIX path of plain parts.
FILE_PART_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+=-]{0,254}$")
MAX_FILES = 10000
# Files the hub keeps in git rather than LFS are small; their sha256 is
# computed at apply by downloading them, up to this size.
SMALL_FILE_LIMIT = 64 * 1024 * 1024


class SourceUnresolvable(Exception):
    """The source cannot be read now: the message says what and what to do."""


def _url_problem(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        return f"{what} must be an http:// or https:// URL"
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{what} {value[:120]!r} is not an http:// or https:// URL"
    if parts.username or parts.password:
        return f"{what} must not carry credentials"
    return ""


def source_unknown_keys(source: Any) -> dict[str, str]:
    """Each key of the source its kind does not know, with its message
    (``repoo: unknown key; did you mean repo?``); for a kind that is missing
    or unknown, the keys of every kind are known (``knid`` is close to kind)."""
    if not isinstance(source, dict):
        return {}
    kind = source.get("kind")
    kinds = [KEYS[kind]] if isinstance(kind, str) and kind in KEYS else list(KEYS.values())
    return unknown_keys(source, sorted(set().union(*(required | optional for required, optional in kinds))))


def source_problems(source: Any) -> list[str]:
    """What is wrong with a source's shape ([] when nothing)."""
    if source in ({}, None):
        return []
    if not isinstance(source, dict):
        return ["must be a mapping with kind: hf, http, path or none"]
    kind = source.get("kind")
    problems = [f"{key}: {message}" for key, message in source_unknown_keys(source).items()]
    if kind not in KINDS:
        return [*problems, f"kind must be one of {', '.join(KINDS)}, got {kind!r}"]
    required, _ = KEYS[kind]
    problems += [f"kind {kind} needs {key!r}" for key in sorted(required - set(source))]
    if problems:
        return problems
    if kind == "hf":
        if not isinstance(source["repo"], str) or not HF_REPO_RE.match(source["repo"]):
            problems.append(f"repo {source['repo']!r} is not a repository id such as 'org/name'")
        if not isinstance(source["revision"], str) or not REVISION_RE.match(source["revision"]) \
                or ".." in source["revision"]:
            problems.append(f"revision {source['revision']!r} is not a commit, tag or branch name")
        if "endpoint" in source and (p := _url_problem(source["endpoint"], "endpoint")):
            problems.append(p)
    elif kind == "http":
        problems += [p for p in (_url_problem(source["url"], "url"),
                                 _url_problem(source.get("manifest", "http://x/"), "manifest")) if p]
    elif kind == "path":
        path = source["path"]
        if not isinstance(path, str) or not path.startswith("/") or posixpath.normpath(path) != path.rstrip("/") \
                or "\x00" in path:
            problems.append(f"path {str(path)[:120]!r} must be an absolute, normalised path")
    return problems


def file_name_problem(name: Any) -> str:
    """Why ``name`` cannot be a file of a manifest ('' when it can): a
    relative path of plain parts, never '..', never absolute."""
    if not isinstance(name, str) or not name or len(name) > 1024:
        return f"{str(name)[:80]!r} is not a file name"
    parts = name.split("/")
    if any(not FILE_PART_RE.match(part) or part in (".", "..") for part in parts):
        return f"{name[:120]!r} is not a relative path of plain parts"
    return ""


@dataclass(frozen=True)
class ManifestFile:
    name: str
    size: int
    sha256: str
    url: str


def manifest_build(*, kind: str, revision: str, files: list[ManifestFile], location: str) -> dict[str, Any]:
    names = [f.name for f in files]
    if len(set(names)) != len(names):
        raise SourceUnresolvable(f"{location} lists a file twice")
    for f in files:
        if problem := file_name_problem(f.name):
            raise SourceUnresolvable(f"{location}: {problem}")
        if not SHA256_RE.match(f.sha256) or f.size < 0:
            raise SourceUnresolvable(f"{location}: {f.name} has no valid size and sha256")
    return {
        "kind": kind,
        "revision": revision,
        "files": [{"name": f.name, "size": f.size, "sha256": f.sha256, "url": f.url}
                  for f in sorted(files, key=lambda f: f.name)],
        "total_bytes": sum(f.size for f in files),
    }


def source_resolve(source: dict[str, Any], *, weights: str = "") -> dict[str, Any]:
    """The manifest of a (valid) source; SourceUnresolvable says why not."""
    if not source:
        return {}
    kind = source["kind"]
    _check_allowed_host(source)
    if kind == "hf":
        return _resolve_hf(source)
    if kind == "http":
        return _resolve_http(source)
    # Read where they are: nothing to list, nothing copied. The agents say
    # whether they see them (kind none: at the entry's weights path).
    where = source["path"] if kind == "path" else weights
    return {"kind": kind, "revision": "local", "path": where, "files": [], "total_bytes": 0}


def _check_allowed_host(source: dict[str, Any]) -> None:
    allowed = {h.lower() for h in settings.LLMGW_WEIGHTS_ALLOWED_HOSTS}
    if not allowed or source["kind"] not in FETCHED:
        return
    urls = [source.get("endpoint") or settings.LLMGW_HF_ENDPOINT] if source["kind"] == "hf" else \
        [source["url"], source.get("manifest") or source["url"]]
    for url in urls:
        host = (urlsplit(url).hostname or "").lower()
        if host not in allowed:
            raise SourceUnresolvable(f"{host} is not among LLMGW_WEIGHTS_ALLOWED_HOSTS ({', '.join(sorted(allowed))}): "
                                     "this cluster fetches weights only from its own mirrors")


def _resolve_http(source: dict[str, Any]) -> dict[str, Any]:
    base = source["url"] if source["url"].endswith("/") else source["url"] + "/"
    manifest_url = source.get("manifest") or base + "manifest.json"
    try:
        with httpx.Client(timeout=settings.LLMGW_WEIGHTS_RESOLVE_TIMEOUT, follow_redirects=True,
                          trust_env=False) as client:
            response = client.get(manifest_url)
    except httpx.HTTPError as exc:
        raise SourceUnresolvable(f"cannot read the manifest {manifest_url}: {exc.__class__.__name__}: {exc}; "
                                 "check that the server is up and reachable from the control plane") from None
    if response.status_code != 200:
        raise SourceUnresolvable(f"the manifest {manifest_url} answered HTTP {response.status_code}; "
                                 "check the url (the manifest is <url>/manifest.json unless 'manifest' says)")
    try:
        data = response.json()
        entries = data["files"]
        if not isinstance(entries, list) or not entries or len(entries) > MAX_FILES:
            raise ValueError("files must be a non-empty list")
        files = []
        for entry in entries:
            name, size, sha = entry["name"], entry["size"], entry["sha256"]
            if not isinstance(size, int) or isinstance(size, bool) or not isinstance(sha, str):
                raise ValueError(f"{name!r}: size must be an integer and sha256 a string")
            if problem := file_name_problem(name):
                raise ValueError(problem)
            files.append(ManifestFile(name, size, sha.lower(), base + name))
    except (ValueError, KeyError, TypeError) as exc:
        raise SourceUnresolvable(f"the manifest {manifest_url} is not a list of files with name, size and sha256: "
                                 f"{exc}") from None
    revision = data.get("revision") if isinstance(data.get("revision"), str) else ""
    if not revision or not REVISION_RE.match(revision):
        revision = hashlib.sha256(response.content).hexdigest()[:16]
    return manifest_build(kind="http", revision=revision, files=files, location=manifest_url)


def _resolve_hf(source: dict[str, Any]) -> dict[str, Any]:
    try:  # a heavy import, needed only by sources of kind hf
        from huggingface_hub import HfApi, hf_hub_url  # noqa: PLC0415
        from huggingface_hub.errors import (  # noqa: PLC0415
            HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError,
        )
    except ImportError:
        raise SourceUnresolvable("huggingface_hub is not installed where the control plane runs "
                                 "(requirements.txt lists it); install it, or use a source of kind http") from None

    endpoint = (source.get("endpoint") or settings.LLMGW_HF_ENDPOINT).rstrip("/")
    repo, revision = source["repo"], source["revision"]
    api = HfApi(endpoint=endpoint, token=settings.LLMGW_HF_TOKEN or False)
    where = f"{repo} at {revision} on {endpoint}"
    try:
        info = api.model_info(repo, revision=revision, files_metadata=True,
                              timeout=settings.LLMGW_WEIGHTS_RESOLVE_TIMEOUT)
        commit = info.sha or ""
        if not re.match(r"^[0-9a-f]{40}$", commit):
            raise SourceUnresolvable(f"{where}: the hub named no commit for this revision")
        files = []
        for sibling in info.siblings or []:
            url = hf_hub_url(repo, sibling.rfilename, revision=commit, endpoint=endpoint)
            if sibling.lfs is not None:
                files.append(ManifestFile(sibling.rfilename, int(sibling.lfs.size), sibling.lfs.sha256.lower(), url))
            else:
                size, sha = _hash_small(api, repo, sibling.rfilename, commit, sibling.size)
                files.append(ManifestFile(sibling.rfilename, size, sha, url))
    except RevisionNotFoundError:
        raise SourceUnresolvable(f"{where}: no such revision; give a commit, tag or branch of the repository") from None
    except RepositoryNotFoundError:
        raise SourceUnresolvable(f"{where}: no such repository (or it is private and LLMGW_HF_TOKEN "
                                 "does not grant it)") from None
    except HfHubHTTPError as exc:
        raise SourceUnresolvable(f"{where}: the hub answered {exc}") from None
    except (OSError, ValueError, Exception) as exc:  # the hub's client raises its HTTP library's errors
        if isinstance(exc, SourceUnresolvable):
            raise
        raise SourceUnresolvable(f"{where}: cannot reach the hub ({exc.__class__.__name__}: {exc}); check the "
                                 "endpoint, or set LLMGW_HF_ENDPOINT to a mirror inside the cluster") from None
    if not files:
        raise SourceUnresolvable(f"{where}: the repository holds no files")
    return manifest_build(kind="hf", revision=commit, files=files, location=where) | {
        "repo": repo, "endpoint": endpoint}


def _hash_small(api, repo: str, name: str, commit: str, size: int | None) -> tuple[int, str]:
    """A file the hub keeps in git (no LFS sha256): downloaded once and hashed."""
    if size is not None and size > SMALL_FILE_LIMIT:
        raise SourceUnresolvable(f"{repo}: {name} is {size} bytes and not in LFS: no sha256 to check it by")
    with tempfile.TemporaryDirectory(prefix="llmgw-resolve-") as tmp:
        path = Path(api.hf_hub_download(repo, name, revision=commit, local_dir=tmp))
        data = path.read_bytes()
    return len(data), hashlib.sha256(data).hexdigest()


def source_summary(source: dict[str, Any]) -> str:
    """One line for listings: where the weights come from."""
    if not source:
        return "unmanaged"
    kind = source.get("kind")
    if kind == "hf":
        return f"hf:{source.get('repo')}@{str(source.get('revision'))[:12]}"
    if kind == "http":
        return f"http:{source.get('url')}"
    if kind == "path":
        return f"shared:{source.get('path')}"
    return "none (placed by hand)"


def manifest_json(manifest: dict[str, Any]) -> str:
    return json.dumps(manifest, sort_keys=True)
