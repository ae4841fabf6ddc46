"""Stores: where versions live, and the URI registry that opens them."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import unquote, urlparse

from .base import Store, check_key
from .local import LocalStore

__all__ = ["LocalStore", "Store", "check_key", "open_store", "register_store_scheme"]

StoreFactory = Callable[[str], Store]
_SCHEMES: dict[str, StoreFactory] = {}


def register_store_scheme(scheme: str, factory: StoreFactory) -> None:
    """Make :func:`open_store` map ``scheme://...`` URIs to ``factory(uri)``.

    Registering a scheme again replaces its factory.
    """
    if not scheme.isidentifier() or scheme.lower() != scheme:
        raise ValueError(f"scheme {scheme!r} must be a lowercase identifier")
    _SCHEMES[scheme] = factory


def _open_file_uri(uri: str) -> Store:
    parsed = urlparse(uri)
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"store URI {uri!r}: file:// URIs must name a local path (file:///path)")
    return LocalStore(unquote(parsed.path))


def _open_hub_uri(uri: str) -> Store:
    from .hub import HubBucketStore, parse_hub_uri

    bucket_id, prefix = parse_hub_uri(uri)
    return HubBucketStore(bucket_id, prefix)


def _open_bucket_uri(uri: str) -> Store:
    from ._s3_uri import parse_bucket_uri
    from .s3 import S3Store

    scheme, bucket, prefix, endpoint = parse_bucket_uri(uri)
    return S3Store(bucket, prefix, endpoint=endpoint, scheme=scheme)


register_store_scheme("file", _open_file_uri)
register_store_scheme("hf", _open_hub_uri)
for _scheme in ("s3", "gs", "az"):
    register_store_scheme(_scheme, _open_bucket_uri)


def open_store(uri: str, *, s3_endpoint: str | None = None) -> Store:
    """Open the store a URI names.

    * a plain path or ``file:///path``: :class:`LocalStore`;
    * ``hf://buckets/<namespace>/<name>[/<prefix>]``: a Hugging Face Hub bucket
      (:class:`~deltasync.store.hub.HubBucketStore`);
    * ``s3://<bucket>[/<prefix>][?endpoint=<url>]``, ``gs://<bucket>[/<prefix>]``,
      ``az://<container>[/<prefix>]``: an object store (:class:`~deltasync.store.s3.S3Store`);
    * any scheme added with :func:`register_store_scheme`.

    Args:
        uri: the URI, or a local path.
        s3_endpoint: the endpoint of an S3-compatible service (MinIO, R2, ...) for an ``s3://`` URI; the
            same as ``?endpoint=`` in the URI (default: ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, AWS).

    Raises:
        ValueError: the URI has a scheme no store is registered for, or ``s3_endpoint`` is given for a URI
            that is not ``s3://`` (or that names another endpoint).
    """
    if s3_endpoint:
        from ._s3_uri import with_s3_endpoint

        uri = with_s3_endpoint(uri, s3_endpoint)
    if "://" not in uri:
        return LocalStore(uri)
    scheme = uri.split("://", 1)[0].lower()
    factory = _SCHEMES.get(scheme)
    if factory is None:
        raise ValueError(f"store URI {uri!r}: no store for scheme {scheme!r}; known schemes: {sorted(_SCHEMES)}")
    return factory(uri)
