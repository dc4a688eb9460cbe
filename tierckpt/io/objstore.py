"""Object stores (``s3://``, ``gs://``, ... through fsspec) as the persistent root: the start-up
check of the bucket, and the words a failed write gets.

tierckpt never creates a bucket: a bucket is an account's resource with its own region, policy,
lifecycle and bill, and a typo in the URL must not make a new one (s3fs's ``makedirs`` would).
At start-up, global rank 0 asks for the bucket's metadata once (:func:`check_root`); a missing
bucket or a refused request is a :class:`~tierckpt.errors.ConfigError` naming the URL. A write
refused later (a bucket policy denying ``PutObject``, expired credentials) fails that save like
any persistent-tier failure, and so does a write the store refuses for lack of space (MinIO's
full drive, a bucket or user quota); :func:`explain` names the URL and what to check.
"""

from __future__ import annotations

import errno
import re

from tierckpt.errors import ConfigError
from tierckpt.io.storage import Store

CREDENTIALS_HINT = ("check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_PROFILE in the "
                    "environment, or storage_options) and the bucket's policy")


def bucket_of(store: Store) -> str | None:
    """The bucket of a remote root, for filesystems with buckets (those with fsspec's
    ``split_path``: s3fs, gcsfs); None for local paths and bucketless filesystems (``memory://``)."""
    split = getattr(store.fs, "split_path", None)
    if store.local or split is None:
        return None
    return split(store.root)[0] or None


def check_root(store: Store, option: str = "persistent_root") -> None:
    """Make sure ``store``'s root can hold the persistent tier: a local path or a bucketless URL
    is created (parents included); a bucket must exist and answer (one metadata request).

    Raises:
        ConfigError: naming ``option`` and the URL: the bucket does not exist (tierckpt does not
            create it) or the request was refused.
        OSError: a local root that cannot be created, or another error of the store.
    """
    bucket = bucket_of(store)
    if bucket is None:
        store.makedirs("")
        return
    try:
        store.fs.info(bucket)
    except FileNotFoundError:
        raise ConfigError(option, f"{store.url}: bucket {bucket!r} does not exist; tierckpt never creates "
                          "buckets: create it (with its region, policy and lifecycle) or correct the URL") from None
    except PermissionError as e:
        raise ConfigError(option, f"{store.url}: access to bucket {bucket!r} denied ({e}); {CREDENTIALS_HINT}") from None


def explain(e: BaseException, store: Store) -> str:
    """A suffix naming the URL for a failed save's message on a remote root (``""`` on a local
    path), with what to check when ``e`` (its cause chain, or the per-rank failures of DCP's
    ``CheckpointException`` in it) says why: a refused request (``PermissionError``: credentials
    or the bucket's policy), or a store out of space (:func:`out_of_space`)."""
    if store.local:
        return ""
    if _find(e, lambda x: isinstance(x, PermissionError)) is not None:
        return f" [{store.url}: access denied: {CREDENTIALS_HINT}]"
    full = _find(e, out_of_space)
    if full is not None:
        return (f" [{store.url}: the object store is out of space or over its quota ({out_of_space(full)}): "
                f"{FULL_HINT}]")
    return f" [{store.url}]"


FULL_HINT = ("free space or raise the bucket's quota; earlier committed steps are intact, and the failed "
             "step's objects are left without a commit marker (retention removes them)")

# Error codes of object stores for a write that does not fit: MinIO's full drive (HTTP 507) and
# bucket quota, Ceph RGW's user/bucket quota; and HTTP 507 Insufficient Storage (RFC 4918 11.5)
# whatever the code ("507": botocore's code for an answer without a body).
FULL_CODES = frozenset({"XMinioStorageFull", "XMinioAdminBucketQuotaExceeded", "QuotaExceeded",
                        "InsufficientStorage", "507"})
# botocore's ClientError text, which s3fs's OSError keeps: the one trace of the code left when
# the error crossed ranks (DCP gathers pickled exceptions; a pickled OSError loses its cause)
_CLIENT_ERROR = re.compile(r"An error occurred \(([A-Za-z0-9]+)\) when calling")


def out_of_space(x: BaseException) -> str | None:
    """What makes ``x`` an out-of-space error (the errno's or the store's code), or None:
    ``ENOSPC``/``EDQUOT`` (a file system, or a filesystem driver that maps its store's error to
    one), or an object store's answer with a code in :data:`FULL_CODES` or HTTP status 507: a
    botocore ``ClientError`` (s3fs keeps it as the cause of the ``OSError`` it raises) or the
    text s3fs gives that ``OSError``."""
    no = x.errno if isinstance(x, OSError) else None
    if no is not None and no in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return errno.errorcode.get(no, str(no))
    response = getattr(x, "response", None)
    if isinstance(response, dict):
        code = (response.get("Error") or {}).get("Code")
        if code in FULL_CODES or (response.get("ResponseMetadata") or {}).get("HTTPStatusCode") == 507:
            return str(code or 507)
    m = _CLIENT_ERROR.search(str(x))
    return m.group(1) if m and m.group(1) in FULL_CODES else None


def _find(e: BaseException | None, match, depth: int = 0) -> BaseException | None:
    """The first exception ``match`` accepts in ``e``, its per-rank DCP failures and its
    cause/context chain (at most 6 deep)."""
    if e is None or depth > 6:
        return None
    if match(e):
        return e
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        for x in failures.values():
            x = x[0] if isinstance(x, tuple) and x else x
            if isinstance(x, BaseException):
                found = _find(x, match, depth + 1)
                if found is not None:
                    return found
    return _find(e.__cause__ or e.__context__, match, depth + 1)
