"""A real S3 API that checks who asks: moto's server with its IAM enforcement on, for a store that several hosts
share and only one may write.

    python -m deltasync.testing.s3_iam --host 10.77.0.10 --port 9000 --bucket wordle-run \\
        --grant trainer=write --grant inference=read --credentials credentials

Before it listens, the server makes the bucket and, for each ``--grant USER=ACCESS``, an IAM user whose inline
policy allows ``ACCESS`` (``read``, ``delete``, ``write``; comma-separated) on that bucket and nothing else, and an
access key, written to ``CREDENTIALS/USER.env`` (mode 0600, ``AWS_ACCESS_KEY_ID=...`` lines): the operator hands each
file to the one host it is for. From the first request on, moto checks every signature and every policy: an
unknown access key is ``InvalidAccessKeyId``, a wrong secret ``SignatureDoesNotMatch``, an action the user's policy
does not allow ``AccessDenied`` (all 403).

moto leaves some requests to no check at all, so a guard in front of it (same process) refuses them first, from
the request head before any byte of the body is read, with 403 ``AccessDenied`` and a message that says why:

* a request with no ``Authorization: AWS4-HMAC-SHA256`` header: anonymous (moto fails on most of them with a 500,
  which clients retry, and judges an object's read by its ACL) or presigned in its query (not used by deltasync);
  or one whose header does not sign ``host`` and ``x-amz-date`` (moto fails on it with a 500 too);
* a request signed for another service than ``s3``, or for a path outside the bucket (moto serves every AWS
  service on one port, and its fake instance metadata under ``/latest/``);
* moto's administrative API, ``/moto-api/...``: one anonymous POST to ``/moto-api/reset-auth`` turns every check
  off, another resets every bucket.

The server listens with the coordinator's bounded protocol (:mod:`deltasync_coordinator.http`, moto's WSGI app
behind uvicorn's WSGI bridge), not werkzeug's threaded development server, which gave each connection a thread
for as long as its client liked: heads and bodies that do not arrive in time get 408 and are closed, answers
left unread are cut, at most 16 requests wait pipelined on a connection, and connections are capped overall and
per client address below the open-files limit (503). A body is refused by its ``Content-Length`` before it is
read when it exceeds ``--max-body-bytes`` (400 ``EntityTooLarge``; 256 MiB by default, above what the S3 store
sends in one request), and a chunked one without it is refused (411 ``MissingContentLength``). A request the
guard lets through (a well-formed signature, right or wrong) has its body read whole before moto checks the
signature, as moto reads every body: at most ``--max-body-bytes`` each, for the request's time. Header names
with an underscore are dropped, as werkzeug drops them (``X_Amz_Date`` could otherwise stand in for
``X-Amz-Date``).

moto 5 names some S3 actions by their operation (``s3:ListObjectsV2``, ``s3:HeadObject``) where AWS checks
``s3:ListBucket`` and ``s3:GetObject``: ``read`` allows ``s3:Get*``, ``s3:List*`` and ``s3:Head*``, which covers both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

__all__ = ["ACCESS", "GUARD_MESSAGES", "MAX_BODY_BYTES", "main", "policy", "read_credentials"]

logger = logging.getLogger("deltasync.testing.s3_iam")
MAX_BODY_BYTES = 256 << 20
"""The S3 store sends objects below 256 MiB (its ``multipart_bytes``) in one ``PUT`` and larger ones in parts."""
MAX_HEADER_BYTES = 64 << 10

ACCESS = {
    "read": ["s3:Get*", "s3:List*", "s3:Head*"],
    "delete": ["s3:DeleteObject", "s3:DeleteObjects"],
    "write": [
        "s3:PutObject",
        "s3:CreateMultipartUpload",
        "s3:UploadPart",
        "s3:UploadPartCopy",
        "s3:CompleteMultipartUpload",
        "s3:AbortMultipartUpload",
        "s3:CopyObject",
        "s3:DeleteObject",
        "s3:DeleteObjects",
    ],
}
"""What each access word allows on the bucket (``write`` and ``delete`` include ``read``). AWS checks
``s3:PutObject`` for every step of a multipart upload or copy, and ``s3:DeleteObject`` for each key of a batch
delete; moto checks each step's own name, and ``s3:DeleteObjects`` on the bucket: both are listed."""

GUARD_MESSAGES = {
    "anonymous": "This store refuses anonymous and presigned requests: sign each request (AWS Signature Version 4, "
    "in the Authorization header) with the access key the store's operator gave your host",
    "service": "This endpoint serves S3 only; the request was signed for {service!r}",
    "malformed": "The Authorization header is not a whole AWS Signature Version 4: it names a Credential, "
    "SignedHeaders (host and x-amz-date among them, with an X-Amz-Date header) and a Signature",
    "bucket": "This endpoint serves the bucket {bucket!r} only (path-style: /{bucket}/KEY), not {path!r}",
    "admin": "moto's administrative API (/moto-api) is not served on this endpoint",
}
"""What the guard in front of moto answers, by reason (the ``Message`` of a 403 ``AccessDenied``)."""


def policy(bucket: str, access: Iterable[str]) -> dict[str, Any]:
    """The IAM policy document of a user with ``access`` (words of :data:`ACCESS`) on ``bucket`` alone."""
    words = list(access)
    unknown = [w for w in words if w not in ACCESS]
    if unknown or not words:
        raise ValueError(f"access {','.join(words)!r}: expected words among {sorted(ACCESS)}, comma-separated")
    actions = list(ACCESS["read"])
    for word in words:
        actions += [a for a in ACCESS[word] if a not in actions]
    resources = [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]
    return {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": resources}]}


def _refusal(path: str, authorization: str, amz_date: str, bucket: str) -> str | None:
    """Why the guard refuses a request for ``path`` with these headers (a :data:`GUARD_MESSAGES` message), or
    None: only signed S3 requests for ``bucket`` reach moto."""
    if path == "/moto-api" or path.startswith("/moto-api/"):
        return GUARD_MESSAGES["admin"]
    if path != f"/{bucket}" and not path.startswith(f"/{bucket}/"):
        return GUARD_MESSAGES["bucket"].format(bucket=bucket, path=path)
    if not authorization.startswith("AWS4-HMAC-SHA256 "):
        return GUARD_MESSAGES["anonymous"]
    # the credential scope as moto reads it to choose the service that answers
    words = authorization.split(",")[0].split()
    scope = words[1].split("/") if len(words) > 1 else []
    service = scope[3].lower() if len(scope) == 5 else ""
    if service != "s3":
        return GUARD_MESSAGES["service"].format(service=service)
    # moto fails (500: clients retry) on a signature without these; refused as S3 would
    fields = dict(f.strip().partition("=")[::2] for f in authorization.split(" ", 1)[1].split(","))
    signed = fields.get("SignedHeaders", "").split(";")
    if not ("host" in signed and "x-amz-date" in signed and amz_date and fields.get("Signature")):
        return GUARD_MESSAGES["malformed"]
    return None


class _Guard:
    """ASGI: the checks moto leaves out (see the module) and the body cap, from the request head, before moto's
    WSGI app sees the request or a byte of its body is read. Refusals close the connection."""

    def __init__(self, wsgi_app: Any, bucket: str, max_body_bytes: int) -> None:
        with warnings.catch_warnings():
            # uvicorn's own bridge (a2wsgi, which it prefers, is no dependency here); bodies reach it capped
            warnings.simplefilter("ignore", DeprecationWarning)
            from uvicorn.middleware.wsgi import WSGIMiddleware  # type: ignore[attr-defined]  # a2wsgi's or its own

            self.app = WSGIMiddleware(wsgi_app)
        self.bucket, self.max_body_bytes = bucket, max_body_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # lifespan: nothing to start
            return
        # header names with an underscore are dropped, as werkzeug drops them: X_Amz_Date would fold into the
        # same WSGI key as X-Amz-Date
        scope["headers"] = headers = [(k, v) for k, v in scope["headers"] if b"_" not in k]
        named = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers}
        path = scope["path"]
        why = _refusal(path, named.get("authorization", ""), named.get("x-amz-date", ""), self.bucket)
        if why is not None:
            await _refuse(send, 403, "AccessDenied", why)
            return
        length = named.get("content-length")
        if length is None and "transfer-encoding" in named:
            await _refuse(send, 411, "MissingContentLength", "You must provide the Content-Length HTTP header.")
            return
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            detail = (
                f"Your proposed upload exceeds the maximum allowed size ({self.max_body_bytes} bytes, --max-body-bytes)"
            )
            await _refuse(send, 400, "EntityTooLarge", detail)
            return
        await self.app(scope, receive, send)


async def _refuse(send: Any, status: int, code: str, message: str) -> None:
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{escape(message)}</Message></Error>"
    ).encode()
    headers = [
        (b"content-type", b"application/xml"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),  # the body of a refused request is never read
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _grants(values: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for value in values:
        user, sep, access = value.partition("=")
        if not sep or not user.isidentifier() or user in out:
            raise SystemExit(f"--grant {value!r}: expected USER=ACCESS, one per user (e.g. trainer=write)")
        out[user] = access.split(",")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--grant", action="append", default=[], help="USER=ACCESS (read, delete, write)")
    parser.add_argument("--credentials", type=Path, required=True, help="where each user's USER.env goes")
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="larger bodies get 400")
    parser.add_argument(
        "--max-connections", type=int, default=1024, help="open connections (lowered below the open-files limit)"
    )
    parser.add_argument("--max-connections-per-peer", type=int, default=256, help="open connections of one address")
    parser.add_argument("--request-head-timeout-s", type=float, default=10.0, help="a head not received in time: 408")
    parser.add_argument(
        "--request-body-timeout-s", type=float, default=60.0, help="a body not received this long after its head: 408"
    )
    parser.add_argument(
        "--response-write-timeout-s",
        type=float,
        default=30.0,
        help="a connection whose unsent answer has not shrunk this long (its client reads none of it): closed",
    )
    args = parser.parse_args(argv)
    grants = _grants(args.grant)
    documents = {user: json.dumps(policy(args.bucket, access)) for user, access in grants.items()}

    os.environ.setdefault("AWS_REGION", "us-east-1")
    from deltasync_coordinator.connections import ConnectionLedger, fit_to_open_files, open_files_limit
    from deltasync_coordinator.http import Bounds, protocol, proxy_options, run
    from moto import settings
    from moto.core.models import DEFAULT_ACCOUNT_ID
    from moto.iam.models import iam_backends
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from moto.s3.models import s3_backends

    region = os.environ["AWS_REGION"]
    iam = iam_backends[DEFAULT_ACCOUNT_ID]["aws"]
    s3_backends[DEFAULT_ACCOUNT_ID]["aws"].create_bucket(args.bucket, region)
    args.credentials.mkdir(mode=0o700, exist_ok=True)
    for user, document in documents.items():
        iam.create_user(region, user)
        iam.put_user_policy(user, "store", document)
        key = iam.create_access_key(user)
        path = args.credentials / f"{user}.env"
        with contextlib.suppress(FileNotFoundError):  # an earlier server's: replaced, never written through
            path.unlink()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"AWS_ACCESS_KEY_ID={key.access_key_id}\nAWS_SECRET_ACCESS_KEY={key.secret_access_key}\n")
    # from the first request on: no request goes unchecked (moto's default lets every request through)
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0

    logging.basicConfig(level=logging.INFO, format="[s3] %(asctime)s %(message)s")
    overall, per_peer = fit_to_open_files(args.max_connections, args.max_connections_per_peer, open_files_limit())
    bounds = Bounds(
        max_head_bytes=MAX_HEADER_BYTES,
        head_timeout_s=args.request_head_timeout_s,
        body_timeout_s=args.request_body_timeout_s,
        write_timeout_s=args.response_write_timeout_s,
    )
    http = protocol(bounds, ledger=ConnectionLedger(overall, per_peer, logger_name=logger.name))
    app = _Guard(DomainDispatcherApplication(create_backend_app), args.bucket, args.max_body_bytes)
    run(app, host=args.host, port=args.port, http=http, lifespan="off", log_level="warning", **proxy_options(()))


def read_credentials(path: Path) -> dict[str, str]:
    """A ``USER.env`` file written by the server, as environment variables."""
    out = {}
    for line in path.read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep:
            out[name] = value
    return out


if __name__ == "__main__":
    main()
