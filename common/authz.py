"""Who may call which internal method: the role in the caller's certificate, checked before anything runs.

With TLS on, every internal call comes over mutual TLS, and the caller's certificate names its role
(common/pki.py: spiffe://handoff/<namespace>/role/<role>). The interceptor here looks the method up in
ALLOWED_ROLES and refuses a caller of another role, of another namespace, or with no handoff identity
with PERMISSION_DENIED naming the role required, before the handler runs: no request stream is read,
nothing is allocated. Each refusal is logged and counted (handoff_authz_denied_total). A method not in
the table is refused too: a new RPC is closed until someone says who may call it. With TLS off there is
no identity to check, and every caller is let through (docs/operations.md, threat model).
"""
from __future__ import annotations

import logging

import grpc

from common.metrics import AUTHZ_DENIED as DENIED
from common.pki import Identity, parse_spiffe_id

log = logging.getLogger(__name__)

# method -> roles that may call it. Health and reflection are open to every authenticated peer
# (probes, grpcurl with the operator's certificate); the kubelet's probes use the plaintext health port.
ALLOWED_ROLES: dict[str, frozenset[str]] = {
    "/handoff.v1.PrefillWorker/Prefill": frozenset({"router"}),
    "/handoff.v1.DecodeWorker/Decode": frozenset({"router"}),
    "/handoff.v1.DecodeWorker/DecodeSession": frozenset({"router"}),
    # Only prefill workers push KV: no decode worker hands KV to another.
    "/handoff.v1.KVTransfer/PushKV": frozenset({"prefill"}),
    "/handoff.v1.KVTransfer/CachedPrefix": frozenset({"prefill"}),
}
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")



def peer_identity(context) -> tuple[Identity | None, str]:
    """The caller's handoff identity from its TLS certificate, and what to call it in a log line."""
    auth = context.auth_context() or {}
    ids = [v.decode(errors="replace") for v in auth.get("peer_spiffe_id", ())]
    if not ids:
        uris = [v.decode(errors="replace") for v in auth.get("peer_uri", ())]
        return None, f"a certificate without one SPIFFE ID (URI SANs: {uris or 'none'})"
    identity = parse_spiffe_id(ids[0])
    return identity, ids[0]


def refusal(method: str, caller: Identity | None, caller_text: str, own: Identity | None) -> str | None:
    """Why `caller` may not call `method` on a server of identity `own`; None when it may."""
    if method.startswith(OPEN_PREFIXES):
        return None
    allowed = ALLOWED_ROLES.get(method)
    if allowed is None:
        return f"{method} is callable by no role"
    need = " or ".join(sorted(allowed))
    if caller is None:
        return f"{method} requires role {need}; the caller presented {caller_text}, not a handoff identity"
    if own is not None and caller.namespace != own.namespace:
        return (f"{method} requires role {need} of namespace {own.namespace}; the caller is {caller.spiffe_id} "
                f"(another deployment)")
    if caller.role not in allowed:
        return f"{method} requires role {need}; the caller is {caller.spiffe_id} (role {caller.role})"
    return None


class AuthorizationInterceptor(grpc.ServerInterceptor):
    """Refuses, before the handler runs, every call whose TLS peer may not call the method (threaded servers).

    `own` is this server's identity (from its certificate): callers must be of its namespace.
    """

    def __init__(self, own: Identity | None):
        self.own = own

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        own = self.own

        def guarded(behavior):
            def call(request_or_iterator, context):
                caller, caller_text = peer_identity(context)
                why = refusal(method, caller, caller_text, own)
                if why is not None:
                    DENIED.labels(method, caller.role if caller else "none").inc()
                    log.warning("%s: PERMISSION_DENIED for %s (%s): %s", method, caller_text, context.peer(), why)
                    context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
                return behavior(request_or_iterator, context)
            return call

        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behavior = getattr(handler, kind)
            if behavior:
                return handler._replace(**{kind: guarded(behavior)})
        return handler
