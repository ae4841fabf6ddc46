"""The create-only probes: does the service refuse a second create-only write of one key? One shape, two writes:
a ``PUT`` with ``If-None-Match: *`` (small objects) and a copy completed with ``If-None-Match`` (large ones)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

from ...errors import StoreError
from ._requests import S3Requests, first_line, is_conflict, status

__all__ = ["PROBE", "probe_copy", "probe_put"]

logger = logging.getLogger(__name__)

PROBE = ".deltasync-probe"
"""Where probe objects go: hidden (never listed, never a valid store key), deleted after each probe."""


def probe_put(requests: S3Requests) -> bool:
    """Whether the service honours ``If-None-Match: *`` on a ``PUT``: one hidden object put twice, create-only.

    A service that rejects the header (HTTP 400 or 501), or a backend that cannot send it, does not honour it.
    Raises StoreError when the probe itself fails otherwise (credentials, an outage): not cached, since the
    write that asked would fail too."""
    return _probe(
        requests,
        lambda key: requests._store.put(key, b"", mode="create", use_multipart=False),
        source=None,
        label="put",
        where="",
        fallback="writes fall back to HEAD-then-PUT",
    )


def probe_copy(requests: S3Requests, multipart_bytes: int) -> bool:
    """Whether the service honours ``If-None-Match`` on ``CompleteMultipartUpload`` (the create-only copy that
    commits an object of ``multipart_bytes`` or more): one hidden object copied twice to one key, create-only.
    Fails and raises as :func:`probe_put` does."""
    import obstore

    source = f"{PROBE}/{uuid.uuid4().hex}"
    return _probe(
        requests,
        lambda key: obstore.copy(requests._store, source, key, overwrite=False),
        source=source,
        label="copy",
        where=" on CompleteMultipartUpload",
        fallback=f"objects of {multipart_bytes} bytes or more fall back to HEAD-then-upload",
    )


def _probe(
    requests: S3Requests,
    write: Callable[[str], object],
    *,
    source: str | None,
    label: str,
    where: str,
    fallback: str,
) -> bool:
    """Write a fresh hidden key with ``write``, then the same key again: honoured if the second is refused
    (a 412). ``source``: an empty object ``write`` reads (put first, deleted after). Every request goes through
    ``_call`` (retried on 409, 429, 5xx and transport errors); every probe object is deleted."""
    from obstore.exceptions import AlreadyExistsError, NotSupportedError

    base = source or f"{PROBE}/{uuid.uuid4().hex}"
    keys = [] if source is None else [source]

    def first() -> None:
        # Each attempt writes a fresh key: a retry after a lost answer must not meet its own first attempt
        # (a 412 there would say nothing about the service, and name a hidden key).
        keys.append(f"{base}.{label}-{uuid.uuid4().hex[:8]}")
        write(keys[-1])

    def second() -> bool:
        try:
            write(keys[-1])
            return False
        except AlreadyExistsError as exc:
            if is_conflict(exc):
                raise  # a 409: retried by _call
            return True

    try:
        if source is not None:
            requests._call("probe", source, lambda: requests._store.put(source, b"", use_multipart=False))
        try:
            requests._call("probe", base, first)
        except StoreError as exc:
            if status(exc.__cause__ or exc) not in (400, 501):
                raise  # a failure here (credentials, an outage) is raised, not cached: the write would fail anyway
            honoured = False  # the service rejects the header (NotImplemented)
        else:
            honoured = requests._call("probe", keys[-1], second)
    except NotSupportedError:
        honoured = False
    finally:
        _delete_probes(requests, keys)
    if not honoured:
        logger.warning(
            "%s: the service ignores If-None-Match%s: %s, and two writers racing on one key can overwrite each "
            "other (the coordinator's publisher lease keeps them apart)",
            requests.uri,
            where,
            fallback,
        )
    return honoured


def _delete_probes(requests: S3Requests, keys: list[str]) -> None:
    import obstore

    if not keys:
        return
    try:
        obstore.delete(requests._store, keys)  # S3 deletes of absent keys succeed
    except Exception as exc:  # a probe left behind is harmless (hidden, never listed): say so, go on
        logger.warning("%s: could not delete the probe objects %s (%s)", requests.uri, keys, first_line(exc))
