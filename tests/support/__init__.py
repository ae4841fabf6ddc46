"""What the tests alone use: an in-process coordinator, fault-injecting S3 and replica stubs, published-layout
staging, an agent's world.

The harness pieces demos and benchmarks share with the tests (tiny models, the update stream, process launchers,
credentials, TLS, PostgreSQL and S3 servers) are installed with the package: :mod:`deltasync.testing`.
"""
