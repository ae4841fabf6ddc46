"""Object-store benchmark against a real S3 API (moto's server on 127.0.0.1; run by hand; asserts nothing).

Part 1 chose the S3 library: fetch throughput of a 100 MB anchor object and a 12 MB delta object with obstore
(one GET; ranged GETs in parallel) against s3fs and boto3 (one GET; boto3's threaded transfer manager), and
upload with obstore (a create-only PUT; a parallel multipart upload). Part 2 publishes and fetches the same
objects through ``s3://`` (:class:`deltasync.store.s3.S3Store`) and through a local directory store.

moto keeps objects in its own process and serves them over loopback HTTP, so the absolute figures are those
of this machine's CPUs (2 shared cores here), not of a network; the ratios are what the choice rests on.

    python benchmarks/bench_store.py [--repeat 3] [--only libraries|stores]    # part 1 also needs s3fs
    python benchmarks/bench_store.py --repeat 1 --only stores     # the smallest real run (seconds)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from deltasync.testing.s3 import CREDENTIALS_ENV, MotoServer

SIZES = {"anchor_100MB": 100 * 10**6, "delta_12MB": 12 * 10**6}
BUCKET = "bench"
_RANGE_BYTES = 8 << 20


def _timed(fn: Callable[[], object], repeat: int, nbytes: int) -> dict[str, float]:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    best, median = min(times), statistics.median(times)
    return {"median_s": median, "best_s": best, "MB_per_s": nbytes / median / 1e6}


def _check(expect: bytes) -> Callable[[object], None]:
    def check(got: object) -> None:
        assert bytes(got) == expect, "fetched bytes differ"  # type: ignore[call-overload]

    return check


def libraries(server: MotoServer, repeat: int) -> dict[str, dict[str, dict[str, float]]]:
    import boto3.s3.transfer
    import obstore
    import s3fs
    from obstore.store import S3Store

    raw = S3Store(
        BUCKET,
        endpoint=server.url,
        allow_http=True,
        access_key_id=CREDENTIALS_ENV["AWS_ACCESS_KEY_ID"],
        secret_access_key=CREDENTIALS_ENV["AWS_SECRET_ACCESS_KEY"],
        region=CREDENTIALS_ENV["AWS_REGION"],
    )
    boto = server.boto3()
    fs = s3fs.S3FileSystem(
        key=CREDENTIALS_ENV["AWS_ACCESS_KEY_ID"],
        secret=CREDENTIALS_ENV["AWS_SECRET_ACCESS_KEY"],
        client_kwargs={"endpoint_url": server.url, "region_name": CREDENTIALS_ENV["AWS_REGION"]},
        skip_instance_cache=True,
    )
    pool = concurrent.futures.ThreadPoolExecutor(8)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, size in SIZES.items():
        data = os.urandom(size)
        key = f"lib/{name}"
        boto.put_object(Bucket=BUCKET, Key=key, Body=data)

        def obstore_ranged(key: str = key, size: int = size) -> bytes:
            etag = obstore.head(raw, key)["e_tag"]
            starts = range(0, size, _RANGE_BYTES)
            parts = pool.map(
                lambda s: obstore.get(
                    raw, key, options={"range": (s, min(s + _RANGE_BYTES, size)), "if_match": etag}
                ).bytes(),
                starts,
            )
            buf = bytearray(size)
            for s, part in zip(starts, parts, strict=True):
                buf[s : s + len(part)] = part
            return bytes(buf)

        def boto3_transfer(key: str = key) -> bytes:
            f = io.BytesIO()
            config = boto3.s3.transfer.TransferConfig(multipart_chunksize=_RANGE_BYTES, max_concurrency=8)
            boto.download_fileobj(BUCKET, key, f, Config=config)
            return f.getvalue()

        fetchers: dict[str, Callable[[], object]] = {
            "obstore get": lambda key=key: obstore.get(raw, key).bytes(),
            "obstore get_ranges (8 MiB, library's concurrency)": lambda key=key, size=size: b"".join(
                obstore.get_ranges(
                    raw,
                    key,
                    starts=list(range(0, size, _RANGE_BYTES)),
                    ends=[min(s + _RANGE_BYTES, size) for s in range(0, size, _RANGE_BYTES)],
                )
            ),
            "obstore ranged GETs, 8 threads, If-Match": obstore_ranged,
            "s3fs cat_file": lambda key=key: fs.cat_file(f"{BUCKET}/{key}"),
            "boto3 get_object": lambda key=key: boto.get_object(Bucket=BUCKET, Key=key)["Body"].read(),
            "boto3 download_fileobj (8 MiB parts, 8 threads)": boto3_transfer,
        }
        rows: dict[str, dict[str, float]] = {}
        for label, fetch in fetchers.items():
            check = _check(data)
            check(fetch())  # warm the connection pool, and prove the bytes
            rows[label] = _timed(fetch, repeat, size)
            print(f"{name:13s} fetch  {label:52s} {rows[label]['MB_per_s']:8.0f} MB/s", flush=True)
        counter = iter(range(10**6))
        uploads: dict[str, Callable[[], object]] = {
            "obstore put, create-only (If-None-Match)": lambda data=data, name=name, counter=counter: raw.put(
                f"up/{name}/{next(counter)}", data, mode="create"
            ),
            "obstore multipart (8 MiB parts, 12 parallel)": lambda data=data, name=name, counter=counter: raw.put(
                f"up/{name}/{next(counter)}", io.BytesIO(data), use_multipart=True, chunk_size=_RANGE_BYTES
            ),
            "s3fs pipe_file": lambda data=data, name=name, counter=counter: fs.pipe_file(
                f"{BUCKET}/up/{name}/{next(counter)}", data
            ),
            "boto3 put_object": lambda data=data, name=name, counter=counter: boto.put_object(
                Bucket=BUCKET, Key=f"up/{name}/{next(counter)}", Body=data
            ),
        }
        for label, up in uploads.items():
            rows["upload " + label] = _timed(up, repeat, size)
            print(f"{name:13s} upload {label:52s} {rows['upload ' + label]['MB_per_s']:8.0f} MB/s", flush=True)
        out[name] = rows
    pool.shutdown()
    return out


def stores(server: MotoServer, repeat: int) -> dict[str, dict[str, dict[str, float]]]:
    from deltasync.store import LocalStore, open_store
    from deltasync.store.s3 import S3Store, S3Transfer

    out: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        one_get = S3Store(BUCKET, "stores-one-get", endpoint=server.url, transfer=S3Transfer(parallel_bytes=1 << 40))
        candidates = {
            "s3:// (defaults: ranged GETs from 64 MiB)": open_store(f"s3://{BUCKET}/stores", s3_endpoint=server.url),
            "s3:// (one GET)": one_get,
            "local": LocalStore(Path(tmp) / "store"),
        }
        for name, size in SIZES.items():
            data = os.urandom(size)
            rows: dict[str, dict[str, float]] = {}
            for label, store in candidates.items():
                counter = iter(range(10**6))
                rows[f"{label} put"] = _timed(
                    lambda store=store, counter=counter, data=data, name=name: store.put_many(
                        [(f"{name}/v{next(counter):08d}/shard-00000.safetensors", data)]
                    ),
                    repeat,
                    size,
                )
                key = f"{name}/v00000000/shard-00000.safetensors"
                _check(data)(store.get(key))
                rows[f"{label} get"] = _timed(lambda store=store, key=key: store.get(key), repeat, size)
                for op in ("put", "get"):
                    print(f"{name:13s} {label:42s} {op}  {rows[f'{label} {op}']['MB_per_s']:8.0f} MB/s", flush=True)
            out[name] = rows
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", choices=["libraries", "stores"])
    args = parser.parse_args()
    os.environ.update(CREDENTIALS_ENV)
    result: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp, MotoServer(log=Path(tmp) / "moto.log") as server:
        server.create_bucket(BUCKET)
        if args.only in (None, "libraries"):
            result["libraries"] = libraries(server, args.repeat)
        if args.only in (None, "stores"):
            result["stores"] = stores(server, args.repeat)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
