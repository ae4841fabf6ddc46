"""Test and demo harness pieces a user can import: tiny models, a realistic update stream, process launchers.

What the test suite, the benchmarks and the examples share, installed with the package so that a script outside
the repository's ``tests/`` can use it:

* :mod:`deltasync.testing.models`: random tiny models (Qwen3, Llama, Qwen2, Qwen3-MoE) with a locally trained
  tokenizer, Qwen3-0.6B's shapes, a ``config.json``-only model for vLLM's dummy load, a PEFT LoRA model;
* :mod:`deltasync.testing.stream`: :class:`~deltasync.testing.stream.UpdateStream`, fp32 master weights trained
  by AdamW on noise and cast to bf16 (about 1-3% of the elements change per step);
* :mod:`deltasync.testing.launchers`: a coordinator and a vLLM server as real processes on 127.0.0.1, an offline
  ``vllm.LLM``, free ports, health polls and process-group stops;
* :mod:`deltasync.testing.credentials`: the fixed tokens test and benchmark coordinators run with;
* :mod:`deltasync.testing.tls`: a throwaway CA and server certificates;
* :mod:`deltasync.testing.postgres`: a throwaway PostgreSQL server (``initdb`` + ``pg_ctl``);
* :mod:`deltasync.testing.s3` and :mod:`deltasync.testing.s3_iam`: moto's S3 server, plain or with IAM enforced;
* :mod:`deltasync.testing.output_dir`: a demo's ``--out``, replaced only when an earlier run made it.

Nothing here is for production: the credentials are public and the servers are throwaway. This package imports
nothing heavy itself; each module imports ``transformers``, ``tokenizers``, ``peft``, ``vllm``, ``moto``,
``cryptography`` or ``psycopg`` inside the function that needs it (most come with the ``test`` extra). The rest
of deltasync never imports it.
"""

from __future__ import annotations

__all__: list[str] = []
