"""The one path a public request takes through the gateway, whichever front door it came by.

``FrontDoor.admit`` validates a ``GenerateRequest`` (``validation.py``) and admits it
(``admission.py``); ``FrontDoor.run`` streams the answer through the orchestrator under the
request's deadline and frees the admission slot however it ends. Both raise ``GatewayError``
with the terminal status. The gRPC servicer and the HTTP app are thin translations around these
two calls, so routing, admission, deadlines, cancellation and metrics are the same for both.

Invariants:
* every request that reaches ``admit`` is counted exactly once in
  ``epd_gateway_requests_total{outcome, api}`` (``GatewayMetrics.finished``): a refusal when
  it is refused, an admitted request when ``run`` ends;
* an admitted request is finished in admission exactly once, when ``run`` ends (``run`` must be
  iterated or closed by its caller; both front doors do);
* the caller hooks ``Admitted.cancel`` to its transport (a gRPC callback, an HTTP disconnect);
  closing the ``run`` iterator before the final chunk cancels the request as well, so both
  workers drop it. Such a request counts as ``CANCELLED``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from enum import Enum

import grpc

from protos.epd.v1 import gateway_pb2
from services.gateway.admission import Admission, Admitted, DuplicateRequest, QueueFull
from services.gateway.config import GatewayConfig
from services.gateway.errors import GatewayError
from services.gateway.metrics import GatewayMetrics
from services.gateway.orchestrator import Orchestrator
from services.gateway.validation import RequestLimits, validate_request


class Api(str, Enum):
    """The front door a request came through (the ``api`` label of the gateway's series)."""

    GRPC = "grpc"
    HTTP = "http"


class FrontDoor:
    def __init__(
        self,
        config: GatewayConfig,
        admission: Admission,
        orchestrator: Orchestrator,
        metrics: GatewayMetrics,
    ) -> None:
        self.config = config
        self.admission = admission
        self.orchestrator = orchestrator
        self.metrics = metrics
        self.limits = RequestLimits.from_config(config)

    def admit(self, request: gateway_pb2.GenerateRequest, caller: str, api: Api) -> Admitted:
        """Validate and admit ``request`` for ``caller`` (``servicer.caller_identity``); a
        refusal is counted and raised as ``GatewayError``."""
        try:
            validate_request(request, self.limits)
            return self.admission.admit(request.request_id, caller)
        except GatewayError as exc:
            self.metrics.finished(exc.code.name, api.value)
            raise
        except QueueFull as exc:
            self.metrics.finished(grpc.StatusCode.RESOURCE_EXHAUSTED.name, api.value)
            raise GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        except DuplicateRequest as exc:
            self.metrics.finished(grpc.StatusCode.ALREADY_EXISTS.name, api.value)
            raise GatewayError(grpc.StatusCode.ALREADY_EXISTS, str(exc)) from None

    def deadline(self, admitted: Admitted, timeout_s: float | None) -> float:
        """When the request must be done (``time.monotonic`` clock): the caller's own timeout,
        at most the gateway's ``default_timeout_s``, counted from admission."""
        budget = self.config.default_timeout_s
        if timeout_s:
            budget = min(timeout_s, budget)
        return admitted.admitted_at + budget

    def run(
        self,
        request: gateway_pb2.GenerateRequest,
        admitted: Admitted,
        timeout_s: float | None,
        api: Api,
    ) -> Iterator[gateway_pb2.GenerateChunk]:
        """Stream the answer to an admitted ``request``; raises ``GatewayError`` with the
        terminal status. ``timeout_s``: the seconds the caller gives it (None: the default)."""
        outcome: str | None = None
        ttft_s: float | None = None
        finished = False  # every choice's final chunk was handed to the caller
        num_left = max(1, request.sampling.n)  # choices not finished yet
        stream = self.orchestrator.run(request, admitted, self.deadline(admitted, timeout_s))
        try:
            for chunk in stream:
                if ttft_s is None and chunk.token_ids:
                    ttft_s = time.monotonic() - admitted.admitted_at
                if chunk.finish_reason:
                    num_left -= 1
                if chunk.finish_reason and not num_left:
                    finished = True
                    admitted.close()  # an Abort from now on finds nothing to abort
                    self.admission.finish(admitted)
                yield chunk
            outcome = grpc.StatusCode.OK.name
        except GatewayError as exc:
            outcome = exc.code.name
            raise
        except Exception:
            outcome = grpc.StatusCode.UNKNOWN.name
            raise
        finally:
            if outcome is None:  # the caller stopped iterating: the client is gone
                outcome = grpc.StatusCode.OK.name if finished else grpc.StatusCode.CANCELLED.name
                if not finished:
                    admitted.cancel()
            stream.close()  # frees the workers now, not when the generator is collected
            self.metrics.finished(outcome, api.value, ttft_s if finished else None)
            self.admission.finish(admitted)
