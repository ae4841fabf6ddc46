"""Object-store URIs: ``s3://bucket/prefix[?endpoint=URL]``, ``gs://bucket/prefix``, ``az://container/prefix``."""

from __future__ import annotations

import re
from urllib.parse import parse_qs, quote, urlsplit

from .base import check_key

__all__ = ["BUCKET_NAME", "SCHEMES", "check_endpoint", "format_uri", "parse_bucket_uri", "with_s3_endpoint"]

SCHEMES = ("s3", "gs", "az")
BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")


def parse_bucket_uri(uri: str) -> tuple[str, str, str, str | None]:
    """``s3://bucket/a/b?endpoint=http://host:9000`` -> (``"s3"``, ``"bucket"``, ``"a/b"``, endpoint).

    Raises:
        ValueError: not ``s3://``, ``gs://`` or ``az://``, no bucket, a prefix that fails :func:`check_key`,
            an unknown or repeated query parameter, or an endpoint with a path, query or fragment.
    """
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES or not parts.netloc:
        raise ValueError(f"store URI {uri!r}: expected s3://<bucket>[/<prefix>] (or gs://, az://)")
    if not BUCKET_NAME.fullmatch(parts.netloc):
        raise ValueError(
            f"store URI {uri!r}: bucket {parts.netloc!r} must be 3+ lowercase letters, digits, '.', '_' or '-' "
            "(credentials never go in the URI: use AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
        )
    prefix = parts.path.strip("/")
    if prefix:
        check_key(prefix)
    query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=False)
    unknown = sorted(set(query) - {"endpoint"})
    if unknown:
        raise ValueError(f"store URI {uri!r}: unknown query parameters {unknown}; only endpoint= is known")
    if len(query.get("endpoint", [])) > 1:
        raise ValueError(f"store URI {uri!r}: endpoint= is given {len(query['endpoint'])} times; give it once")
    endpoint = query.get("endpoint", [None])[-1]
    if endpoint is not None and scheme != "s3":
        raise ValueError(f"store URI {uri!r}: endpoint= applies to s3:// URIs only")
    if endpoint:
        check_endpoint(endpoint)
    return scheme, parts.netloc, prefix, endpoint or None


def check_endpoint(endpoint: str) -> str:
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.password:
        raise ValueError(
            f"S3 endpoint {endpoint!r} must be an http:// or https:// URL with a host and no credentials in it"
        )
    if parts.path not in ("", "/") or parts.query or parts.fragment or endpoint.endswith(("?", "#")):
        # obstore would take a path as part of every request's path: http://h/other + bucket b -> bucket other
        raise ValueError(
            f"S3 endpoint {endpoint!r} must be scheme://host[:port] only, with no path, query or fragment; "
            "the bucket goes in the URI (s3://<bucket>/<prefix>)"
        )
    return endpoint


def with_s3_endpoint(uri: str, endpoint: str) -> str:
    """``uri`` (an ``s3://`` URI) with its endpoint set to ``endpoint`` (what ``--s3-endpoint`` does).

    Raises:
        ValueError: ``uri`` is not an ``s3://`` URI, or already names another endpoint.
    """
    if not uri.lower().startswith("s3://"):
        raise ValueError(f"store URI {uri!r}: --s3-endpoint applies to s3:// URIs only")
    scheme, bucket, prefix, current = parse_bucket_uri(uri)
    check_endpoint(endpoint)
    if current is not None and current != endpoint:
        raise ValueError(f"store URI {uri!r} names endpoint {current!r}, but --s3-endpoint is {endpoint!r}")
    return format_uri(scheme, bucket, prefix, endpoint)


def format_uri(scheme: str, bucket: str, prefix: str, endpoint: str | None) -> str:
    uri = f"{scheme}://{bucket}" + (f"/{prefix}" if prefix else "")
    return uri + (f"?endpoint={quote(endpoint, safe=':/')}" if endpoint else "")
