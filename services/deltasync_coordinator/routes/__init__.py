"""One router per resource.

A route's answer model is its return annotation (FastAPI documents and validates it from there);
``response_model`` is named only where a route answers a ready-made ``Response``.
"""

__all__: list[str] = []
