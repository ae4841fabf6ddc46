"""The ``deltasync`` vLLM endpoint plugin: the engine guard, and the agent's routes without dev mode.

Enabled with ``VLLM_PLUGINS=deltasync`` (vLLM loads endpoint plugins only when ``VLLM_PLUGINS`` names them;
the same name also loads deltasync's general plugin, the weight-transfer backend). On the server it:

* installs :class:`~deltasync.vllm.guard.EngineGuard` as the outermost middleware: inference routes pass as
  vLLM configures them, every other request needs the engine credential;
* attaches, behind that guard, the vLLM routes the agent drives (the RL routes: pause, resume, the
  weight-transfer lifecycle, the weight label; ``/collective_rpc``; ``/reset_prefix_cache``) when
  ``VLLM_SERVER_DEV_MODE`` did not, so no dev mode is needed on a port that rollout workers reach. vLLM's other
  dev routes (sleep, server info) stay absent.

Both always come together: the plugin never adds an administrative route without its guard.

It also makes the guard's log name each caller by its socket's address. vLLM serves with uvicorn's
``proxy_headers`` on and its default ``forwarded_allow_ips``, which believes ``X-Forwarded-For`` from 127.0.0.1:
any process on the engine's host (environment code, a rollout worker) could have its refused requests logged
under an address of its choosing. uvicorn reads that default from ``FORWARDED_ALLOW_IPS`` when vLLM builds its
``Config``, after ``build_app`` has run this plugin, so the plugin sets it to ``""`` (trust no proxy) unless the
operator set it.
"""

from __future__ import annotations

import os
from argparse import Namespace
from typing import Any

__all__ = ["FORWARDED_ALLOW_IPS_ENV", "DeltaSyncEndpoints"]

FORWARDED_ALLOW_IPS_ENV = "FORWARDED_ALLOW_IPS"
"""Where uvicorn reads the addresses whose ``X-Forwarded-For`` it believes when vLLM passes none."""


class DeltaSyncEndpoints:
    """``vllm.endpoint_plugins`` entry point ``deltasync``."""

    name = "deltasync"
    required_tasks: tuple[str, ...] | None = None

    def attach_router(self, app: Any) -> None:
        from ..engine_credential import GUARD_ROUTE, load_engine_token
        from .guard import EngineGuard

        token = load_engine_token()  # a bad credential file stops the server here, with the reason
        # before vLLM builds uvicorn's Config: the guard logs the socket's peer (an operator's proxy list stays)
        os.environ.setdefault(FORWARDED_ALLOW_IPS_ENV, "")
        app.add_middleware(EngineGuard)  # it reads the credential itself: never a constructor argument vLLM logs
        present = {(m, getattr(r, "path", "")) for r in app.routes for m in (getattr(r, "methods", None) or ())}
        if ("POST", "/update_weights") not in present:
            from vllm.entrypoints.rl.online.api_router import router as rl_router

            app.include_router(rl_router)
        if ("POST", "/collective_rpc") not in present:
            from vllm.entrypoints.serve.dev.rpc.api_router import attach_router as attach_rpc

            attach_rpc(app)
        if ("POST", "/reset_prefix_cache") not in present:
            from vllm.entrypoints.serve.dev.cache.api_router import attach_router as attach_cache

            attach_cache(app)
        configured = token is not None

        async def guard_info() -> dict[str, Any]:  # a plain dict: vLLM's OpenAPI schema must still build
            return {"guard": "deltasync", "credential_configured": configured}

        app.add_api_route(GUARD_ROUTE, guard_info, methods=["GET"])

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        """Nothing: the attached routes use vLLM's own state."""
