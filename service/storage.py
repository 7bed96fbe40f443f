"""Where checkpoints live: a local folder, or any storage fsspec reaches (``s3://bucket/prefix``).

Local paths (``str`` or ``Path``) and ``file://`` URLs are the local disk; anything else is
remote storage without rename (object storage), which service/checkpoint.py writes in place.

Credentials and the endpoint of S3 come only from the usual environment of the process that
touches the storage (the server's and every Ray worker's): ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY`` (and ``AWS_SESSION_TOKEN``), ``AWS_ENDPOINT_URL`` for storage other
than AWS (MinIO, Ceph, ...) and ``AWS_DEFAULT_REGION``; botocore reads them itself, a spec never
holds them.

Filesystem objects are cached per process and per value of those variables (not through
fsspec's own instance cache, which ignores the environment), with S3 directory listings never
cached: a listing after another process wrote sees the write.
"""
from __future__ import annotations

import importlib.util
import os
import posixpath
import threading
from pathlib import Path
from typing import Union

import fsspec
from fsspec.implementations.local import LocalFileSystem

PathLike = Union[str, os.PathLike]

# what a person can use beside a local folder: protocol -> (how to write it, fsspec's class)
_REMOTE = {
    "s3": ("s3://bucket/prefix", "s3fs.S3FileSystem"),
    "gs": ("gs://bucket/prefix", "gcsfs.GCSFileSystem"),
    "abfs": ("abfs://container/prefix", "adlfs.AzureBlobFileSystem"),
}
# the environment a remote filesystem is made from: a change makes a new one
_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE",
        "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")
CHECK_TIMEOUT = 3.0  # seconds, per connect and per read, of check_url

_cache: dict = {}
_lock = threading.Lock()
_local_fs = LocalFileSystem()


def protocol_of(url: PathLike) -> str:
    """``"file"`` for a local path or ``file://`` URL, else the URL's scheme (``"s3"``)."""
    if isinstance(url, os.PathLike):
        return "file"
    proto, _ = fsspec.core.split_protocol(str(url))
    return "file" if proto in (None, "file", "local") else proto


def is_local(url: PathLike) -> bool:
    """A local path (``str`` or ``Path``) or a ``file://`` URL."""
    return protocol_of(url) == "file"


def local_path(url: PathLike) -> str:
    """The absolute path on disk of a local path or ``file://`` URL."""
    if not is_local(url):
        raise ValueError(f"{url!r} is not on the local disk")
    return _local_fs._strip_protocol(os.fspath(url))


def join(url: PathLike, *names: str) -> Union[str, Path]:
    """``url`` with ``names`` appended: a ``Path`` for a ``Path``, else a string in the same
    form as ``url`` (``join("s3://b/ck", "step-00000001")`` is ``"s3://b/ck/step-00000001"``)."""
    if isinstance(url, os.PathLike):
        return Path(url).joinpath(*names)
    url = str(url)
    if "://" not in url:
        return os.path.join(url, *names)
    base = url.rstrip("/")
    if base.endswith(":/"):  # "s3://": nothing after the scheme
        base += "/"
        return base + "/".join(names)
    return "/".join([base, *names])


def basename(url: PathLike) -> str:
    """The last name of a path or URL (``"step-00000001"``)."""
    return Path(url).name if isinstance(url, os.PathLike) else posixpath.basename(str(url).rstrip("/"))


def _env_key() -> tuple:
    return tuple(os.environ.get(k) for k in _ENV)


def _options(protocol: str, url: str) -> dict:
    options = dict(fsspec.get_filesystem_class(protocol)._get_kwargs_from_urls(url))
    if protocol in ("s3", "s3a"):
        # the endpoint and credentials: botocore reads AWS_* from the environment itself
        options["use_listings_cache"] = False
    return options


def _make(protocol: str, url: str, **extra):
    return fsspec.get_filesystem_class(protocol)(skip_instance_cache=True, **{**_options(protocol, url), **extra})


def fs_and_path(url: PathLike):
    """``(filesystem, path)`` of ``url`` for fsspec: the local filesystem and an absolute path
    for a local path or ``file://`` URL; for ``s3://bucket/prefix`` (or any protocol fsspec knows
    and has installed) that protocol's filesystem and ``bucket/prefix``. Raises ValueError
    for an unknown scheme and ImportError for one whose package is not installed."""
    if is_local(url):
        return _local_fs, local_path(url)
    url = str(url)
    protocol = protocol_of(url)
    key = (os.getpid(), protocol, repr(sorted(_options(protocol, url).items())), _env_key())
    with _lock:
        fs = _cache.get(key)
        if fs is None:
            fs = _cache[key] = _make(protocol, url)
    path = fs._strip_protocol(url)
    return fs, path.rstrip("/") or path


_OBJECT_STORES = ("s3", "s3a", "gs", "gcs", "abfs", "az")


def makedirs(url: PathLike) -> None:
    """Make the folder ``url`` (and its parents) where folders exist; nothing on object storage,
    which has none (and where s3fs would create a missing bucket instead)."""
    if protocol_of(url) in _OBJECT_STORES:
        return
    fs, path = fs_and_path(url)
    fs.makedirs(path, exist_ok=True)


# ---------------------------------------------------------------- checking a URL before a job starts


def usable() -> list[str]:
    """What a checkpoint path can be here: a local folder, file://, and the remote
    storages whose fsspec package is installed."""
    out = ["a local folder", "file:///path"]
    for proto, (example, cls) in _REMOTE.items():
        if importlib.util.find_spec(cls.split(".", 1)[0]) is not None:
            out.append(example)
    return out


def _usable_text() -> str:
    return "use " + ", ".join(usable())


def _check_local(url: PathLike, what: str) -> None:
    path = local_path(url)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{what} {str(url)!r}: {path} is a file, not a folder")
    existing = path
    while not os.path.exists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            break
        existing = parent
    if not os.path.isdir(existing):
        raise ValueError(f"{what} {str(url)!r}: {existing} is a file, so the folder {path} cannot be made")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {str(url)!r}: {existing} is not writable by this process "
                         f"(user id {os.getuid()}), so checkpoints cannot be written there")


_CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
                     "TokenRefreshRequired", "InvalidClientTokenId", "UnrecognizedClientException",
                     "AuthorizationHeaderMalformed", "403"}
_DENIED_CODES = {"AccessDenied", "AllAccessDisabled", "AccountProblem"}
_WHERE_CREDENTIALS = ("credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) "
                      "and the endpoint from AWS_ENDPOINT_URL, in the environment of the server and its "
                      "workers, never from the spec")


def _cause(e: BaseException, types: tuple):
    """``e`` or the first exception it was raised from that is one of ``types``."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, types):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _check_s3(url: str, what: str) -> None:
    from botocore.exceptions import (BotoCoreError, ClientError, ConnectionError as BotoConnectionError,
                                     HTTPClientError, NoCredentialsError, NoRegionError,
                                     PartialCredentialsError)

    proto = protocol_of(url)
    # a filesystem of its own, that gives up fast: one try, short timeouts
    fs = _make(proto, url, config_kwargs={"connect_timeout": CHECK_TIMEOUT, "read_timeout": CHECK_TIMEOUT,
                                          "retries": {"total_max_attempts": 1}})
    fs.retries = 1
    bucket, key, _ = fs.split_path(fs._strip_protocol(url))
    if not bucket:
        raise ValueError(f"{what} {url!r}: no bucket; write s3://bucket/prefix")
    endpoint = "the S3 endpoint"
    try:
        client = fs.connect()
        endpoint = client.meta.endpoint_url
        prefix = key.rstrip("/") + "/" if key else ""
        fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=1)
    except Exception as e:  # noqa: BLE001  every failure becomes a message a person can act on
        client_error = _cause(e, (ClientError,))
        if client_error is not None:
            err = client_error.response.get("Error", {})
            code, message = str(err.get("Code", "")), err.get("Message", "") or str(client_error)
            if code in ("NoSuchBucket", "404"):
                raise ValueError(f"{what} {url!r}: bucket {bucket!r} does not exist at {endpoint}; create it "
                                 f"first (e.g. `aws s3 mb s3://{bucket}`), checkpoints do not create buckets") from None
            if code in _CREDENTIAL_CODES:
                raise ValueError(f"{what} {url!r}: {endpoint} refused the credentials for bucket {bucket!r} "
                                 f"({code}: {message}); the {_WHERE_CREDENTIALS}") from None
            if code in _DENIED_CODES:
                raise ValueError(f"{what} {url!r}: {endpoint} denied these credentials access to bucket "
                                 f"{bucket!r} ({code}: {message}); they need s3:ListBucket on it and s3:GetObject, "
                                 f"s3:PutObject, s3:DeleteObject under {url}, or use others: the "
                                 f"{_WHERE_CREDENTIALS}") from None
            raise ValueError(f"{what} {url!r}: {endpoint} answered {code}: {message}") from None
        if _cause(e, (NoCredentialsError, PartialCredentialsError)) is not None:
            raise ValueError(f"{what} {url!r}: no credentials for S3 were found; the {_WHERE_CREDENTIALS}") from None
        if _cause(e, (NoRegionError,)) is not None:
            raise ValueError(f"{what} {url!r}: no region for S3; set AWS_DEFAULT_REGION in the environment") from None
        if _cause(e, (BotoConnectionError, HTTPClientError, OSError, TimeoutError)) is not None:
            raise ValueError(f"{what} {url!r}: cannot reach the storage endpoint {endpoint} ({e}); check "
                             "AWS_ENDPOINT_URL in the environment of the server and its workers, and that the "
                             "storage is running and reachable from here") from None
        if _cause(e, (BotoCoreError,)) is not None:
            raise ValueError(f"{what} {url!r}: {e}") from None
        raise


def check_url(url: PathLike, what: str = "checkpoint.path") -> None:
    """Raise ValueError, saying what to do, unless checkpoints can be written at ``url``: an
    unknown scheme or one whose package is missing, an S3 bucket that does not exist, refused
    credentials, an unreachable endpoint, a local folder that cannot be made. Reaches the
    storage once and answers within a few seconds. ``what`` names the setting in messages."""
    if is_local(url):
        return _check_local(url, what)
    url = str(url)
    proto = protocol_of(url)
    try:
        fsspec.get_filesystem_class(proto)
    except ValueError:
        raise ValueError(f"{what} {url!r}: unknown storage scheme {proto!r}; {_usable_text()}") from None
    except ImportError as e:
        raise ValueError(f"{what} {url!r}: storage scheme {proto!r} needs a package that is not installed "
                         f"({e}); {_usable_text()}") from None
    if proto in ("s3", "s3a"):
        return _check_s3(url, what)
    fs, path = fs_and_path(url)
    try:
        fs.exists(path)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{what} {url!r}: cannot reach the storage: {type(e).__name__}: {e}") from None
