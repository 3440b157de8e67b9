"""API keys and tenant isolation through a real mesh started with HOPLINE_API_KEYS.

Every call goes over real gRPC to real service processes; the key decides the tenant, and the
tenant decides which cache entries a request can ever see.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from conftest import DEFAULT_MODEL
from harness import TOPOLOGIES, Mesh, eventually
from hopline.protos.hopline.common.v1 import common_pb2
from hopline.protos.hopline.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from hopline.runtime.errors import TRACE_ID_METADATA
from polyglot import LANGUAGES, OUTPUT, run_example

# Every test here passes with the stateless stages in their own processes and in the gateway.
MESH_TOPOLOGIES = TOPOLOGIES

EXACT = common_pb2.CACHE_OUTCOME_EXACT
MISS = common_pb2.CACHE_OUTCOME_MISS

ACME_KEY = "acme-test-key-5d1c0f2e9b"
GLOBEX_KEY = "globex-test-key-a83e77c410"

Metadata = tuple[tuple[str, str], ...]


@pytest.fixture(scope="module")
def kmesh(default_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """The five services over a copy of the default repository, with API keys required."""
    work = tmp_path_factory.mktemp("kmesh")
    repo = work / "models"
    repo.mkdir()
    shutil.copytree(default_repo / DEFAULT_MODEL, repo / DEFAULT_MODEL)
    keys = work / "api-keys.json"
    keys.write_text(json.dumps({ACME_KEY: "acme", GLOBEX_KEY: "globex"}), encoding="utf-8")
    m = Mesh(
        repo,
        work,
        HOPLINE_API_KEYS=str(keys),
        HOPLINE_CACHE_FLUSH_MS="2",
        HOPLINE_CACHE_BUDGET_MS="2000",  # a slow CI machine must not turn hits into fail-opens
    )
    try:
        yield m.start()
    finally:
        m.stop()


def auth(key: str) -> Metadata:
    return (("authorization", f"Bearer {key}"),)


def ask(
    mesh: Mesh, text: str, metadata: Metadata = (), tenant: str = ""
) -> gateway_pb2.PredictResponse:
    with grpc.insecure_channel(mesh.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        request = gateway_pb2.PredictRequest(text=text, tenant=tenant)
        response: gateway_pb2.PredictResponse = stub.Predict(request, timeout=30, metadata=metadata)
        return response


def rejection(
    mesh: Mesh, text: str, metadata: Metadata = (), tenant: str = ""
) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        ask(mesh, text, metadata, tenant)
    return info.value.code(), info.value.details() or ""


TEXT = "I was charged twice for the same order"


def test_no_key_is_unauthenticated_with_instructions(kmesh: Mesh) -> None:
    for tenant in ("", "acme"):
        code, details = rejection(kmesh, TEXT, tenant=tenant)
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer <key>" in details, details


def test_who_is_asking_is_checked_before_what_is_asked(kmesh: Mesh) -> None:
    # A caller without a key learns nothing about its request (empty or oversized text).
    for text in ("", "x" * 20_000):
        code, _ = rejection(kmesh, text)
        assert code == grpc.StatusCode.UNAUTHENTICATED
    code, _ = rejection(kmesh, "", auth(ACME_KEY))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_request_that_does_not_parse_is_unauthenticated_without_a_key(kmesh: Mesh) -> None:
    """Its bytes were parsed first: INVALID_ARGUMENT told a caller without a key about its
    request. With a key, the same bytes are INVALID_ARGUMENT. Either refusal carries the
    call's trace id, as every failed Predict and ModelInfer does."""
    methods = (
        "/hopline.gateway.v1.GatewayService/Predict",
        "/hopline.gateway.v1.GatewayService/GetStats",
        "/inference.GRPCInferenceService/ModelInfer",
        "/inference.GRPCInferenceService/ModelConfig",
    )
    with grpc.insecure_channel(kmesh.gateway) as channel:
        for method in methods:
            call = channel.unary_unary(method, None, None)  # bytes as they are
            for metadata, code in (
                ((), grpc.StatusCode.UNAUTHENTICATED),
                (auth(ACME_KEY), grpc.StatusCode.INVALID_ARGUMENT),
            ):
                with pytest.raises(grpc.RpcError) as info:
                    call(b"\xff\xff\xff", timeout=30, metadata=metadata)
                assert info.value.code() == code, (method, metadata, info.value)
                # As every failed call: its trace id to find it by (it carried none).
                trailing = {m.key: str(m.value) for m in info.value.trailing_metadata() or ()}
                assert len(trailing.get(TRACE_ID_METADATA, "")) == 32, (method, trailing)


def test_a_stream_without_a_key_is_refused_whole(kmesh: Mesh) -> None:
    """Not each message: a caller without a valid key held a stream open as long as it
    liked, each message answered UNAUTHENTICATED. With a key, the stream serves."""
    message = gateway_pb2.PredictStreamRequest(
        id="s1", request=gateway_pb2.PredictRequest(text=TEXT)
    )
    with grpc.insecure_channel(kmesh.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for metadata in ((), auth("not-a-key")):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.PredictStream(iter([message]), timeout=30, metadata=metadata))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
        (reply,) = stub.PredictStream(iter([message]), timeout=30, metadata=auth(ACME_KEY))
    assert (reply.id, reply.code, reply.response.tenant) == ("s1", 0, "acme")


def test_wrong_key_is_unauthenticated(kmesh: Mesh) -> None:
    for metadata in (auth("not-a-key"), auth(ACME_KEY + "0"), (("authorization", ACME_KEY),)):
        code, details = rejection(kmesh, TEXT, metadata)
        assert code == grpc.StatusCode.UNAUTHENTICATED, metadata
        assert ACME_KEY not in details


def test_a_key_cannot_claim_another_tenant(kmesh: Mesh) -> None:
    code, details = rejection(kmesh, TEXT, auth(ACME_KEY), tenant="globex")
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "acme" in details
    assert "globex" in details
    metadata = (*auth(ACME_KEY), ("x-hopline-tenant", "globex"))
    code, _ = rejection(kmesh, TEXT, metadata)
    assert code == grpc.StatusCode.PERMISSION_DENIED


def test_a_repeated_key_or_tenant_header_is_refused_not_the_last_taken(kmesh: Mesh) -> None:
    """Taking the last of two let a refused claim through behind one the key allows (a
    proxy appending its own header decides which comes last)."""
    for first, second in ((GLOBEX_KEY, ACME_KEY), ("not-a-key", ACME_KEY), (ACME_KEY, ACME_KEY)):
        code, details = rejection(kmesh, TEXT, (*auth(first), *auth(second)))
        assert code == grpc.StatusCode.UNAUTHENTICATED, (first, second)
        assert "one 'authorization'" in details, details
    for tenants in (("globex", "acme"), ("acme", "acme")):
        metadata = (*auth(ACME_KEY), *(("x-hopline-tenant", t) for t in tenants))
        code, details = rejection(kmesh, TEXT, metadata)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, tenants
        assert "one 'x-hopline-tenant'" in details, details
    assert ask(kmesh, TEXT, (*auth(ACME_KEY), ("x-hopline-tenant", "acme"))).tenant == "acme"


def test_the_keys_tenant_scopes_the_cache(kmesh: Mesh) -> None:
    text = "how do I download last month's invoice as a pdf"
    first = ask(kmesh, text, auth(ACME_KEY))
    assert first.tenant == "acme"
    assert first.cache.outcome == MISS, first.cache
    kmesh.settle()

    again = ask(kmesh, text, auth(ACME_KEY), tenant="acme")  # naming its own tenant is fine
    assert again.tenant == "acme"
    assert again.cache.outcome == EXACT, again.cache
    assert again.cache.entry_id
    assert again.prediction.label == first.prediction.label

    # The identical text from globex never sees acme's entry.
    other = ask(kmesh, text, auth(GLOBEX_KEY))
    assert other.tenant == "globex"
    assert other.cache.outcome == MISS, other.cache
    assert other.prediction.label == first.prediction.label
    kmesh.settle()

    # globex now has an entry of its own, and acme still has its own.
    theirs = ask(kmesh, text, auth(GLOBEX_KEY))
    assert theirs.cache.outcome == EXACT, theirs.cache
    assert theirs.cache.entry_id
    assert theirs.cache.entry_id != again.cache.entry_id
    ours = ask(kmesh, text, auth(ACME_KEY))
    assert ours.cache.outcome == EXACT, ours.cache
    assert ours.cache.entry_id == again.cache.entry_id


def test_counters_and_model_configs_need_a_key_probes_do_not(kmesh: Mesh) -> None:
    """With keys configured, GetStats and KServe's ModelMetadata and ModelConfig answer only a
    caller with a valid key; liveness and readiness stay open to the probes that use them."""
    with grpc.insecure_channel(kmesh.gateway) as channel:
        stats = gateway_pb2_grpc.GatewayServiceStub(channel).GetStats
        for metadata in ((), auth("not-a-key")):
            with pytest.raises(grpc.RpcError) as refused:
                stats(gateway_pb2.GetStatsRequest(), timeout=30, metadata=metadata)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        counters = stats(gateway_pb2.GetStatsRequest(), timeout=30, metadata=auth(ACME_KEY))
        assert "requests" in counters.counters
    client = triton.InferenceServerClient(kmesh.gateway)
    try:
        for ask_for in (client.get_model_metadata, client.get_model_config):
            with pytest.raises(InferenceServerException) as info:
                ask_for(DEFAULT_MODEL)
            assert info.value.status() == "StatusCode.UNAUTHENTICATED", info.value
            # Who is asking first: a model that does not exist is not confirmed either.
            with pytest.raises(InferenceServerException) as info:
                ask_for("no-such-model")
            assert info.value.status() == "StatusCode.UNAUTHENTICATED", info.value
        headers = {"authorization": f"Bearer {GLOBEX_KEY}"}
        assert client.get_model_metadata(DEFAULT_MODEL, headers=headers).name == DEFAULT_MODEL
        assert client.get_model_config(DEFAULT_MODEL, headers=headers).config.name == DEFAULT_MODEL
        assert client.is_server_live()
        assert client.is_server_ready()
        assert client.is_model_ready(DEFAULT_MODEL)
    finally:
        client.close()


def hopline(mesh: Mesh, *args: str, api_key: str = "") -> subprocess.CompletedProcess[str]:
    """The `hopline` command as a user runs it, `api_key` (if any) in HOPLINE_API_KEY."""
    env = {k: v for k, v in os.environ.items() if k not in ("HOPLINE_API_KEY", "HOPLINE_API_KEYS")}
    env["HOPLINE_GATEWAY_ADDR"] = mesh.gateway
    if api_key:
        env["HOPLINE_API_KEY"] = api_key
    return subprocess.run(
        [sys.executable, "-m", "hopline", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_hopline_predict_sends_the_callers_key(kmesh: Mesh) -> None:
    """`hopline predict` against a keyed gateway: refused without a key (with what to do),
    the key from HOPLINE_API_KEY or --api-key names the tenant, and a key cannot claim
    another tenant."""
    text = "my card got charged two times, please check"
    refused = hopline(kmesh, "predict", text, "--json")
    assert refused.returncode == 1
    assert "UNAUTHENTICATED" in refused.stderr, refused.stderr
    assert "--api-key" in refused.stderr, refused.stderr
    by_env = hopline(kmesh, "predict", text, "--json", api_key=ACME_KEY)
    assert by_env.returncode == 0, by_env.stderr
    assert json.loads(by_env.stdout)["tenant"] == "acme"
    by_flag = hopline(kmesh, "predict", text, "--json", "--api-key", GLOBEX_KEY, api_key=ACME_KEY)
    assert by_flag.returncode == 0, by_flag.stderr
    assert json.loads(by_flag.stdout)["tenant"] == "globex"  # the flag over the environment
    claim = hopline(kmesh, "predict", text, "--tenant", "globex", api_key=ACME_KEY)
    assert claim.returncode == 1
    assert "PERMISSION_DENIED" in claim.stderr, claim.stderr
    assert "acme" in claim.stderr, claim.stderr


def test_hopline_bench_sends_the_callers_key(kmesh: Mesh, tmp_path: Path) -> None:
    """`hopline bench --api-key` measures a keyed gateway; without the key it says in one
    line that the gateway refused it and how to give the key (no traceback, no figures)."""
    out = tmp_path / "keyed.json"
    args = ("bench", "--target", kmesh.gateway, "--mix", "exact", "--baseline", "none",
            "--duration", "1", "--warmup", "0.2", "--model-repo", str(kmesh.repo))  # fmt: skip
    keyed = hopline(kmesh, *args, "--json", str(out), "--api-key", ACME_KEY)
    assert keyed.returncode == 0, keyed.stderr
    mesh = json.loads(out.read_text())["targets"]["mesh"]
    assert mesh["errors"] == 0, mesh["errors_by_status"]
    assert mesh["requests"] > 0
    assert set(mesh["cache_outcomes"]) == {"exact"}, mesh["cache_outcomes"]
    refused = hopline(kmesh, *args)
    assert refused.returncode == 1
    assert "mesh refused the cache-filling requests: UNAUTHENTICATED" in refused.stderr
    assert "--api-key" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr, refused.stderr


def test_cache_eval_says_why_a_keyed_gateway_cannot_be_evaluated(
    kmesh: Mesh, tmp_path: Path
) -> None:
    """`hopline cache eval` runs each pass as a fresh tenant, which keys do not allow: one
    line that says so and what to do, not a traceback. The data: a few texts in CLINC150's
    layout with the model's own intents (eval refuses a model that knows none of the data's
    intents before it sends anything)."""
    model = kmesh.repo / DEFAULT_MODEL
    latest = max((v for v in model.iterdir() if v.name.isdigit()), key=lambda v: int(v.name))
    labels = json.loads((latest / "labels.json").read_text())
    rows = [[f"a question about {label}", label] for label in labels[:2]]
    data = tmp_path / "data_full.json"
    data.write_text(json.dumps({"train": rows, "test": rows, "oos_test": [["hm", "oos"]]}))
    run = hopline(
        kmesh, "cache", "eval", "--clinc", str(data), "--model", DEFAULT_MODEL,
        "--model-repo", str(kmesh.repo), "--exact-repeats", "0", api_key=ACME_KEY,
    )  # fmt: skip
    assert run.returncode == 1
    assert "HOPLINE_API_KEYS" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr, run.stderr


@pytest.mark.parametrize("lang", LANGUAGES)
def test_the_generated_clients_send_a_key_from_the_environment(kmesh: Mesh, lang: str) -> None:
    """The Go, Java and Node examples send HOPLINE_API_KEY as `authorization: Bearer`, as
    `hopline predict` does; without it the keyed gateway refuses them."""
    text = f"please refund my last order ({lang})"
    refused = run_example(lang, kmesh.gateway, text, 10_000)
    assert refused.returncode == 1, refused.stdout
    assert refused.stderr.startswith("predict failed: UNAUTHENTICATED: "), refused.stderr
    answered = run_example(lang, kmesh.gateway, text, 10_000, api_key=ACME_KEY)
    assert answered.returncode == 0, answered.stderr
    match = OUTPUT.match(answered.stdout.strip())
    assert match, answered.stdout
    assert match["label"] == "refund_request"


def test_keys_added_and_revoked_in_the_file_take_effect_without_a_restart(kmesh: Mesh) -> None:
    """An operator adds initech's key to the file, then revokes it (a leaked key): the
    gateway re-reads the file within gateway/identity.py:KEYS_RECHECK_S of each change.
    Before, both waited for a restart of every gateway."""
    path = Path(kmesh.env["HOPLINE_API_KEYS"])
    original = path.read_text(encoding="utf-8")
    initech = "initech-test-key-7f30c1d9e2"
    keys = {ACME_KEY: "acme", GLOBEX_KEY: "globex"}
    try:
        path.write_text(json.dumps(keys | {initech: "initech"}), encoding="utf-8")
        assert status_within(kmesh, initech, grpc.StatusCode.OK) == ["initech"]

        path.write_text(json.dumps(keys), encoding="utf-8")
        status_within(kmesh, initech, grpc.StatusCode.UNAUTHENTICATED)
        assert ask(kmesh, TEXT, auth(ACME_KEY)).tenant == "acme"  # the others still are
    finally:
        path.write_text(original, encoding="utf-8")


def status_within(mesh: Mesh, key: str, wanted: grpc.StatusCode) -> list[str]:
    """Ask with `key` until the answer's status is `wanted`; the tenant of the last answer
    (none when it was refused)."""
    tenants: list[str] = []

    def answered_so() -> bool:
        try:
            tenants[:], code = [ask(mesh, TEXT, auth(key)).tenant], grpc.StatusCode.OK
        except grpc.RpcError as err:
            tenants[:], code = [], err.code()
        return code == wanted

    eventually(answered_so, f"{wanted.name} for the key", timeout_s=10.0)
    return tenants
