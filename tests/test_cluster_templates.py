"""The Kubernetes template as a cluster would read it, no cluster needed: both of its variants
(the static coordinator, and the etcd rendezvous rendered by the sed command its header
documents) parse, hold only known kinds, put the restart policy and the rendezvous address
where JobSet and Kubernetes read them, select the JobSet's own pods in the NetworkPolicy,
and run a command jaxdist's own parsers accept for the devices the pods get.

(tests/test_launch_faults.py::test_the_jobset_admits_only_its_own_pods checks the policy's
exact selector and sources; this file checks what the rendered variants must satisfy.)
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from jaxdist import launch
from jaxdist.cli import config_from_args, parse_args, train_arg_parser
from jaxdist.cluster import distributed, elastic
from jaxdist.layout.mesh import mesh_device_count, parse_mesh
from jaxdist.layout.validate import check_config_on_mesh

REPO = Path(__file__).resolve().parent.parent
JOBSET = REPO / "configs/launch/jobset.yaml"
KNOWN_KINDS = {
    ("jobset.x-k8s.io/v1alpha2", "JobSet"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("v1", "Service"),
    ("v1", "ConfigMap"),
    ("v1", "PersistentVolumeClaim"),
}
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"  # the Job controller sets it on Indexed pods
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")  # Kubernetes' $(VAR) in command, args and env values
POD_IP = "10.0.0.5"  # what the downward API would give pod 1
POD_INDEX = 1


def documented_sed() -> str:
    """The command the template's header gives for the etcd variant, without `| kubectl apply`."""
    header = []
    for line in JOBSET.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line[1:].strip())
    start = next(i for i, line in enumerate(header) if line.startswith("sed "))
    command = " ".join(header[start : start + 2]).replace("\\ ", "")
    assert command.endswith("| kubectl apply -f -"), command
    return command.removesuffix("| kubectl apply -f -")


def render(variant: str) -> str:
    if variant == "static":
        return JOBSET.read_text()
    proc = subprocess.run(["bash", "-c", documented_sed()], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def documents(variant: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(render(variant)) if d is not None]


@pytest.fixture(params=["static", "etcd"])
def variant(request):
    return request.param, documents(request.param)


def _jobset(docs: list[dict]) -> dict:
    (jobset,) = [d for d in docs if d["kind"] == "JobSet"]
    return jobset


def _pods(jobset: dict):
    """(replicated job, its Job spec, its pod spec, the labels JobSet and the Job controller put on its pods)."""
    name = jobset["metadata"]["name"]
    for rjob in jobset["spec"]["replicatedJobs"]:
        job = rjob["template"]["spec"]
        pod = job["template"]
        labels = dict(pod.get("metadata", {}).get("labels", {}))
        labels |= {
            JOBSET_NAME_LABEL: name,
            "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
            "jobset.sigs.k8s.io/replicatedjob-replicas": str(rjob.get("replicas", 1)),
            "jobset.sigs.k8s.io/job-index": "0",
        }
        yield rjob, job, pod["spec"], labels


def _env_values(container: dict, labels: dict, annotations: dict) -> dict[str, str]:
    """Each env var as the kubelet would set it; a downward-API path must name a field the pod has
    (a wrong label or annotation key gives an empty string, silently), a $(VAR) in a value an earlier var."""
    values: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            for ref in VAR_REF.findall(var["value"]):
                assert ref in values, f"env {var['name']} refers to $({ref}) before it is defined"
            values[var["name"]] = VAR_REF.sub(lambda m: values[m.group(1)], var["value"])
            continue
        path = var["valueFrom"]["fieldRef"]["fieldPath"]
        found = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        if found:
            source = labels if found.group(1) == "labels" else annotations
            assert found.group(2) in source, f"env {var['name']}: the pod has no {found.group(1)[:-1]} {found.group(2)!r}"
            values[var["name"]] = source[found.group(2)]
        else:
            assert path in ("status.podIP", "metadata.name", "metadata.namespace", "spec.nodeName", "status.hostIP"), path
            values[var["name"]] = {"status.podIP": POD_IP}.get(path, "x")
    return values


def _command(container: dict, values: dict[str, str]) -> list[str]:
    words = [*container.get("command", []), *container.get("args", [])]
    for word in words:
        for ref in VAR_REF.findall(word):  # Kubernetes leaves an undefined $(VAR) as it is
            assert ref in values, f"{word!r} refers to $({ref}), which the container's env does not define"
    return [VAR_REF.sub(lambda m: values[m.group(1)], word) for word in words]


def _container_context(docs):
    jobset = _jobset(docs)
    ((rjob, job, pod, labels),) = list(_pods(jobset))
    (container,) = pod["containers"]
    values = _env_values(container, labels, {COMPLETION_INDEX_ANNOTATION: str(POD_INDEX)})
    return jobset, rjob, job, pod, labels, container, _command(container, values)


def test_the_etcd_variant_is_rendered_whole():
    static, rendered = render("static"), render("etcd")
    assert static.count("# BEGIN static") == static.count("# END static") > 0
    assert static.count("# BEGIN etcd") == static.count("# END etcd") > 0
    assert not re.search(r"^\s*# (BEGIN|END) ", rendered, re.MULTILINE)
    assert "jaxdist.launch" in rendered and "--num-processes" not in rendered
    assert not re.search(r"^\s*#\s+- --", rendered, re.MULTILINE)  # no flag left commented out


def test_every_document_is_a_kind_the_cluster_knows(variant):
    _, docs = variant
    assert [(d["apiVersion"], d["kind"]) for d in docs if (d["apiVersion"], d["kind"]) not in KNOWN_KINDS] == []
    for doc in docs:
        assert DNS_LABEL.fullmatch(doc["metadata"]["name"]), doc["metadata"]["name"]
    jobset = _jobset(docs)
    for rjob, _, _, _ in _pods(jobset):  # pod hostnames NAME-JOB-INDEX-POD are DNS labels: 63 characters at most
        assert len(f"{jobset['metadata']['name']}-{rjob['name']}-{rjob.get('replicas', 1) - 1}-99") <= 63


def test_the_restart_policy_is_where_jobset_and_kubernetes_read_it(variant):
    name, docs = variant
    jobset = _jobset(docs)
    assert isinstance(jobset["spec"]["failurePolicy"]["maxRestarts"], int) and jobset["spec"]["failurePolicy"]["maxRestarts"] >= 1
    for _, job, pod, _ in _pods(jobset):
        assert "failurePolicy" not in job and "restartPolicy" not in job  # a Job reads neither there
        assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"]
        assert all("restartPolicy" not in c for c in pod["containers"])  # only sidecar init containers take one
        if name == "static":  # a JAX process group cannot take a restarted member back: the whole set restarts
            assert (pod["restartPolicy"], job["backoffLimit"]) == ("Never", 0)
        else:  # a failed launcher restarts in its pod and joins the next generation
            assert pod["restartPolicy"] == "OnFailure" and job["backoffLimit"] >= 1


def test_the_network_policy_admits_the_jobs_pods_on_the_coordinator_port(variant):
    name, docs = variant
    jobset = _jobset(docs)
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert policy["metadata"].get("namespace") == jobset["metadata"].get("namespace")  # a policy selects pods of its namespace only
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress open: the etcd service, the registry
    _, _, _, _, labels, container, command = _container_context(docs)

    def selects(selector: dict) -> bool:
        assert set(selector) <= {"matchLabels"}, selector  # matchExpressions would need evaluating
        return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())

    assert selects(policy["spec"]["podSelector"])
    own = [rule for rule in policy["spec"]["ingress"] if any(selects(src["podSelector"]) for src in rule["from"] if "podSelector" in src)]
    assert own, "no ingress rule admits the JobSet's own pods"
    if name == "static":
        port = int(next(w for w in command if w.startswith("--coordinator=")).rsplit(":", 1)[1])
        assert port in [p["containerPort"] for p in container["ports"]]
        assert any("ports" not in rule or port in [p.get("port") for p in rule["ports"]] for rule in own)
    else:  # node 0 picks its coordinator's port: only a rule without a port list admits it
        assert any("ports" not in rule for rule in own)


def _run_dir_on_a_shared_volume(run_dir: str, pod: dict, container: dict) -> None:
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    mount = next((path for path in mounts if Path(run_dir).is_relative_to(path)), None)
    assert mount is not None, f"--run-dir {run_dir} is on no volume: a restarted pod would lose its checkpoints"
    volume = next(v for v in pod["volumes"] if v["name"] == mounts[mount])
    assert "persistentVolumeClaim" in volume, volume


def test_the_static_command_parses_as_jaxdist_train_reads_it(monkeypatch):
    docs = documents("static")
    for var in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID, distributed.ENV_COORDINATOR_BIND):
        monkeypatch.delenv(var, raising=False)
    jobset, rjob, job, pod, _, container, command = _container_context(docs)
    assert command[:3] == ["python", "-m", "jaxdist.train"]
    args = parse_args(train_arg_parser(), command[3:])
    group = distributed.process_group_from(args)
    subdomain = jobset["spec"].get("network", {}).get("subdomain", jobset["metadata"]["name"])
    assert jobset["spec"].get("network", {}).get("enableDNSHostnames", True)
    host = f"{jobset['metadata']['name']}-{rjob['name']}-0-0.{subdomain}"  # JobSet's name for pod 0 of job 0
    pods = job["parallelism"] * rjob.get("replicas", 1)
    assert (group.coordinator.rsplit(":", 1)[0], group.num_processes, group.process_id, group.bind) == (host, pods, POD_INDEX, POD_IP)
    config = config_from_args(args)
    sizes = parse_mesh(config.parallel.mesh)
    assert mesh_device_count(sizes) == pods * container["resources"]["limits"]["nvidia.com/gpu"]
    check_config_on_mesh(config, sizes)  # what jaxdist.train checks before it starts: the batch splits, the heads divide
    _run_dir_on_a_shared_volume(args.run_dir, pod, container)


def test_the_etcd_command_parses_as_jaxdist_launch_reads_it():
    docs = documents("etcd")
    jobset, rjob, job, pod, _, container, command = _container_context(docs)
    assert command[:3] == ["python", "-m", "jaxdist.launch"]
    args = launch.parse_args(command[3:])
    assert args.nodes and args.rdzv.startswith("etcd://") and (args.etcd_host, args.etcd_port) == ("etcd", 2379)
    rdzv_env = next(v for v in container["env"] if v["name"] == "JAXDIST_RDZV")
    assert args.rdzv == rdzv_env["value"]  # the address the kubelet puts in the command
    assert args.rdzv_id == jobset["metadata"]["name"]  # the same on every pod of the run
    assert args.coordinator_bind == POD_IP
    pods = job["parallelism"] * rjob.get("replicas", 1)
    assert args.max_nodes == pods  # a launcher per pod: a larger MAX would wait for pods that never come
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert args.nproc_per_node * args.devices_per_proc == gpus
    train = parse_args(train_arg_parser(), args.train_args)
    config = config_from_args(train)
    for nodes in range(args.min_nodes, args.max_nodes + 1):  # every size the run may shrink or grow to
        assert elastic.fit_problem(config, nodes * args.nproc_per_node, args.devices_per_proc, resuming=False) is None, nodes
    _run_dir_on_a_shared_volume(train.run_dir, pod, container)
