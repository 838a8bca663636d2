"""The gRPC contract: stubs build and import, rebuilds are no-ops, every proto element is documented."""
from __future__ import annotations

import importlib.resources
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

import protos
from protos import codegen

ROOT = codegen.ROOT


def test_stubs_import_and_expose_the_services():
    from protos import handoff_pb2, handoff_pb2_grpc, internal_pb2, internal_pb2_grpc

    def methods(module, service):
        svc = module.DESCRIPTOR.services_by_name[service]
        return {m.name: (m.input_type.name, m.output_type.name, m.client_streaming, m.server_streaming)
                for m in svc.methods}

    assert methods(handoff_pb2, "Router") == {
        "Generate": ("GenerateRequest", "GenerateResponse", False, True)}
    assert methods(internal_pb2, "PrefillWorker") == {
        "Prefill": ("PrefillRequest", "PrefillEvent", False, True)}
    assert methods(internal_pb2, "DecodeWorker") == {
        "Decode": ("DecodeRequest", "DecodeEvent", False, True),
        "DecodeSession": ("SessionRequest", "SessionEvents", True, True)}
    assert methods(internal_pb2, "KVTransfer") == {
        "PushKV": ("KVChunk", "PushKVReply", True, False),
        "CachedPrefix": ("CachedPrefixRequest", "CachedPrefixReply", False, False)}
    for stub in ("RouterStub", "add_RouterServicer_to_server"):
        assert hasattr(handoff_pb2_grpc, stub)
    for stub in ("PrefillWorkerStub", "DecodeWorkerStub", "KVTransferStub", "add_KVTransferServicer_to_server"):
        assert hasattr(internal_pb2_grpc, stub)
    # internal.proto reuses the public enum rather than redefining it.
    reason = internal_pb2.DecodeEvent.DESCRIPTOR.fields_by_name["finish_reason"].enum_type
    assert reason is handoff_pb2.FinishReason.DESCRIPTOR
    assert [v.name for v in reason.values] == ["FINISH_REASON_UNSPECIFIED", "FINISH_REASON_STOP",
                                               "FINISH_REASON_LENGTH", "FINISH_REASON_CANCELLED",
                                               "FINISH_REASON_ERROR"]


# The field names other modules code against; renaming one breaks them, so it must fail here first.
CONTRACT = {
    "handoff": {
        "ChatMessage": ["role", "content", "tool_calls", "tool_call_id"],
        "Tool": ["name", "description", "parameters_json"],
        "ToolCall": ["id", "name", "arguments_json"],
        "GenerateRequest": ["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                            "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
                            "stop_token_ids", "request_id", "ignore_eos", "logprobs", "top_logprobs",
                            "prompt_token_ids", "structured_output", "tools", "tool_choice", "tool_name",
                            "parallel_tool_calls"],
        "StructuredOutput": ["json_schema", "json_object", "regex", "choice", "grammar"],
        "Choices": ["choices"],
        "TokenLogprob": ["token_id", "logprob", "top_logprobs"],
        "TopLogprob": ["token_id", "logprob"],
        "GenerateResponse": ["text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens",
                             "ttft_s", "decode_s", "request_id", "seed", "logprobs"],
    },
    "internal": {
        "SamplingParams": ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                           "frequency_penalty", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos",
                           "logprobs", "structured_output"],
        "KVTarget": ["worker_id", "kv_address", "epoch", "reservation_id", "attempt"],
        "PrefillRequest": ["request_id", "prompt_ids", "sampling", "target", "output_ids"],
        "FirstToken": ["token_id", "queue_s", "prefill_s", "cached_tokens", "finished", "logprob"],
        "TransferDone": ["kv_bytes", "num_chunks", "transfer_s", "skipped_tokens", "exposed_s", "num_segments"],
        "PrefillEvent": ["first_token", "transfer_done"],
        "DecodeRequest": ["request_id", "epoch", "prompt_ids", "sampling", "kv_wait_s", "output_ids", "attempt",
                          "prefill_here", "traceparent"],
        "DecodeEvent": ["token_ids", "finish_reason", "kv_wait_s", "decode_s", "logprobs"],
        "SessionRequest": ["start", "cancel"],
        "SessionCancel": ["request_id", "attempt"],
        "SessionEvent": ["request_id", "attempt", "event", "status_code", "status_message"],
        "SessionEvents": ["events"],
        "ModelFingerprint": ["weights_id", "num_layers", "num_kv_heads", "head_dim", "block_size", "dtype"],
        "KVHeader": ["request_id", "target_worker_id", "target_epoch", "fingerprint", "num_tokens",
                     "total_bytes", "num_chunks", "layout", "reservation_id", "attempt", "prefix_hashes",
                     "segment_tokens"],
        "CachedPrefixRequest": ["block_hashes"],
        "CachedPrefixReply": ["num_blocks"],
        "KVData": ["index", "offset", "payload", "crc32"],
        "KVChunk": ["header", "data"],
        "PushKVReply": ["request_id", "num_tokens", "kv_bytes"],
    },
}


@pytest.mark.parametrize("proto", sorted(CONTRACT))
def test_messages_have_the_contracted_fields(proto):
    module = __import__(f"protos.{proto}_pb2", fromlist=["DESCRIPTOR"])
    got = {name: [f.name for f in msg.fields] for name, msg in module.DESCRIPTOR.message_types_by_name.items()}
    assert got == CONTRACT[proto]


def test_sampling_fields_distinguish_unset_from_zero():
    from protos import handoff_pb2, internal_pb2

    request = handoff_pb2.GenerateRequest.DESCRIPTOR
    optional = {f.name for f in request.fields if f.has_presence}
    assert optional == {"max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                        "presence_penalty", "frequency_penalty", "seed", "top_logprobs",
                        "structured_output"}  # a message field: set or not
    req = handoff_pb2.GenerateRequest(prompt="hi", temperature=0.0)
    assert req.HasField("temperature") and not req.HasField("top_p")
    assert internal_pb2.PrefillEvent(first_token=internal_pb2.FirstToken()).WhichOneof("event") == "first_token"
    assert not internal_pb2.DecodeEvent().HasField("finish_reason")


# --- Every proto element carries a comment ---------------------------------------------------------

def undocumented(root: Path, proto_files: list[Path]) -> list[str]:
    """Names of the messages, fields, oneofs, enums, values, services and rpcs without a comment.

    protoc parses the files (with --include_source_info) so the check sees exactly what protoc
    sees; a comment counts if it is directly above the element or trails it on its line.
    """
    from grpc_tools import protoc

    out = root / "descriptor_set.pb"
    with importlib.resources.as_file(importlib.resources.files("grpc_tools") / "_proto") as wkt_dir:
        exit_code = protoc.main(["protoc", f"-I{root}", f"-I{wkt_dir}", "--include_source_info",
                                 f"--descriptor_set_out={out}", *map(str, proto_files)])
    assert exit_code == 0, "protoc could not parse the protos"
    missing = []
    for file in descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file:
        documented = {tuple(loc.path) for loc in file.source_code_info.location
                      if (loc.leading_comments + loc.trailing_comments).strip()}

        def check(path: tuple[int, ...], name: str) -> None:
            if path not in documented:
                missing.append(f"{file.name}: {name}")

        def walk_enum(enum, path, prefix):
            check(path, f"enum {prefix}{enum.name}")
            for j, value in enumerate(enum.value):
                check((*path, 2, j), f"enum value {prefix}{enum.name}.{value.name}")

        def walk_message(msg, path, prefix):
            name = f"{prefix}{msg.name}"
            check(path, f"message {name}")
            for j, field in enumerate(msg.field):
                check((*path, 2, j), f"field {name}.{field.name}")
            synthetic = {f.oneof_index for f in msg.field if f.proto3_optional}  # `optional` makes these
            for j, oneof in enumerate(msg.oneof_decl):
                if j not in synthetic:
                    check((*path, 8, j), f"oneof {name}.{oneof.name}")
            for j, nested in enumerate(msg.nested_type):
                walk_message(nested, (*path, 3, j), f"{name}.")
            for j, enum in enumerate(msg.enum_type):
                walk_enum(enum, (*path, 4, j), f"{name}.")

        for i, msg in enumerate(file.message_type):
            walk_message(msg, (4, i), "")
        for i, enum in enumerate(file.enum_type):
            walk_enum(enum, (5, i), "")
        for i, service in enumerate(file.service):
            check((6, i), f"service {service.name}")
            for j, method in enumerate(service.method):
                check((6, i, 2, j), f"rpc {service.name}.{method.name}")
    return missing


def test_every_proto_element_is_documented(tmp_path):
    (tmp_path / "protos").mkdir()
    for path in codegen.proto_paths():
        shutil.copy(path, tmp_path / "protos" / path.name)
    assert undocumented(tmp_path, codegen.proto_paths(tmp_path)) == []


def test_undocumented_check_catches_a_missing_comment(tmp_path):
    (tmp_path / "bad.proto").write_text(
        'syntax = "proto3";\n'
        "package t;\n"
        "// Documented.\n"
        "message M {\n"
        "  // Documented.\n"
        "  int32 a = 1;\n"
        "  int32 b = 2;\n"
        "  optional int32 c = 3;  // Documented on its line.\n"
        "\n"
        "  oneof o { int32 d = 4; }\n"
        "}\n"
        "enum E { E_UNSPECIFIED = 0; }\n"
        "service S { rpc Call(M) returns (M); }\n")
    assert undocumented(tmp_path, [tmp_path / "bad.proto"]) == [
        "bad.proto: field M.b", "bad.proto: field M.d", "bad.proto: oneof M.o", "bad.proto: enum E",
        "bad.proto: enum value E.E_UNSPECIFIED", "bad.proto: service S", "bad.proto: rpc S.Call"]


def test_optional_sampling_fields_document_their_default():
    text = codegen.proto_paths()[0].read_text()
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "seed"):
        lines = text.splitlines()
        at = next(i for i, line in enumerate(lines) if line.strip().startswith("optional") and f" {name} =" in line)
        comment = []
        for line in reversed(lines[:at]):
            if not line.strip().startswith("//"):
                break
            comment.append(line)
        assert "Default" in " ".join(comment), f"{name}: the comment must state the default"


# --- Building ---------------------------------------------------------------------------------------

def _fresh_root(tmp_path: Path) -> Path:
    (tmp_path / "protos").mkdir()
    for path in codegen.proto_paths():
        shutil.copy(path, tmp_path / "protos" / path.name)
    return tmp_path


def _mtimes(root: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in codegen.output_paths(root)}


def test_build_once_then_no_op_until_a_proto_changes(tmp_path, capfd):
    root = _fresh_root(tmp_path)
    assert codegen.is_stale(root)
    assert codegen.ensure_built(root) is True
    before = _mtimes(root)
    capfd.readouterr()
    assert codegen.ensure_built(root) is False
    assert _mtimes(root) == before
    assert capfd.readouterr() == ("", "")
    internal_py = (root / "protos" / "internal_pb2.py").read_text()
    assert "from protos import handoff_pb2" in internal_py
    assert not list((root / "protos").glob(".build-*")), "the temporary build folder was left behind"

    later_ns = max(before.values()) + 5_000_000_000
    os.utime(root / "protos" / "handoff.proto", ns=(later_ns, later_ns))
    assert codegen.is_stale(root)
    assert codegen.ensure_built(root) is True
    assert not codegen.is_stale(root)


def test_build_rebuilds_a_missing_output(tmp_path):
    root = _fresh_root(tmp_path)
    codegen.ensure_built(root)
    (root / "protos" / "internal_pb2.pyi").unlink()
    assert codegen.ensure_built(root) is True
    assert (root / "protos" / "internal_pb2.pyi").exists()


def test_broken_proto_fails_loudly(tmp_path):
    root = _fresh_root(tmp_path)
    with open(root / "protos" / "internal.proto", "a") as f:
        f.write("message Broken { int32 = 1; }\n")
    with pytest.raises(RuntimeError, match="protoc failed"):
        codegen.ensure_built(root)


def test_concurrent_builds_all_succeed(tmp_path):
    root = _fresh_root(tmp_path)
    code = "import sys, pathlib; from protos.codegen import ensure_built; ensure_built(pathlib.Path(sys.argv[1]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(root)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(4)]
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err.decode()
    assert not codegen.is_stale(root)
    assert not list((root / "protos").glob(".build-*"))
    for path in codegen.output_paths(root):
        if path.suffix == ".py":
            compile(path.read_text(), str(path), "exec")


def test_build_command_is_silent_when_up_to_date():
    assert not codegen.is_stale()  # `import protos` above built them
    before = _mtimes(ROOT)
    done = subprocess.run([sys.executable, "-m", "protos.build"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert _mtimes(ROOT) == before


def test_generated_stubs_are_not_committed():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files", "protos"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    assert [p for p in tracked if "_pb2" in p] == []
    for path in codegen.output_paths():
        rel = str(path.relative_to(ROOT))
        assert subprocess.run(["git", "check-ignore", "-q", rel], cwd=ROOT).returncode == 0, \
            f"{rel} is not git-ignored"


def test_fresh_clone_imports_without_make(tmp_path):
    # `python -m router` on a fresh clone relies on this: importing the package builds the stubs.
    (tmp_path / "protos").mkdir()
    for path in Path(protos.__file__).parent.iterdir():
        if path.suffix in (".py", ".proto") and "_pb2" not in path.name:
            shutil.copy(path, tmp_path / "protos" / path.name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "from protos import internal_pb2; print(internal_pb2.KVChunk.DESCRIPTOR.full_name)"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "handoff.v1.KVChunk"
    assert "compiled" in done.stderr  # the one line a rebuild prints
    again = subprocess.run([sys.executable, "-m", "protos.build"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=60)
    assert (again.returncode, again.stdout, again.stderr) == (0, "", "")
