"""Object stores (``s3://``, ``gs://``, ... through fsspec) as the persistent root: the start-up
check of the bucket, and the words a failed write gets.

tierckpt never creates a bucket: a bucket is an account's resource with its own region, policy,
lifecycle and bill, and a typo in the URL must not make a new one (s3fs's ``makedirs`` would).
At start-up, global rank 0 asks for the bucket's metadata once (:func:`check_root`); a missing
bucket or a refused request is a :class:`~tierckpt.errors.ConfigError` naming the URL. A write
refused later (a bucket policy denying ``PutObject``, expired credentials) fails that save like
any persistent-tier failure, and :func:`explain` names the URL and what to check.
"""

from __future__ import annotations

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
    """A suffix for a failed save's message on a remote root: ``""``, or, when ``e`` (or the
    per-rank failures of DCP's ``CheckpointException`` in it) is a ``PermissionError``, the
    URL and what to check."""
    if store.local or not _denied(e):
        return ""
    return f" [{store.url}: access denied: {CREDENTIALS_HINT}]"


def _denied(e: BaseException | None, depth: int = 0) -> bool:
    if e is None or depth > 4:
        return False
    if isinstance(e, PermissionError):
        return True
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        for x in failures.values():
            x = x[0] if isinstance(x, tuple) and x else x
            if isinstance(x, BaseException) and _denied(x, depth + 1):
                return True
    return _denied(e.__cause__ or e.__context__, depth + 1)
