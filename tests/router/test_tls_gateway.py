"""The TLS gateway: forwards any gRPC call byte for byte to a plaintext upstream (no Ray, no model)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent import futures

import grpc
import pytest
from tls_certs import self_signed

from draftmesh.client import MeshClient, build_request
from draftmesh.router.tls_gateway import (
    STARTING,
    TlsConfigError,
    TlsGateway,
    load_tls_files,
    method_kinds,
    server_streaming_methods,
)
from draftmesh.v1 import generation_pb2 as pb
from draftmesh.v1 import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

WORDS = ["Hello", ",", " world", "!"]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tls_pair():
    return self_signed()


class FakeGeneration(pb_grpc.GenerationServicer):
    """A stand-in for the Ray Serve proxy: a few deltas then a result; echoes metadata."""

    def __init__(self):
        self.metadata: list[dict] = []
        self.time_remaining: list[float | None] = []
        self.requests: list[pb.GenerateRequest] = []
        self.cancelled = threading.Event()
        self.cancelled_at: float | None = None

    def _enter(self, request, context):
        md = {}
        for key, value in context.invocation_metadata():
            md[key] = value
        self.metadata.append(md)
        self.time_remaining.append(context.time_remaining())
        self.requests.append(request)
        if request.prompt == "bad":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: 'bad' is not allowed (rule: no bad prompts)")
        if request.prompt == "trailing":
            context.set_trailing_metadata((("request_id", "req-42"), ("x-extra-bin", b"\x00\x01\xff")))
        return md

    def _words(self, md):
        return WORDS + [f" [auth={md.get('authorization', 'none')}]"]

    def _result(self, md) -> pb.GenerateResult:
        words = self._words(md)
        return pb.GenerateResult(
            request_id="r1",
            text="".join(words),
            token_ids=list(range(len(words))),
            finish_reason="length",
            usage=pb.Usage(prompt_tokens=3, completion_tokens=len(words), steps=2),
            sources=[pb.SourceStats(source="history", nodes=4, accepted_tokens=2, acceptance=0.5)],
            mean_accepted_per_step=2.5,
            policy="exact",
            lossless=True,
            seconds=0.5,
            first_token_ms=12.5,
            replica="fake-0",
        )

    def _mark_cancelled(self):
        if not self.cancelled.is_set():
            self.cancelled_at = time.monotonic()
            self.cancelled.set()

    def Generate(self, request, context):
        md = self._enter(request, context)
        if request.prompt == "slow":
            try:
                for i in range(400):
                    if not context.is_active():
                        self._mark_cancelled()
                        return
                    yield pb.GenerateResponse(delta=pb.GenerateDelta(text=f"{i} ", token_ids=[i]))
                    time.sleep(0.05)
            finally:
                # The server stops pulling from a generator whose RPC is gone and closes it.
                if not context.is_active():
                    self._mark_cancelled()
            return
        for i, word in enumerate(self._words(md)):
            yield pb.GenerateResponse(
                delta=pb.GenerateDelta(text=word, token_ids=[i], stats=pb.StepStats(step=i + 1, emitted=1))
            )
        yield pb.GenerateResponse(result=self._result(md))

    def Complete(self, request, context):
        md = self._enter(request, context)
        return self._result(md)


def _ray_like_handler():
    # Ray Serve's own unary-unary API (not in our protos): raw bytes in and out.
    def healthz(request: bytes, context) -> bytes:
        return b"success:" + request

    return grpc.method_handlers_generic_handler(
        "ray.serve.RayServeAPIService", {"Healthz": grpc.unary_unary_rpc_method_handler(healthz)}
    )


@pytest.fixture
def upstream():
    servicer = FakeGeneration()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((_ray_like_handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(0)


@pytest.fixture
def gateway(upstream, tls_pair):
    addr, servicer = upstream
    cert, key = tls_pair
    handle = TlsGateway(addr, 0, cert, key).run_in_thread()
    yield handle, servicer
    handle.stop(0)


def _client(handle, tls_pair, **kw) -> MeshClient:
    return MeshClient(f"localhost:{handle.port}", tls_ca=tls_pair[0], **kw)


# --------------------------------------------------------------------------- method kinds


def test_streaming_methods_come_from_the_descriptors():
    kinds = method_kinds()
    assert kinds["/draftmesh.v1.Generation/Generate"] == "unary_stream"
    assert kinds["/draftmesh.v1.Generation/Complete"] == "unary_unary"
    streaming = server_streaming_methods()
    assert "/draftmesh.v1.Generation/Generate" in streaming
    assert "/draftmesh.v1.Generation/Complete" not in streaming
    assert "/ray.serve.RayServeAPIService/Healthz" not in kinds  # defaults to unary-unary


# --------------------------------------------------------------------------- forwarding


def test_complete_and_generate_through_tls(gateway, tls_pair):
    handle, servicer = gateway
    assert handle.port > 0
    with _client(handle, tls_pair, api_key="sekrit", timeout_s=10) as client:
        result = client.complete(build_request("hi", max_new_tokens=5))
        assert result.text == "Hello, world! [auth=Bearer sekrit]"
        assert result.replica == "fake-0" and result.lossless

        responses = list(client.generate(build_request("hi")))
    deltas = [r.delta for r in responses if r.WhichOneof("event") == "delta"]
    assert [d.text for d in deltas] == WORDS + [" [auth=Bearer sekrit]"]
    assert [d.stats.step for d in deltas] == [1, 2, 3, 4, 5]
    assert responses[-1].WhichOneof("event") == "result"
    assert responses[-1].result.text == "".join(d.text for d in deltas)
    # The request arrives unchanged, and the metadata reaches the upstream.
    assert servicer.requests[0].max_new_tokens == 5
    assert all(md["authorization"] == "Bearer sekrit" for md in servicer.metadata)
    assert not any(k.startswith(":") for md in servicer.metadata for k in md)


def test_ray_serve_metadata_and_trailers_are_forwarded(gateway, tls_pair):
    handle, servicer = gateway
    creds = grpc.ssl_channel_credentials(root_certificates=tls_pair[0])
    with grpc.secure_channel(f"localhost:{handle.port}", creds) as channel:
        stub = pb_grpc.GenerationStub(channel)
        md = (("application", "draftmesh"), ("request_id", "abc"), ("multiplexed_model_id", "m1"),
              ("x-bin-thing-bin", b"\x00\x02"))
        result, call = stub.Complete.with_call(build_request("trailing"), metadata=md, timeout=10)
        assert result.text.startswith("Hello")
        trailing = dict(call.trailing_metadata())
        assert trailing["request_id"] == "req-42"
        assert trailing["x-extra-bin"] == b"\x00\x01\xff"
        seen = servicer.metadata[-1]
        assert seen["application"] == "draftmesh"
        assert seen["request_id"] == "abc"
        assert seen["multiplexed_model_id"] == "m1"
        assert seen["x-bin-thing-bin"] == b"\x00\x02"
        assert 5 < servicer.time_remaining[-1] <= 10.5  # the client's deadline travels upstream (rounded up)

        # A method outside our protos (Ray Serve's Healthz) is forwarded as unary-unary.
        healthz = channel.unary_unary("/ray.serve.RayServeAPIService/Healthz")
        assert healthz(b"ping", timeout=10) == b"success:ping"


def test_invalid_argument_comes_through_unchanged(gateway, tls_pair):
    handle, _ = gateway
    with _client(handle, tls_pair, timeout_s=10) as client:
        with pytest.raises(grpc.RpcError) as unary:
            client.complete(build_request("bad"))
        with pytest.raises(grpc.RpcError) as stream:
            list(client.generate(build_request("bad")))
    for err in (unary.value, stream.value):
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details() == "prompt: 'bad' is not allowed (rule: no bad prompts)"


def test_unknown_method_is_unimplemented(gateway, tls_pair):
    handle, _ = gateway
    creds = grpc.ssl_channel_credentials(root_certificates=tls_pair[0])
    with grpc.secure_channel(f"localhost:{handle.port}", creds) as channel:
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary("/nope.Service/Missing")(b"", timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_deadline_exceeded_cancels_upstream(gateway, tls_pair):
    handle, servicer = gateway
    with _client(handle, tls_pair, timeout_s=0.6) as client:
        got = []
        with pytest.raises(grpc.RpcError) as err:
            for response in client.generate(build_request("slow")):
                got.append(response)
        expired_at = time.monotonic()
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert got, "some deltas arrived before the deadline"
    assert servicer.cancelled.wait(2.0), "the upstream call was not cancelled"
    assert servicer.cancelled_at - expired_at < 1.0


def test_client_cancel_cancels_upstream(gateway, tls_pair):
    handle, servicer = gateway
    with _client(handle, tls_pair) as client:  # no deadline: only the cancel can stop it
        call = client.generate(build_request("slow"))
        first = next(call)
        assert first.delta.text == "0 "
        cancelled_at = time.monotonic()
        call.cancel()
        assert servicer.cancelled.wait(2.0), "the upstream call was not cancelled"
    assert servicer.cancelled_at - cancelled_at < 1.0
    assert servicer.time_remaining[-1] > 1e6  # no client deadline -> no upstream deadline


def test_insecure_client_is_refused(gateway):
    handle, servicer = gateway
    with MeshClient(f"localhost:{handle.port}", timeout_s=5) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.complete(build_request("hi"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert not servicer.requests


def test_untrusted_certificate_is_refused(gateway):
    handle, servicer = gateway
    other_ca, _ = self_signed()
    with MeshClient(f"localhost:{handle.port}", tls_ca=other_ca, timeout_s=5) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.complete(build_request("hi"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert not servicer.requests


def test_upstream_down_is_unavailable(tls_pair):
    # Nothing listens upstream: the client gets the upstream's UNAVAILABLE.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    with TlsGateway(dead, 0, *tls_pair, host="127.0.0.1").run_in_thread() as handle:
        with MeshClient(f"127.0.0.1:{handle.port}", tls_ca=tls_pair[0], timeout_s=5) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.complete(build_request("hi"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_async_start_stop(upstream, tls_pair):
    addr, _ = upstream

    async def main():
        gw = TlsGateway(addr, 0, *tls_pair, host="127.0.0.1")
        with pytest.raises(RuntimeError):
            gw.port
        port = await gw.start()
        assert port == gw.port > 0
        creds = grpc.ssl_channel_credentials(root_certificates=tls_pair[0])
        async with grpc.aio.secure_channel(f"localhost:{port}", creds) as channel:
            stub = pb_grpc.GenerationStub(channel)
            texts = [r.delta.text async for r in stub.Generate(build_request("hi"), timeout=10)
                     if r.WhichOneof("event") == "delta"]
        await gw.stop(0)
        return texts

    assert asyncio.run(main())[:4] == WORDS


def test_an_upstream_named_after_the_start(upstream, tls_pair):
    """The mesh's gateway starts before Serve's proxy port is chosen: it answers "starting" until it
    is connected and ready, then forwards to the upstream it was given."""
    addr, servicer = upstream
    with pytest.raises(ValueError, match="upstream"):
        TlsGateway(None, 0, *tls_pair)  # a gateway ready from the start needs its upstream
    with TlsGateway(None, 0, *tls_pair, host="127.0.0.1", ready=False).run_in_thread() as handle:
        with _client(handle, tls_pair) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.complete(build_request("hi"))
            assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNAVAILABLE, STARTING)
            with pytest.raises(RuntimeError, match="connect"):
                handle.set_ready()
            handle.connect(addr)
            handle.set_ready()
            assert client.complete(build_request("hi")).text.startswith("".join(WORDS))
    assert len(servicer.requests) == 1


def test_port_in_use_is_a_clear_error(gateway, tls_pair, upstream):
    handle, _ = gateway
    addr, _ = upstream
    with pytest.raises(OSError, match="could not bind"):
        TlsGateway(addr, handle.port, *tls_pair).run_in_thread()


# --------------------------------------------------------------------------- TLS files


def test_load_tls_files(tmp_path, tls_pair):
    cert, key = tls_pair
    (tmp_path / "cert.pem").write_bytes(cert)
    (tmp_path / "key.pem").write_bytes(key)
    assert load_tls_files(tmp_path / "cert.pem", str(tmp_path / "key.pem")) == (cert, key)

    with pytest.raises(TlsConfigError, match="certificate file not found"):
        load_tls_files(tmp_path / "missing.pem", tmp_path / "key.pem")
    with pytest.raises(TlsConfigError, match="private key file not found"):
        load_tls_files(tmp_path / "cert.pem", tmp_path / "missing.pem")
    with pytest.raises(TlsConfigError, match="directory"):
        load_tls_files(tmp_path, tmp_path / "key.pem")

    (tmp_path / "junk.pem").write_text("hello\n")
    with pytest.raises(TlsConfigError, match="not PEM"):
        load_tls_files(tmp_path / "junk.pem", tmp_path / "key.pem")
    with pytest.raises(TlsConfigError, match="not PEM"):
        load_tls_files(tmp_path / "cert.pem", tmp_path / "junk.pem")
    with pytest.raises(TlsConfigError, match="swapped"):
        load_tls_files(tmp_path / "key.pem", tmp_path / "cert.pem")
    (tmp_path / "empty.pem").write_bytes(b"")
    with pytest.raises(TlsConfigError, match="empty"):
        load_tls_files(tmp_path / "empty.pem", tmp_path / "key.pem")

    _, other_key = self_signed()
    (tmp_path / "other.pem").write_bytes(other_key)
    with pytest.raises(TlsConfigError, match="does not match"):
        load_tls_files(tmp_path / "cert.pem", tmp_path / "other.pem")

    assert issubclass(TlsConfigError, ValueError)
