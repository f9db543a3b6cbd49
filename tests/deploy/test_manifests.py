"""deploy/kubernetes validates against the Kubernetes schemas and agrees with the image and
with ortbatch serve.

- Core objects (Deployment, Service, Pod, PersistentVolumeClaim): ``kubernetes-validate``'s
  strict schemas (no unknown field), for the oldest and the newest Kubernetes it knows.
- KServe's ServingRuntime and InferenceService, KubeRay's RayService: the operators' published
  CRD schemas (vendored in crds/, versions and sources in crds/README.md), with jsonschema,
  closed as ``kubectl apply``'s strict field validation closes them.
- Each kustomization builds (``kustomize build`` or ``kubectl kustomize``) into exactly the
  manifests of its folder, each of which validates.
- What the schemas cannot see: ports, probes, the drain's timing against
  terminationGracePeriodSeconds, the flags ``ortbatch serve`` is given (parsed by its own
  parser), the user the image runs as, the RayService's Serve config (parsed by Ray's own
  schema and ortbatch.ray's app_builder).
"""

from __future__ import annotations

import copy
import gzip
import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from ortbatch.cli import build_parser

from .manifests import (
    KUBE,
    all_documents,
    containers,
    dockerfile_instruction,
    documents,
    entrypoint_argv,
    env_of,
    kustomizations,
    kustomize_build,
    kustomize_command,
    manifest_files,
    one,
    prestop_seconds,
)

jsonschema = pytest.importorskip("jsonschema")  # the dev extra: collection goes on where it is missing

kubernetes_validate = pytest.importorskip("kubernetes_validate")

CRDS = Path(__file__).resolve().parent / "crds"
CRD_SCHEMAS = {
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "servingruntime-v1alpha1.json.gz",
    ("serving.kserve.io/v1beta1", "InferenceService"): "inferenceservice-v1beta1.json.gz",
    ("ray.io/v1", "RayService"): "rayservice-v1.json.gz",
}
#: the oldest and the newest Kubernetes whose schemas kubernetes-validate carries
K8S_VERSIONS = ("1.25.0", kubernetes_validate.latest_version())
#: what the drain needs beyond preStop and --graceful-timeout-s: closing the sessions, the exit
CLOSE_MARGIN_S = 10


def closed(schema: Any) -> Any:
    """``schema`` as the API server applies it with strict field validation: an object that
    lists its ``properties`` takes no other field, unless it preserves unknown fields."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: closed(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [closed(s) for s in out[key]]
    return out


@cache
def crd_validator(api_version: str, kind: str) -> jsonschema.Draft4Validator:
    schema = closed(json.loads(gzip.decompress((CRDS / CRD_SCHEMAS[api_version, kind]).read_bytes())))
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def validate(doc: dict[str, Any]) -> None:
    """Raise on the first schema error of ``doc`` (a core object or one of the CRs)."""
    key = (doc["apiVersion"], doc["kind"])
    if key in CRD_SCHEMAS:
        errors = sorted(crd_validator(*key).iter_errors(doc), key=lambda e: list(e.absolute_path))
        if errors:
            raise AssertionError(f"{doc['kind']} {doc['metadata']['name']}: {[e.message for e in errors]}")
        return
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


DOCS = all_documents()


@pytest.mark.parametrize(("path", "doc"), DOCS, ids=[f"{p.relative_to(KUBE)}:{d['kind']}" for p, d in DOCS])
def test_manifest_validates(path: Path, doc: dict[str, Any]) -> None:
    validate(doc)


@pytest.mark.parametrize(
    ("kind", "where", "change"),
    [
        ("Deployment", ["spec", "template", "spec", "containers", 0], {"imagePullPolicyy": "Always"}),
        ("Deployment", ["spec"], {"replicas": "1"}),
        ("Service", ["spec", "ports", 0], {"port": "http"}),
        ("ServingRuntime", ["spec", "containers", 0], {"imagePullPolicyy": "Always"}),
        ("ServingRuntime", ["spec", "containers", 0, "ports", 0], {"containerPort": "8080"}),
        ("InferenceService", ["spec", "predictor", "model"], {"storageURI": "pvc://x"}),
        ("RayService", ["spec", "rayClusterConfig", "headGroupSpec"], {"rayStartParam": {}}),
        ("RayService", ["spec", "rayClusterConfig", "workerGroupSpecs", 0], {"replicas": "2"}),
    ],
)
def test_the_validation_refuses_a_misspelt_field_or_a_wrong_type(
    kind: str, where: list[Any], change: dict[str, Any]
) -> None:
    doc = copy.deepcopy(one(kind))
    node = doc
    for step in where:
        node = node[step]
    node.update(change)
    with pytest.raises((AssertionError, kubernetes_validate.ValidationError)):
        validate(doc)


def _resources(folder: Path) -> list[Path]:
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    return [(folder / r).resolve() for r in kustomization["resources"]]


def _objects(folder: Path) -> list[tuple[str, str]]:
    """(kind, name) of what ``folder``'s kustomization holds: its files' and its bases'."""
    out: list[tuple[str, str]] = []
    for r in _resources(folder):
        out += _objects(r) if r.is_dir() else [(d["kind"], d["metadata"]["name"]) for d in documents(r)]
    return sorted(out)


def test_every_manifest_is_in_a_kustomization() -> None:
    listed = {r for folder in kustomizations() for r in _resources(folder) if r.is_file()}
    assert set(manifest_files()) == listed


@pytest.mark.parametrize("folder", kustomizations(), ids=lambda f: str(f.relative_to(KUBE.parent)))
def test_kustomize_builds_the_folders_manifests(folder: Path) -> None:
    command = kustomize_command()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is installed: the files are validated one by one above")
    built = kustomize_build(command, folder)
    assert sorted((d["kind"], d["metadata"]["name"]) for d in built) == _objects(folder)
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    images = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in kustomization.get("images", [])}
    for doc in built:
        for c in containers(doc):
            assert c["image"] in images.values(), f"{doc['kind']}: image {c['image']} not set by the kustomization"
        validate(doc)


def test_gpu_overlay_asks_for_a_gpu_and_cuda(tmp_path: Path) -> None:
    command = kustomize_command()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is installed: the overlay's patch is not applied here")
    (deployment,) = (d for d in kustomize_build(command, KUBE / "gpu") if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"].endswith("-gpu")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    args = _serve_args(container, tmp_path, "repository")
    assert args.providers == "cuda"
    _check_drain(container, pod["terminationGracePeriodSeconds"], args)


# -- what the schemas cannot see ---------------------------------------------------------------


def _serve_args(container: dict[str, Any], tmp_path: Path, mount: str) -> Any:
    """What ``ortbatch serve`` is given in ``container``: its entry point run under its env
    and args, with ``mount`` (export or repository) where the env says, parsed by serve's parser."""
    env = env_of(container)
    where = env.pop("ORTBATCH_MODELS")
    local = tmp_path / "models"
    if mount == "export":
        local.mkdir()
        (local / "ortbatch.json").write_text("{}")
    else:
        (local / "minilm").mkdir(parents=True)
    argv = entrypoint_argv({**env, "ORTBATCH_MODELS": str(local)}, container.get("args", []), tmp_path)
    assert argv[0] == "serve"
    args = build_parser().parse_args(argv)
    args.models_mount = where
    return args


def _check_drain(container: dict[str, Any], grace_s: float, args: Any) -> None:
    """SIGTERM comes after preStop; serve then drains for up to --graceful-timeout-s and closes:
    all of it must fit in terminationGracePeriodSeconds (else the kubelet kills mid-drain)."""
    assert args.graceful_timeout_s is not None
    assert grace_s >= prestop_seconds(container) + args.graceful_timeout_s + CLOSE_MARGIN_S


def _check_probes(container: dict[str, Any], http_port: int) -> None:
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    paths = {}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert ports.get(get["port"], get["port"]) == http_port, probe
        paths[probe] = get["path"]
    assert paths == {
        "startupProbe": "/v2/health/live",
        "readinessProbe": "/v2/health/ready",  # 503 while draining: out of the Service at once
        "livenessProbe": "/v2/health/live",
    }


def _image_user() -> int:
    (user,) = dockerfile_instruction("USER")
    return int(user.split(":")[0])


def test_deployment_serves_the_repository_on_its_ports_and_drains_within_the_grace(tmp_path: Path) -> None:
    deployment = one("Deployment", "ortbatch")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = _serve_args(container, tmp_path, "repository")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (args.host, args.port, args.grpc_port) == ("0.0.0.0", ports["http"], ports["grpc"])
    assert args.repository is not None and args.directory == []
    _check_probes(container, ports["http"])
    _check_drain(container, pod["terminationGracePeriodSeconds"], args)
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts[args.models_mount]["readOnly"] is True
    assert {"/tmp", "/dev/shm"} <= set(mounts)  # the root file system is read-only
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsUser"] == _image_user()
    assert container["resources"]["requests"] == container["resources"]["limits"]
    volume = {v["name"]: v for v in pod["volumes"]}[mounts[args.models_mount]["name"]]
    assert volume["persistentVolumeClaim"]["claimName"] == one("PersistentVolumeClaim")["metadata"]["name"]


def test_service_selects_the_deployments_pods_and_names_its_ports() -> None:
    deployment, service = one("Deployment", "ortbatch"), one("Service", "ortbatch")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    named = {p["name"] for p in container["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == named
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert grpc["appProtocol"] == "kubernetes.io/h2c"


def test_copy_pod_writes_the_volume_the_servers_read() -> None:
    pod = one("Pod", "ortbatch-exports-copy")
    (volume,) = pod["spec"]["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == one("PersistentVolumeClaim")["metadata"]["name"]
    assert pod["spec"]["securityContext"]["fsGroup"] == _image_user()


def test_kserve_runtime_serves_the_isvcs_model_by_its_name_on_kserves_ports(tmp_path: Path) -> None:
    runtime, isvc = one("ServingRuntime"), one("InferenceService")
    (container,) = runtime["spec"]["containers"]
    # KServe fills the container's templates from the InferenceService's metadata
    filled = json.loads(json.dumps(container).replace("{{.Name}}", isvc["metadata"]["name"]))
    args = _serve_args(filled, tmp_path, "export")
    assert args.models_mount == "/mnt/models"  # where KServe's storage initializer puts the model
    assert args.directory == [str(tmp_path / "models")] and args.name == isvc["metadata"]["name"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (args.host, args.port, args.grpc_port) == ("0.0.0.0", 8080, 9000)
    assert container["ports"][0]["containerPort"] == 8080  # KServe's Service sends port 80 to the first
    assert "grpc" in ports  # KServe marks a port named grpc/h2c as h2c
    _check_probes(container, 8080)
    _check_drain(container, isvc["spec"]["predictor"]["terminationGracePeriodSeconds"], args)
    assert container["securityContext"]["runAsUser"] == _image_user()
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    assert {"v2", "grpc-v2"} <= set(runtime["spec"]["protocolVersions"])
    assert model["storageUri"].startswith(f"pvc://{one('PersistentVolumeClaim')['metadata']['name']}/")


def test_rayservice_serve_config_is_read_by_ray_and_ortbatch(tmp_path: Path) -> None:
    pytest.importorskip("ray.serve")
    from ray.serve.schema import ServeDeploySchema

    from ortbatch.ray import app_builder

    service = one("RayService")
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema(**config)  # what KubeRay hands to Ray Serve
    (application,) = config["applications"]
    assert application["import_path"] == "ortbatch.ray:app_builder"
    export = tmp_path / Path(application["args"]["directory"]).name
    export.mkdir()
    app = app_builder({**application["args"], "directory": str(export)})  # refuses an unknown arg
    deployment = app._bound_deployment
    assert deployment.ray_actor_options == application["args"]["ray_actor_options"]
    assert deployment._deployment_config.autoscaling_config.max_replicas == 8
    claims = {
        v["persistentVolumeClaim"]["claimName"]
        for group in [service["spec"]["rayClusterConfig"]["headGroupSpec"]]
        + service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        for v in group["template"]["spec"]["volumes"]
    }
    assert claims == {one("PersistentVolumeClaim")["metadata"]["name"]}
