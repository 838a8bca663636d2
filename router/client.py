"""python -m router.client: call Generate and stream the text to the terminal.

    python -m router.client --prompt "Once upon a time" --max-tokens 64
    python -m router.client --message user:"Why is the sky blue?" --temperature 0.7 --seed 1
    HANDOFF_API_KEY=... python -m router.client --tls-ca ca.crt --target router.example.com:443 --prompt Hi
"""
from __future__ import annotations

import argparse
import sys
import time

import grpc

from common import cli, grpc_common, security
from common.security import TLSConfig
from protos import handoff_pb2, handoff_pb2_grpc

FINISH_NAMES = {v: k.removeprefix("FINISH_REASON_").lower()
                for k, v in handoff_pb2.FinishReason.items()}


def build_request(args) -> handoff_pb2.GenerateRequest:
    req = handoff_pb2.GenerateRequest(prompt=args.prompt or "", request_id=args.request_id or "",
                                      stop=args.stop or [], stop_token_ids=args.stop_token_id or [],
                                      ignore_eos=args.ignore_eos)
    for m in args.message or []:
        role, sep, content = m.partition(":")
        if not sep:
            raise SystemExit(f"--message must look like role:content, got {m!r}")
        req.messages.add(role=role, content=content)
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(req, name, value)
    return req


def stream(target: str, request: handoff_pb2.GenerateRequest, timeout_s: float | None, out=sys.stdout, *,
           tls: TLSConfig | None = None, api_key: str | None = None) -> dict:
    """Stream one Generate call to `out`; returns the last message's figures.

    tls: None = plaintext; a TLSConfig (possibly empty: the system's roots) = TLS.
    """
    credentials = None
    if tls is not None:
        credentials = security.channel_credentials(tls) if tls.enabled else grpc.ssl_channel_credentials()
    channel = grpc_common.channel(target, credentials=credentials, server_name=tls.server_name if tls else None,
                                max_message_bytes=grpc_common.MAX_PUBLIC_MESSAGE_BYTES)
    stub = handoff_pb2_grpc.RouterStub(channel)
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    t0 = time.perf_counter()
    t_first, num_tokens, last = None, 0, None
    try:
        for msg in stub.Generate(request, timeout=timeout_s, metadata=metadata):
            if t_first is None and (msg.text or msg.token_ids):
                t_first = time.perf_counter()
            num_tokens += len(msg.token_ids)
            out.write(msg.text)
            out.flush()
            last = msg
    finally:
        channel.close()
    t_end = time.perf_counter()
    decode_s = t_end - (t_first or t_end)
    return {
        "finish_reason": FINISH_NAMES.get(last.finish_reason, "?") if last else "none",
        "prompt_tokens": last.prompt_tokens if last else 0,
        "completion_tokens": last.completion_tokens if last else 0,
        "ttft_s": (t_first - t0) if t_first else None,
        "tokens_per_s": (num_tokens - 1) / decode_s if num_tokens > 1 and decode_s > 0 else None,
        "seed": last.seed if last else None,
    }


def add_request_flags(p: argparse.ArgumentParser, prompt_help: str = "raw text to continue (no chat template)") -> None:
    p.add_argument("--prompt", help=prompt_help)
    p.add_argument("--message", action="append", help="a chat message role:content (repeatable)")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--presence-penalty", type=float)
    p.add_argument("--frequency-penalty", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--stop-token-id", action="append", type=int)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--request-id")
    p.add_argument("--timeout-s", type=float, default=300.0, help="the request's deadline")


def add_connection_flags(p: argparse.ArgumentParser) -> None:
    cli.add_flag(p, "--api-key", "HANDOFF_API_KEY", None,
                 "sent as 'authorization: Bearer <key>'; prefer the environment variable (ps shows flags)")
    p.add_argument("--tls", action="store_true", help="use TLS, verifying the router by the system's roots")
    cli.add_flag(p, "--tls-ca", "HANDOFF_TLS_CA", None, "CA bundle that verifies the router (implies --tls)")
    cli.add_flag(p, "--tls-cert", "HANDOFF_TLS_CERT", None, "client certificate, if the router requires one")
    cli.add_flag(p, "--tls-key", "HANDOFF_TLS_KEY", None, "the private key of --tls-cert")
    cli.add_flag(p, "--tls-server-name", "HANDOFF_TLS_SERVER_NAME", None,
                 "name expected in the router's certificate, when --target names it otherwise")


def connection_tls(args) -> TLSConfig | None:
    """None = plaintext; an empty TLSConfig = TLS with the system's roots."""
    if not (args.tls or args.tls_ca or args.tls_cert or args.tls_key):
        return None
    return TLSConfig(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca, server_name=args.tls_server_name)


def print_summary(figures: dict) -> None:
    ttft = f"{figures['ttft_s'] * 1000:.0f} ms" if figures["ttft_s"] is not None else "-"
    tps = f"{figures['tokens_per_s']:.1f}" if figures["tokens_per_s"] is not None else "-"
    print(f"\n[finish: {figures['finish_reason']}; prompt {figures['prompt_tokens']} tokens, "
          f"completion {figures['completion_tokens']} tokens; time to first token {ttft}; "
          f"{tps} tokens/s; seed {figures['seed']}]", file=sys.stderr)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="localhost:50051", help="the router's host:port")
    add_request_flags(p)
    add_connection_flags(p)
    args = p.parse_args(argv)
    if not args.prompt and not args.message:
        p.error("give --prompt or at least one --message")
    try:
        tls = connection_tls(args)
        if tls is not None:
            security.check(tls)
    except ValueError as exc:
        p.error(str(exc))
    try:
        print_summary(stream(args.target, build_request(args), args.timeout_s, tls=tls, api_key=args.api_key))
    except grpc.RpcError as exc:
        print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
