"""The worker actor's side of peer fetch: ``export_pages`` for a peer's ``RayTransport``.

The holder's page group is this method's return value, so Ray puts it in the holder node's
object store and the receiver pulls it from there by reference (decision 0018). The actor is
named after its worker id (``start_worker_actor(name=worker_id)``), which is how a peer finds
it from a fetch plan.
"""

from __future__ import annotations

from typing import Any

from kvtier.domain.errors import FailedPrecondition
from kvtier.runtime.config import WorkerConfig
from kvtier.worker.peer_fetch import PeerOptions, RayTransport
from kvtier.worker.peer_pages import ExportRequest, PageGroup

EXPORT_TIMEOUT_S = 60.0


class PeerExportMixin:
    """Mixed into ``WorkerActor``, whose ``serve`` phase sets ``_runtime`` and ``_server``."""

    _runtime: Any
    _server: Any

    def export_pages(self, request: ExportRequest) -> PageGroup:
        """The longest cached prefix of ``request.keys`` in ``request.digest``, for a worker
        authenticated by ``request.credential`` (``PeerExporter``)."""
        if self._server is None or self._runtime is None or self._server.exporter is None:
            raise FailedPrecondition("the worker is not serving; it exports no pages")
        group: PageGroup = self._runtime.run(self._server.exporter.export(request), timeout_s=EXPORT_TIMEOUT_S)
        return group


def peer_options(config: WorkerConfig, token: str | None) -> PeerOptions:
    """Peers are fetched from through Ray when this process is connected to a Ray cluster; each
    fetch carries the worker's own token (``auth_token_file``)."""
    import ray

    return PeerOptions(transport=RayTransport() if ray.is_initialized() else None, credential=token,
                       link_bytes_per_s=config.emulated_peer_link_bytes_per_s)
